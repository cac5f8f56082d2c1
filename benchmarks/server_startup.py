"""A server's start and exit, as a test or a restart feels them: `pdserve serve` on the tiny model (engine in its own
process, one torch thread) started --runs times; each time the seconds to /health 200, the seconds from SIGTERM to
no process of its group left running, and the CPU all its processes used.

    .venv/bin/python benchmarks/server_startup.py            # ~30 s
Writes benchmarks/results/server_startup.json.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
from results_file import write_result  # noqa: E402
from tests.server_harness import ServerProcess, group_alive  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="Model dir (default: the tiny qwen3 model, built if missing).")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "server_startup.json"))
    args = ap.parse_args()
    if args.model is None:
        from pdserve.model.make_model import ensure_model
        args.model = str(ensure_model("qwen3", "tiny", 0))
    ready, gone, cpu = [], [], []
    for _ in range(args.runs):
        c0, t0 = os.times(), time.monotonic()
        srv = ServerProcess(args.model)
        srv.wait_healthy()
        t1 = time.monotonic()
        srv.stop()
        while group_alive(srv.pgid):
            time.sleep(0.01)
        t2, c1 = time.monotonic(), os.times()
        srv.cleanup()
        ready.append(t1 - t0)
        gone.append(t2 - t1)
        cpu.append(c1.children_user + c1.children_system - c0.children_user - c0.children_system)
        print(f"healthy {ready[-1]:.2f} s, gone {gone[-1]:.2f} s after SIGTERM, {cpu[-1]:.2f} s of CPU", flush=True)
    summary = {k: statistics.median(v) for k, v in (("healthy_s", ready), ("gone_s", gone), ("cpu_s", cpu))}
    print("median:", {k: round(v, 2) for k, v in summary.items()})
    write_result(args.out, args, summary=summary, healthy_s=ready, gone_s=gone, cpu_s=cpu)
    return 0


if __name__ == "__main__":
    sys.exit(main())
