"""What the newer benchmark scripts write: their figures with the commit they ran at, the machine's cores and their
arguments, as JSON (so a figure in the docs names the tree that made it)."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def write_result(out: str, args, **figures) -> None:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip()
    Path(out).write_text(json.dumps({"commit": commit, "cpus": os.cpu_count(), "args": vars(args), **figures},
                                    indent=1))
    print(f"wrote {out}")
