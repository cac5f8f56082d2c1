"""The GPU device script (benchmarks/cuda_decode_bench.py) smoke-tested on the CPU with the torch backend and a tiny
shape, so the next session lent a GPU can run it as it is: strict leaves FULL on every replay step, decode-shaped
never does (K = 0 and 3), FULL and PIECEWISE tokens equal eager's, and no block outside the requests' ones is written.
Both this and the CUDA tests' engine flow run with the packages the GPU machine lacks made unimportable (its image
has torch, triton, transformers, tokenizers, safetensors, pytest, httpx; no server packages)."""
from __future__ import annotations

import json
import subprocess
import sys

from tests.server_harness import REPO

# a meta-path finder that refuses the server-only packages, then runs the rest of argv as a script or code
BLOCKED = ("cryptography", "fastapi", "uvicorn", "starlette", "pydantic", "nixl", "openai", "vllm_router")
_PRELUDE = f"""
import importlib.abc, runpy, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {BLOCKED!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (not on the GPU machine)")
sys.meta_path.insert(0, Block())
"""


def run_without_server_packages(code: str, timeout: float):
    return subprocess.run([sys.executable, "-c", _PRELUDE + code], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


def test_device_script_smoke_on_cpu(tmp_path):
    out = tmp_path / "r.json"
    argv = ["benchmarks/cuda_decode_bench.py", "--device", "cpu", "--shape", "tiny", "--backends", "torch",
            "--batch", "3", "--context", "48", "--rates", "0.5", "--steps", "10", "--out", str(out)]
    p = run_without_server_packages(f"sys.argv = {argv!r}\nrunpy.run_path(sys.argv[0], run_name='__main__')", 120)
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


def test_cuda_tests_engine_flow_needs_no_server_package(qwen3_tiny):
    """tests/worker/test_cuda_graphs.py's engine (the arrival driver's DecodeBenchConnector), on the CPU."""
    p = run_without_server_packages(f"""
from pdserve import LLM, SamplingParams
llm = LLM({qwen3_tiny!r}, max_model_len=96, max_num_seqs=4, kv_cache_memory_gb=0.05,
          kv_transfer_config={{"kv_connector": "DecodeBenchConnector", "kv_role": "kv_consumer"}})
e = llm.engine
e.add_prefilled_request([3 + j for j in range(21)], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
while e.has_unfinished_requests():
    e.step()
e.check_invariants()
assert "cryptography" not in sys.modules
print(e.graph_stats()["full_steps"])
""", 120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert int(p.stdout.split()[-1]) > 0


def test_gpu_session_runs_the_steps_it_is_given(tmp_path):
    """benchmarks/gpu_session.sh with a stand-in python that logs its argv: all three steps by default, only the
    named ones on a rerun (with their extra flags), and an unknown step refused before anything runs."""
    log = tmp_path / "argv.log"
    fake = tmp_path / "py"
    fake.write_text(f"#!/bin/bash\necho \"$*\" | tr '\\n' ' ' >> {log}; echo >> {log}\n")  # one line a call
    fake.chmod(0o755)
    script = str(REPO / "benchmarks" / "gpu_session.sh")

    def run(*args, **env):
        log.write_text("")
        p = subprocess.run(["bash", script, str(tmp_path / "out"), *args], capture_output=True, text=True,
                           timeout=30, env={"PATH": "/usr/bin:/bin", "PYTHON": str(fake), **env})
        return p, [line.split()[0] if line.split()[0] != "-m" else line.split()[1]
                   for line in log.read_text().splitlines()[1:]]  # the first call is env.txt's version line

    p, calls = run()
    assert p.returncode == 0 and calls == ["pytest", "benchmarks/cuda_graph_check.py",
                                           "benchmarks/cuda_decode_bench.py"], (p.stderr, calls)
    p, calls = run("cdb", CDB_ARGS="--backends triton --steps 20")
    assert p.returncode == 0 and calls == ["benchmarks/cuda_decode_bench.py"], (p.stderr, calls)
    assert log.read_text().splitlines()[-1].rstrip().endswith("--backends triton --steps 20")
    p, calls = run("cgc", "bogus")
    assert p.returncode == 2 and "unknown step 'bogus'" in p.stderr and not log.read_text()
