"""A decode step's time alone and beside competing engine processes, by CPU thread policy (worker/cpu_threads.py).

    .venv/bin/python benchmarks/shared_cores.py                      # writes benchmarks/results/shared_cores.json
    .venv/bin/python benchmarks/shared_cores.py --models tiny --seconds 10

Policies of the measured engine: `fixed2` (OMP_NUM_THREADS=2: the count pdserve used before the governor, spinning
OpenMP threads on both cores), `fixed1` (OMP_NUM_THREADS=1) and `adaptive` (nothing set: the governor, today's
default). Conditions: `alone`, and `loaded` beside --load engine processes that each decode 8 requests without pause
(tiny model, with --load-policy's threads: `fixed2` is what pdserve processes did before, `adaptive` what they do
now). The measured engine decodes --rows requests (64-token prompts) for --seconds; the figure is its mean step time.
Arms alternate (policy order reversed every run). Run it on an otherwise quiet machine.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
POLICIES = {"fixed2": {"OMP_NUM_THREADS": "2"}, "fixed1": {"OMP_NUM_THREADS": "1"}, "adaptive": {}}
ENGINE = """
import sys, time, os
from pdserve import LLM, SamplingParams
model, rows, seconds, role = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
llm = LLM(model, max_model_len=2048)
eng = llm.engine
sp = SamplingParams(max_tokens=1500, ignore_eos=True, temperature=0)

def fill():
    for rid in list(eng.scheduler.requests):
        eng.abort_request(rid)
    for i in range(rows):
        eng.add_request([(i * 7 + j) % 500 + 3 for j in range(64)], sp)
fill()
for _ in range(5):
    eng.step()
print("engine running", flush=True)
end, n, t0 = time.monotonic() + seconds, 0, time.perf_counter()
while time.monotonic() < end:
    if llm.cpu_threads is not None:
        llm.cpu_threads.poll()
    eng.step()
    n += 1
    if n % 300 == 0:
        fill()
if role == "measure":
    g = llm.cpu_threads
    print("RESULT", (time.perf_counter() - t0) / n * 1e3, n, g.threads if g else -1, g.switches if g else 0,
          flush=True)
"""


def env_for(policy: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env.update(POLICIES[policy])
    env["PYTHONPATH"] = str(ROOT)
    return env


def start_load(model: str, n: int, policy: str, seconds: float) -> list[subprocess.Popen]:
    procs = [subprocess.Popen([sys.executable, "-c", ENGINE, model, "8", str(seconds), "load"], env=env_for(policy),
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) for _ in range(n)]
    for p in procs:  # each prints once its model is loaded and it decodes
        line = p.stdout.readline()
        if "engine running" not in line:
            raise RuntimeError("a competing engine did not start")
    time.sleep(2)
    return procs


def measure(model: str, rows: int, seconds: float, policy: str) -> dict:
    out = subprocess.run([sys.executable, "-c", ENGINE, model, str(rows), str(seconds), "measure"],
                         env=env_for(policy), capture_output=True, text=True, check=True, timeout=600)
    step, n, threads, switches = next(line for line in out.stdout.splitlines() if line.startswith("RESULT")).split()[1:]
    return {"step_ms": float(step), "steps": int(n), "threads_at_end": int(threads), "switches": int(switches)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="tiny,small", help="comma-separated make-model sizes to measure")
    ap.add_argument("--rows", type=int, default=8, help="requests the measured engine decodes at once")
    ap.add_argument("--seconds", type=float, default=15.0, help="measured seconds per arm")
    ap.add_argument("--load", type=int, default=2, help="competing engine processes in the loaded condition")
    ap.add_argument("--load-policy", choices=tuple(POLICIES), default="fixed2", help="the competing engines' thread "
                    "policy: fixed2 (pdserve processes before the governor) or adaptive (today's)")
    ap.add_argument("--runs", type=int, default=1, help="runs per arm (mean of the step times reported)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/shared_cores.json"), help="JSON result path")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from pdserve.model.make_model import ensure_model
    tiny = str(ensure_model("qwen3", "tiny", 0))
    results = []
    for size in args.models.split(","):
        model = str(ensure_model("qwen3", size, 0))
        per: dict[tuple[str, str], list[dict]] = {}
        for run in range(args.runs):
            order = list(POLICIES) if run % 2 == 0 else list(POLICIES)[::-1]
            for cond in ("alone", "loaded"):
                load = start_load(tiny, args.load, args.load_policy, args.seconds * len(order) + 60) \
                    if cond == "loaded" else []
                try:
                    for policy in order:
                        r = measure(model, args.rows, args.seconds, policy)
                        per.setdefault((policy, cond), []).append(r)
                        print(f"{size} run {run} {cond:6s} {policy:8s} step {r['step_ms']:7.2f} ms "
                              f"(threads at end {r['threads_at_end']}, switches {r['switches']})", flush=True)
                finally:
                    for p in load:
                        p.kill()
                        p.wait()
        for (policy, cond), rs in per.items():
            results.append({"model": size, "policy": policy, "condition": cond,
                            "step_ms": statistics.mean(r["step_ms"] for r in rs), "runs": rs})
    print(f"\n| model | policy | alone ms | beside {args.load} engines ({args.load_policy}) ms | loaded / alone |")
    print("|---|---|---|---|---|")
    for size in args.models.split(","):
        for policy in POLICIES:
            a, b = (next(r["step_ms"] for r in results if r["model"] == size and r["policy"] == policy and
                         r["condition"] == c) for c in ("alone", "loaded"))
            print(f"| {size} | {policy} | {a:.2f} | {b:.2f} | {b / a:.2f}x |")
    Path(args.out).write_text(json.dumps({"rows": args.rows, "seconds": args.seconds, "load": args.load,
                                          "load_policy": args.load_policy, "cpus": os.cpu_count(),
                                          "results": results}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
