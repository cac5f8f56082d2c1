"""Small steps on one thread (worker/cpu_threads.py `SmallSteps`) against the thread count in force, as a client
feels it (issue 34).

    .venv/bin/python benchmarks/small_steps.py                 # tiny and small, 2 rounds, ~8 min on 2 cores

Per model and round, two `pdserve serve` processes one after the other with their default thread handling (no
OMP_NUM_THREADS: the governor; `--env OMP_NUM_THREADS=2` pins the count in both), one with
`PDSERVE_SMALL_STEP_THREADS=0` (the rule off), in alternating order. Each gets (1) --sequential streamed requests
one at a time, --pause apart (a lone stream: its inter-token gaps after the first, p50/p90/p99 and the share over
4 ms), then (2) `pdserve bench serve` with Poisson arrivals (--rate, --num-prompts, --input-len / --output-len):
median TPOT and p99 ITL. Medians over rounds; writes benchmarks/results/small_steps.json. Run it on a quiet
machine.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_file import write_result  # noqa: E402

ARMS = {"on": {}, "off": {"PDSERVE_SMALL_STEP_THREADS": "0"}}


def lone_stream(url: str, name: str, n: int, pause: float, input_len: int, output_len: int) -> dict:
    gaps = []
    rng = random.Random(0)
    with httpx.Client(timeout=120) as c:
        for i in range(n + 3):  # the first 3 warm the server up
            body = {"model": name, "prompt": [rng.randrange(3, 8000) for _ in range(input_len)],
                    "max_tokens": output_len, "ignore_eos": True, "temperature": 0, "stream": True}
            times = []
            with c.stream("POST", url + "/v1/completions", json=body) as r:
                r.raise_for_status()
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        times.append(time.perf_counter())
            if i >= 3:
                gaps += [1e3 * (b - a) for a, b in zip(times[1:], times[2:])]
            time.sleep(pause)
    gaps.sort()
    k = len(gaps)
    return {"p50_ms": gaps[k // 2], "p90_ms": gaps[int(0.9 * k)], "p99_ms": gaps[int(0.99 * k)],
            "over_4ms": sum(g > 4 for g in gaps) / k, "gaps": k}


def poisson(url: str, model: str, args, out: Path) -> dict:
    subprocess.run([sys.executable, "-m", "pdserve.cli", "bench", "serve", "--base-url", url, "--model", model,
                    "--request-rate", str(args.rate), "--num-prompts", str(args.num_prompts),
                    "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
                    "--disable-tqdm", "--save-result", str(out)], cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    d = json.loads(out.read_text())
    return {"median_tpot_ms": d["median_tpot_ms"], "p99_itl_ms": d["p99_itl_ms"],
            "median_ttft_ms": d["median_ttft_ms"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tiny,small", help="qwen3 sizes made by `pdserve make-model`.")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--sequential", type=int, default=30, help="Lone-stream requests per server (default 30).")
    ap.add_argument("--pause", type=float, default=0.3, help="Seconds between lone-stream requests (default 0.3).")
    ap.add_argument("--rate", type=float, default=6.0, help="Poisson arrivals per second (default 6).")
    ap.add_argument("--num-prompts", type=int, default=48)
    ap.add_argument("--input-len", type=int, default=96)
    ap.add_argument("--output-len", type=int, default=24)
    ap.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                    help="Set in both servers' environment, e.g. OMP_NUM_THREADS=2 (the count pinned, as bench pd "
                         "pins it); repeatable.")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "small_steps.json"))
    args = ap.parse_args()
    env = dict(e.split("=", 1) for e in args.env)
    from pdserve.bench.launcher import Deployment, free_port
    from pdserve.model.make_model import ensure_model
    work = Path(tempfile.mkdtemp(prefix="small-steps-"))
    rows = []
    for size in args.models.split(","):
        model = str(ensure_model("qwen3", size, 0))
        for r in range(args.rounds):
            for arm in (("on", "off") if r % 2 == 0 else ("off", "on")):
                dep = Deployment(f"{size}-{arm}-r{r}", work)
                try:
                    url = dep.spawn("server", ["serve", model, "--log-level", "warning", "--max-model-len", "1024"],
                                    free_port(), {**env, **ARMS[arm]})
                    dep.wait_healthy(300)
                    lone = lone_stream(url, Path(model).name, args.sequential, args.pause, 128, 32)
                    arrivals = poisson(url, model, args, work / f"{size}-{arm}-r{r}.json")
                finally:
                    dep.stop()
                rows.append({"model": size, "arm": arm, "round": r, "lone": lone, "poisson": arrivals})
                print(f"{size} r{r} small steps {arm:>3}: lone p50 {lone['p50_ms']:.2f} p99 {lone['p99_ms']:.2f} "
                      f">4ms {100 * lone['over_4ms']:.1f}% | @{args.rate:g} req/s TPOT "
                      f"{arrivals['median_tpot_ms']:.2f} p99 ITL {arrivals['p99_itl_ms']:.2f} TTFT "
                      f"{arrivals['median_ttft_ms']:.1f}", flush=True)
    summary = {}
    for size in args.models.split(","):
        for arm in ARMS:
            sel = [x for x in rows if x["model"] == size and x["arm"] == arm]
            summary[f"{size}/{arm}"] = {
                "lone_p99_ms": statistics.median(x["lone"]["p99_ms"] for x in sel),
                "lone_over_4ms": statistics.median(x["lone"]["over_4ms"] for x in sel),
                "poisson_median_tpot_ms": statistics.median(x["poisson"]["median_tpot_ms"] for x in sel),
                "poisson_p99_itl_ms": statistics.median(x["poisson"]["p99_itl_ms"] for x in sel)}
            print(f"{size}/{arm}: " + ", ".join(f"{k} {v:.3f}" for k, v in summary[f'{size}/{arm}'].items()))
    write_result(args.out, args, summary=summary, rows=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
