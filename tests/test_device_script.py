"""The GPU device script (benchmarks/cuda_decode_bench.py) smoke-tested on the CPU with the torch backend and a tiny
shape, so the next session lent a GPU can run it as it is: strict leaves FULL on every replay step, decode-shaped
never does (K = 0 and 3), FULL and PIECEWISE tokens equal eager's, and no block outside the requests' ones is written."""
from __future__ import annotations

import json
import subprocess
import sys

from tests.server_harness import REPO


def test_device_script_smoke_on_cpu(tmp_path):
    out = tmp_path / "r.json"
    p = subprocess.run([sys.executable, "benchmarks/cuda_decode_bench.py", "--device", "cpu", "--shape", "tiny",
                        "--backends", "torch", "--batch", "3", "--context", "48", "--rates", "0.5", "--steps", "10",
                        "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    runs = json.loads(out.read_text())["runs"]
    assert len(runs) == 8 and not any("error" in r for r in runs), runs
    for r in runs:
        assert r["blocks_clean"]
        if r["mode"] != "NONE":
            assert r["tokens_equal_eager"] and r["max_logit_diff_vs_eager"] < 1e-4
        if r["mode"] == "FULL":
            assert (r["non_full_share"] > 0) == (r["rule"] == "strict"), r
        if r["mode"] == "PIECEWISE":
            assert r["non_full_share"] == 1.0, r
