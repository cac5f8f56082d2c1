"""A server's start and exit, as a test or a restart feels them: `pdserve serve` on the tiny model (engine in its own
process, one torch thread) started --runs times; each time the seconds to /health 200, the seconds from SIGTERM to
no process of its group left running, and the CPU all its processes used.

Each run is made twice, alternating: "warm", in a $PDSERVE_HOME where the tokenizer's class is remembered
(core/tokenizer.load_hf_tokenizer; a first start, not kept, writes it), and "cold", in a fresh $PDSERVE_HOME, as a
model's first start anywhere (transformers' AutoTokenizer, which imports torch, and the class written down).

    .venv/bin/python benchmarks/server_startup.py            # ~1 min
Writes benchmarks/results/server_startup.json.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
from results_file import write_result  # noqa: E402
from tests.server_harness import ServerProcess, group_alive  # noqa: E402


def once(model: str, home: str) -> dict:
    """One start to healthy and exit with $PDSERVE_HOME at `home`: seconds to healthy, seconds from SIGTERM to no
    process of its group left, CPU seconds of all its processes."""
    old = os.environ.get("PDSERVE_HOME")
    os.environ["PDSERVE_HOME"] = home  # the server inherits it
    try:
        c0, t0 = os.times(), time.monotonic()
        srv = ServerProcess(model)
        srv.wait_healthy()
        t1 = time.monotonic()
        srv.stop()
        while group_alive(srv.pgid):
            time.sleep(0.01)
        t2, c1 = time.monotonic(), os.times()
        srv.cleanup()
    finally:
        if old is None:
            os.environ.pop("PDSERVE_HOME", None)
        else:
            os.environ["PDSERVE_HOME"] = old
    return {"healthy_s": t1 - t0, "gone_s": t2 - t1,
            "cpu_s": c1.children_user + c1.children_system - c0.children_user - c0.children_system}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="Model dir (default: the tiny qwen3 model, built if missing).")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "server_startup.json"))
    args = ap.parse_args()
    if args.model is None:
        from pdserve.model.make_model import ensure_model
        args.model = str(ensure_model("qwen3", "tiny", 0))
    with tempfile.TemporaryDirectory(prefix="server-startup-warm-") as warm_home:
        got = {kind: {"healthy_s": [], "gone_s": [], "cpu_s": []} for kind in ("warm", "cold")}
        once(args.model, warm_home)  # remembers the tokenizer's class there
        for r in range(args.runs):
            for kind in (("warm", "cold") if r % 2 == 0 else ("cold", "warm")):
                with tempfile.TemporaryDirectory(prefix="server-startup-cold-") as cold_home:
                    for k, v in once(args.model, warm_home if kind == "warm" else cold_home).items():
                        got[kind][k].append(v)
                print(f"{kind}: healthy {got[kind]['healthy_s'][-1]:.2f} s, gone {got[kind]['gone_s'][-1]:.2f} s after "
                      f"SIGTERM, {got[kind]['cpu_s'][-1]:.2f} s of CPU", flush=True)
    summary = {kind: {k: statistics.median(v) for k, v in runs.items()} for kind, runs in got.items()}
    for kind, s in summary.items():
        print(f"median, {kind}:", {k: round(v, 2) for k, v in s.items()})
    write_result(args.out, args, summary=summary, runs=got)
    return 0


if __name__ == "__main__":
    sys.exit(main())
