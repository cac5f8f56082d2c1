"""What an interrupt inside `import torch` leaves behind (the bench pd interrupt flake, session 27; a probe, not a
benchmark): each trial is a fresh interpreter that raises KeyboardInterrupt at the K-th Python call of the import (a
profile hook), K drawn at random, and reports how it ended: 130 (the interrupt reached the caller), 0 (swallowed:
the import finished), anything else (a half-initialized module failed later, or the process aborted).

    .venv/bin/python benchmarks/import_interrupt_probe.py --trials 100      # ~5 min on 2 cores
"""
from __future__ import annotations

import argparse
import collections
import random
import subprocess
import sys

CHILD = r'''
import os, sys
K, n = int(sys.argv[1]), [0]
def prof(frame, event, arg):
    if event == "call":
        n[0] += 1
        if n[0] == K:
            sys.setprofile(None)
            raise KeyboardInterrupt
sys.setprofile(prof)
try:
    import torch  # noqa: F401
    sys.setprofile(None)
except KeyboardInterrupt:
    sys.stdout.flush()
    os._exit(130)
'''


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=100, help="Interpreters to start (default: 100).")
    ap.add_argument("--max-call", type=int, default=511_000,
                    help="K is drawn in [1000, this]: `import torch` made ~511k Python calls here (default: 511000).")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng, ends = random.Random(args.seed), collections.Counter()
    for _ in range(args.trials):
        k = rng.randint(1000, args.max_call)
        r = subprocess.run([sys.executable, "-c", CHILD, str(k)], capture_output=True, text=True, timeout=120)
        ends[r.returncode] += 1
        if r.returncode != 130:
            print(f"K={k}: exit {r.returncode}: {(r.stderr.strip().splitlines() or [''])[-1][:160]}", flush=True)
    print(", ".join(f"exit {rc}: {n}" for rc, n in sorted(ends.items())), f"of {args.trials} trials")
    return 0


if __name__ == "__main__":
    sys.exit(main())
