"""A/B of D's hand-off on `bench pd`'s demo workload (tiny model, 128 in / 32 out, Poisson arrivals, vLLM's client)
with the collocated, default (replay) and first-token arms (`--first-token-arm`: bench pd's first-token, the router's
default, early decode; first-token-early, the same with the flag given; first-token-late, D asked after P
answered): D's wait for early loads (`kv_load_wait_ms`, docs/pd.md "When D runs an imported request"), D's
direct hand-off under early decode (`--direct-handoff on,off`: `kv_connector_extra_config.direct_handoff`, docs/pd.md
"Early decode") and/or source trees (`--revs`: git revisions, each run from a worktree of its own with this venv;
"." is this working tree), every setting once a round, alternating, for --rounds rounds.
Reports per setting and rate the medians over rounds of: median TTFT (and its ratio to the same run's collocated
arm), p99 ITL, the first-token arm's p99 ITL against the default arm's (issue 35's targets), and the first-token
arm's first gap (P's token to D's first, from each request's ITLs: its median and p90) beside the p99 of its other
gaps.

    .venv/bin/python benchmarks/kv_load_wait.py                 # 2 rounds, ~6 min on 2 cores
    .venv/bin/python benchmarks/kv_load_wait.py --rounds 3 --waits 0,2,4
    .venv/bin/python benchmarks/kv_load_wait.py --revs aa8513c,. --waits 2
    .venv/bin/python benchmarks/kv_load_wait.py --waits 2 --direct-handoff on,off

Writes benchmarks/results/kv_load_wait.json (and each run's bench pd results under --work-dir).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_file import write_result  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def tree(rev: str, work: Path) -> Path:
    """The source tree of `rev`: this one for ".", else a detached worktree under `work`, made once."""
    if rev == ".":
        return REPO
    path = work / f"tree-{rev}"
    if not path.exists():
        subprocess.run(["git", "worktree", "add", "--detach", str(path), rev], cwd=REPO, check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return path


def first_gaps(run_dir: Path, arm: str, rate: float) -> dict:
    """The first-token arm's gaps at `rate`: the first (P's token to D's first) median and p90, the others' p99."""
    d = json.loads((run_dir / f"{arm}_rate{rate:g}.json").read_text())
    first = sorted(i[0] * 1e3 for i in d["itls"] if i)
    rest = sorted(g * 1e3 for i in d["itls"] for g in i[1:])
    pick = lambda v, q: v[min(len(v) - 1, round(q * (len(v) - 1)))] if v else float("nan")  # noqa: E731
    return {"first_gap_median_ms": pick(first, 0.5), "first_gap_p90_ms": pick(first, 0.9),
            "other_gaps_p99_ms": pick(rest, 0.99)}


def bench_pd(model: str, wait_ms: float, direct: str, out: Path, args, src: Path) -> list[dict]:
    arm = args.first_token_arm
    extra = {"kv_load_wait_ms": wait_ms, "kv_connector_extra_config": {"direct_handoff": direct == "on"}}
    cmd = [sys.executable, "-m", "pdserve.cli", "bench", "pd", "--arms", f"collocated,default,{arm}",
           "--rates", args.rates, "--num-prompts", str(args.num_prompts), "--random-input-len", "128",
           "--random-output-len", "32", "--seed", str(args.seed), "--disable-tqdm", "--result-dir", str(out),
           "--kv-transfer-extra", json.dumps(extra)]
    if model:
        cmd += ["--model", model]
    subprocess.run(cmd, cwd=src, check=True, stdout=subprocess.DEVNULL,
                   env={**os.environ, "PYTHONPATH": str(src)})
    rows = json.loads((out / "summary.json").read_text())["rows"]
    for row in rows:
        if row["arm"] == arm:  # reported as the first-token arm's
            row.update(first_gaps(out, arm, row["rate"]), arm="first-token", bench_arm=arm)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="Model dir (default: bench pd's tiny model).")
    ap.add_argument("--waits", default="0,2", help="D's kv_load_wait_ms values to alternate (default: 0,2).")
    ap.add_argument("--revs", default=".", help="Git revisions to alternate, '.' for this working tree (default: .).")
    ap.add_argument("--direct-handoff", default="on", help="D's direct hand-off under early decode, on and/or off, "
                    "to alternate (default: on; it matters only where D is asked early: not with first-token-late).")
    ap.add_argument("--first-token-arm", choices=("first-token", "first-token-early", "first-token-late"),
                    default="first-token", help="bench pd's first-token arm: the router's default (early decode), "
                    "the flag given, or --no-pd-early-decode (default: first-token).")
    ap.add_argument("--rounds", type=int, default=2, help="Rounds; each runs every wait once (default: 2).")
    ap.add_argument("--rates", default="2,8", help="Request rates (default: 2,8).")
    ap.add_argument("--num-prompts", type=int, default=24, help="Requests per rate and arm (default: 24).")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work-dir", default=None, help="Where the bench pd runs go (default: a temp dir).")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "kv_load_wait.json"))
    args = ap.parse_args()
    directs = args.direct_handoff.split(",")
    if not set(directs) <= {"on", "off"}:
        ap.error(f"--direct-handoff: on and/or off, got {args.direct_handoff!r}")
    settings = [(rev, float(w), d) for rev in args.revs.split(",") for w in args.waits.split(",") for d in directs]
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="kv-load-wait-"))
    runs = []
    try:
        for r in range(args.rounds):
            order = settings if r % 2 == 0 else settings[::-1]  # alternating: no setting always runs first
            for rev, w, d in order:
                t0 = time.monotonic()
                rows = bench_pd(args.model, w, d, work / f"round{r}_{rev.strip('.') or 'here'}_wait{w:g}_direct-{d}",
                                args, tree(rev, work))
                runs.append({"round": r, "rev": rev, "wait_ms": w, "direct_handoff": d, "rows": rows})
                print(f"round {r} rev {rev} wait {w:g} ms direct hand-off {d}: {time.monotonic() - t0:.0f} s",
                      flush=True)
    finally:  # the worktrees go (their runs' files stay under --work-dir)
        for rev in {rev for rev, _, _ in settings if rev != "."}:
            subprocess.run(["git", "worktree", "remove", "--force", str(work / f"tree-{rev}")], cwd=REPO,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    summary = []
    gap_keys = ("first_gap_median_ms", "first_gap_p90_ms", "other_gaps_p99_ms")
    for rev, w, d in settings:
        mine = [run for run in runs if run["rev"] == rev and run["wait_ms"] == w and run["direct_handoff"] == d]
        for rate in [float(q) for q in args.rates.split(",")]:
            per = {"rev": rev, "wait_ms": w, "direct_handoff": d, "first_token_arm": args.first_token_arm,
                   "rate": rate}
            for arm in ("collocated", "default", "first-token"):
                rows = [row for run in mine for row in run["rows"] if row["arm"] == arm and row["rate"] == rate]
                keys = ("median_ttft_ms", "p99_itl_ms") + (gap_keys if arm == "first-token" else ())
                per[arm] = {k: statistics.median(row[k] for row in rows) for k in keys}
                per[arm]["failed"] = sum(row["failed"] for row in rows)
            for arm in ("default", "first-token"):
                per[arm]["ttft_vs_collocated"] = statistics.median(
                    a["median_ttft_ms"] / c["median_ttft_ms"] for run in mine
                    for a in run["rows"] for c in run["rows"]
                    if a["arm"] == arm and c["arm"] == "collocated" and a["rate"] == c["rate"] == rate)
            per["first_token_p99_itl_vs_default"] = per["first-token"]["p99_itl_ms"] / per["default"]["p99_itl_ms"]
            summary.append(per)
    print(f"first-token arm: bench pd's {args.first_token_arm}")
    print(f"{'rev':>8} {'wait':>4} {'dir':>3} {'rate':>4} | {'coll TTFT':>9} | {'default TTFT':>12} {'x coll':>6} "
          f"{'p99 ITL':>7} | {'1st-tok TTFT':>12} {'x coll':>6} {'p99 ITL':>7} {'x default':>9} | "
          f"{'1st gap':>7} {'p90':>5} {'others p99':>10}")
    for s in summary:
        d, f = s["default"], s["first-token"]
        print(f"{s['rev']:>8} {s['wait_ms']:>4g} {s['direct_handoff']:>3} {s['rate']:>4g} | "
              f"{s['collocated']['median_ttft_ms']:>9.1f} | "
              f"{d['median_ttft_ms']:>12.1f} {d['ttft_vs_collocated']:>6.2f} {d['p99_itl_ms']:>7.1f} | "
              f"{f['median_ttft_ms']:>12.1f} {f['ttft_vs_collocated']:>6.2f} {f['p99_itl_ms']:>7.1f} "
              f"{s['first_token_p99_itl_vs_default']:>9.2f} | {f['first_gap_median_ms']:>7.1f} "
              f"{f['first_gap_p90_ms']:>5.1f} {f['other_gaps_p99_ms']:>10.1f}")
    write_result(args.out, args, summary=summary, runs=runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
