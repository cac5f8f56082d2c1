"""`pdserve plan` against real two-node runs on this machine (issue 36, "Planner").

The deployments two nodes make here, run for real by `bench pd` (`collocated-x2`: two collocated servers behind
pdserve's router; `default`: 1P1D, D replaying; `first-token` with --pd-first-token prefill and the router's early
decode, its default; `first-token-late`: D asked after P answered), every node on one of
the two cores (one OpenMP thread each, as bench pd gives them), and ranked by `pdserve plan --nodes 2` on a profile
`pdserve sim calibrate --served --served-neighbours 1` measured at one thread and `--shared-host` (the two nodes
slow each other while both are mid-step, as they do here), with the same workload (lengths, rates, seed), the same
engine knobs as `pdserve serve`'s defaults, and the same SLOs (bench serve's --goodput form). Per rate the table
shows each deployment's share of requests meeting every SLO, real and simulated, and whether the two orders agree;
then the ranking by goodput per node at the best rate, as `pdserve plan` prints it, real and simulated.

    .venv/bin/python benchmarks/plan_validate.py                     # demo model, ~5 min on 2 cores
    .venv/bin/python benchmarks/plan_validate.py --rates 4,16 --goodput ttft:40 tpot:8

Run it on a quiet machine: the real runs are timed. Writes benchmarks/results/plan_validate.json (each run's files
under --work-dir).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_file import write_result  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
# bench pd's arm -> (pdserve plan's deployment, its --pd-first-token, its --pd-early-decode)
PLAN_OF = {"collocated-x2": ("collocated", "replay", True), "default": ("1p1d", "replay", True),
           "first-token": ("1p1d", "prefill", True), "first-token-late": ("1p1d", "prefill", False)}


def pdserve(*args: str, env: dict | None = None) -> None:
    subprocess.run([sys.executable, "-m", "pdserve.cli", *args], cwd=REPO, check=True, stdout=subprocess.DEVNULL,
                   env={**os.environ, **(env or {})})


def good_share(run: dict, slos_ms: dict[str, float]) -> float:
    """The share of a bench serve run's requests meeting every SLO, as bench serve's goodput counts them (a failed
    request is never good; TPOT of a one-token answer is 0)."""
    good = 0
    for ttft, latency, n, err in zip(run["ttfts"], run["latencies"], run["output_lens"], run["errors"]):
        if err or ttft is None:
            continue
        tpot = (latency - ttft) / (n - 1) if n > 1 else 0.0
        measured = {"ttft": ttft * 1000, "tpot": tpot * 1000, "e2el": latency * 1000}
        good += all(measured[k] <= v for k, v in slos_ms.items())
    return good / len(run["ttfts"])


def order(shares: dict[str, float], tol: float) -> list[list[str]]:
    """Arms from best to worst share; arms within `tol` of each other are one tie group."""
    groups: list[list[str]] = []
    for arm in sorted(shares, key=lambda a: -shares[a]):
        if groups and shares[groups[-1][0]] - shares[arm] <= tol:
            groups[-1].append(arm)
        else:
            groups.append([arm])
    return [sorted(g) for g in groups]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arms", default="collocated-x2,default,first-token",
                    help=f"bench pd's two-node arms, of {', '.join(PLAN_OF)} (default: "
                         "collocated-x2,default,first-token).")
    ap.add_argument("--rates", default="4,16", help="Request rates for the whole deployment (default: 4,16).")
    ap.add_argument("--goodput", nargs="+", default=["ttft:40", "tpot:8"], metavar="METRIC:MS",
                    help="The SLOs, bench serve's form (default: ttft:40 tpot:8).")
    ap.add_argument("--num-prompts", type=int, default=64, help="Requests per rate and arm (default: 64).")
    ap.add_argument("--random-input-len", type=int, default=128)
    ap.add_argument("--random-output-len", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tie", type=float, default=0.05,
                    help="Shares of good requests within this of each other are a tie in either order "
                         "(default: 0.05, 3 of 64 requests).")
    ap.add_argument("--kv-latency-ms", type=float, default=1.3, help="As sim_validate.py (default: 1.3).")
    ap.add_argument("--kv-bandwidth-gb-s", type=float, default=2.0)
    ap.add_argument("--router-latency-ms", type=float, default=2.6,
                    help="What the router adds per send, in every simulated arm here (all are behind it) (default: "
                         "2.6, benchmarks/results/pd_hops.json).")
    ap.add_argument("--profile", default=None, help="A profile to use instead of calibrating one (it must have been "
                                                    "measured at one thread, with --served and, unless --lone, "
                                                    "--served-neighbours 1).")
    ap.add_argument("--lone", action="store_true",
                    help="Simulate each node on a machine of its own (no --shared-host; the profile calibrated "
                         "without a neighbour), as before the neighbour model: the two nodes here share 2 cores.")
    ap.add_argument("--work-dir", default=None, help="Where the runs go (default: a temp dir).")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "plan_validate.json"))
    args = ap.parse_args()
    from pdserve.bench.metrics import parse_goodput
    from pdserve.config import SchedulerConfig
    from pdserve.model.make_model import ensure_model
    slos_ms = {k: v * 1000 for k, v in parse_goodput(args.goodput).items()}
    arms = [a for a in args.arms.split(",") if a]
    unknown = [a for a in arms if a not in PLAN_OF]
    if unknown:
        ap.error(f"--arms: {unknown[0]!r} is not one of {', '.join(PLAN_OF)}")
    rates = [float(r) for r in args.rates.split(",")]
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="plan-validate-"))
    work.mkdir(parents=True, exist_ok=True)
    model = str(ensure_model("qwen3", "tiny", 0))
    workload = ["--num-prompts", str(args.num_prompts), "--random-input-len", str(args.random_input_len),
                "--random-output-len", str(args.random_output_len), "--seed", str(args.seed)]
    profile = args.profile
    if profile is None:
        t0 = time.monotonic()
        profile = str(work / "tiny_threads1.json")
        pdserve("sim", "calibrate", "--model", model, "--out", profile, "--served",
                *([] if args.lone else ["--served-neighbours", "1"]), env={"OMP_NUM_THREADS": "1"})
        print(f"calibrated in {time.monotonic() - t0:.0f} s", flush=True)
    t0 = time.monotonic()
    real = work / "real"
    pdserve("bench", "pd", "--model", model, "--arms", ",".join(arms), "--rates", args.rates, *workload,
            "--disable-tqdm", "--result-dir", str(real))
    print(f"real runs in {time.monotonic() - t0:.0f} s", flush=True)
    sched = SchedulerConfig()  # pdserve serve's defaults, the real nodes' knobs
    sim = {}
    for first_token, early in sorted({PLAN_OF[a][1:] for a in arms}):
        deployments = sorted({PLAN_OF[a][0] for a in arms if PLAN_OF[a][1:] == (first_token, early)})
        out = work / (f"plan_{first_token}" + ("" if early else "_late"))
        pdserve("plan", "--profile", profile, "--nodes", "2", "--deployments", ",".join(deployments),
                "--request-rate", args.rates, *workload, "--goodput", *args.goodput,
                "--max-num-seqs", str(sched.max_num_seqs), "--max-num-batched-tokens",
                str(sched.max_num_batched_tokens), "--pd-first-token", first_token,
                "--pd-early-decode" if early else "--no-pd-early-decode",
                "--kv-latency-ms", str(args.kv_latency_ms), "--kv-bandwidth-gb-s", str(args.kv_bandwidth_gb_s),
                "--router-latency-ms", str(args.router_latency_ms), *([] if args.lone else ["--shared-host"]),
                "--plot-top", "0", "--quiet",
                "--result-dir", str(out))
        for c in json.loads((out / "plan.json").read_text())["ranking"]:
            arm = next(a for a in arms if PLAN_OF[a] == (c["deployment"].lower(), first_token, early))
            sim[arm] = {p["rate"]: p for p in c["points"]}
    rows, agree = [], []
    for rate in rates:
        shares = {"real": {}, "sim": {}}
        row = {"rate": rate, "arms": {}}
        for arm in arms:
            r = json.loads((real / f"{arm}_rate{rate:g}.json").read_text())
            s = sim[arm][rate]
            shares["real"][arm], shares["sim"][arm] = good_share(r, slos_ms), s["good_share"]
            row["arms"][arm] = {"real_good_share": shares["real"][arm], "sim_good_share": s["good_share"],
                                "real_median_ttft_ms": r["ttft_ms"]["median"], "sim_median_ttft_ms":
                                    s["ttft_ms"]["median"], "real_median_tpot_ms": r["tpot_ms"]["median"],
                                "sim_median_tpot_ms": s["tpot_ms"]["median"]}
        row["real_order"], row["sim_order"] = order(shares["real"], args.tie), order(shares["sim"], args.tie)
        row["agree"] = compatible(row["real_order"], row["sim_order"])
        agree.append(row["agree"])
        rows.append(row)
    print(f"SLOs: {' '.join(args.goodput)}; share of requests meeting every SLO, real / simulated")
    print(f"{'rate':>5} {'arm':>14} | {'good real':>9} {'sim':>5} | {'TTFT real':>9} {'sim':>6} | {'TPOT real':>9} "
          f"{'sim':>5}")
    for row in rows:
        for arm, a in row["arms"].items():
            print(f"{row['rate']:>5g} {arm:>14} | {a['real_good_share']:>9.0%} {a['sim_good_share']:>5.0%} | "
                  f"{a['real_median_ttft_ms']:>9.1f} {a['sim_median_ttft_ms']:>6.1f} | "
                  f"{a['real_median_tpot_ms']:>9.2f} {a['sim_median_tpot_ms']:>5.2f}")
        print(f"{'':>5} order real {fmt(row['real_order'])}, sim {fmt(row['sim_order'])}: "
              f"{'agree' if row['agree'] else 'DIFFER'}")
    print(f"the planner orders the deployments as the real runs do at {sum(agree)} of {len(agree)} rates")
    write_result(args.out, args, slos_ms=slos_ms, rows=rows, agree=f"{sum(agree)}/{len(agree)}")
    return 0


def fmt(groups: list[list[str]]) -> str:
    return " > ".join(" = ".join(g) for g in groups)


def compatible(a: list[list[str]], b: list[list[str]]) -> bool:
    """Whether two orders with ties never put a pair of arms the opposite way round (a tie agrees with either)."""
    rank_a = {arm: i for i, g in enumerate(a) for arm in g}
    rank_b = {arm: i for i, g in enumerate(b) for arm in g}
    return all((rank_a[x] - rank_a[y]) * (rank_b[x] - rank_b[y]) >= 0 for x in rank_a for y in rank_a)


if __name__ == "__main__":
    sys.exit(main())
