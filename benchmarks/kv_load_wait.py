"""D's early loads with and without the wait (`kv_load_wait_ms`, docs/pd.md "When D runs an imported request"):
`bench pd` on the demo workload (tiny model, 128 in / 32 out, Poisson arrivals, vLLM's client) with the collocated,
default (replay) and first-token arms, once with D's `kv_load_wait_ms` 0 and once at the default, alternating, for
--rounds rounds. Reports per setting and rate the medians over rounds of: median TTFT (and its ratio to the same
run's collocated arm), p99 ITL, and the first-token arm's p99 ITL against the default arm's (issue 35's targets).

    .venv/bin/python benchmarks/kv_load_wait.py                 # 2 rounds, ~6 min on 2 cores
    .venv/bin/python benchmarks/kv_load_wait.py --rounds 3 --waits 0,2,4

Writes benchmarks/results/kv_load_wait.json (and each run's bench pd results under --work-dir).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_file import write_result  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def bench_pd(model: str, wait_ms: float, out: Path, args) -> list[dict]:
    cmd = [sys.executable, "-m", "pdserve.cli", "bench", "pd", "--arms", "collocated,default,first-token",
           "--rates", args.rates, "--num-prompts", str(args.num_prompts), "--random-input-len", "128",
           "--random-output-len", "32", "--seed", str(args.seed), "--disable-tqdm", "--result-dir", str(out),
           "--kv-transfer-extra", json.dumps({"kv_load_wait_ms": wait_ms})]
    if model:
        cmd += ["--model", model]
    subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    return json.loads((out / "summary.json").read_text())["rows"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="Model dir (default: bench pd's tiny model).")
    ap.add_argument("--waits", default="0,2", help="D's kv_load_wait_ms values to alternate (default: 0,2).")
    ap.add_argument("--rounds", type=int, default=2, help="Rounds; each runs every wait once (default: 2).")
    ap.add_argument("--rates", default="2,8", help="Request rates (default: 2,8).")
    ap.add_argument("--num-prompts", type=int, default=24, help="Requests per rate and arm (default: 24).")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work-dir", default=None, help="Where the bench pd runs go (default: a temp dir).")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "kv_load_wait.json"))
    args = ap.parse_args()
    waits = [float(w) for w in args.waits.split(",")]
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="kv-load-wait-"))
    runs = []
    for r in range(args.rounds):
        order = waits if r % 2 == 0 else waits[::-1]  # alternating: neither setting always runs first
        for w in order:
            t0 = time.monotonic()
            rows = bench_pd(args.model, w, work / f"round{r}_wait{w:g}", args)
            runs.append({"round": r, "wait_ms": w, "rows": rows})
            print(f"round {r} wait {w:g} ms: {time.monotonic() - t0:.0f} s", flush=True)
    summary = []
    for w in waits:
        for rate in [float(q) for q in args.rates.split(",")]:
            per = {"wait_ms": w, "rate": rate}
            for arm in ("collocated", "default", "first-token"):
                rows = [row for run in runs if run["wait_ms"] == w for row in run["rows"]
                        if row["arm"] == arm and row["rate"] == rate]
                per[arm] = {k: statistics.median(row[k] for row in rows) for k in ("median_ttft_ms", "p99_itl_ms")}
                per[arm]["failed"] = sum(row["failed"] for row in rows)
            for arm in ("default", "first-token"):
                per[arm]["ttft_vs_collocated"] = statistics.median(
                    a["median_ttft_ms"] / c["median_ttft_ms"] for run in runs if run["wait_ms"] == w
                    for a in run["rows"] for c in run["rows"]
                    if a["arm"] == arm and c["arm"] == "collocated" and a["rate"] == c["rate"] == rate)
            per["first_token_p99_itl_vs_default"] = per["first-token"]["p99_itl_ms"] / per["default"]["p99_itl_ms"]
            summary.append(per)
    print(f"{'wait ms':>7} {'rate':>5} | {'coll TTFT':>9} | {'default TTFT':>12} {'x coll':>6} {'p99 ITL':>7} | "
          f"{'1st-tok TTFT':>12} {'x coll':>6} {'p99 ITL':>7} {'x default':>9}")
    for s in summary:
        d, f = s["default"], s["first-token"]
        print(f"{s['wait_ms']:>7g} {s['rate']:>5g} | {s['collocated']['median_ttft_ms']:>9.1f} | "
              f"{d['median_ttft_ms']:>12.1f} {d['ttft_vs_collocated']:>6.2f} {d['p99_itl_ms']:>7.1f} | "
              f"{f['median_ttft_ms']:>12.1f} {f['ttft_vs_collocated']:>6.2f} {f['p99_itl_ms']:>7.1f} "
              f"{s['first_token_p99_itl_vs_default']:>9.2f}")
    write_result(args.out, args, summary=summary, runs=runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
