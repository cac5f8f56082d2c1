"""The Triton decode kernels compiled for sm_90 (the H200 the device scripts target) with Triton's bundled ptxas,
on the CPU, through the launches `paged_decode` makes (`attention/triton_aot.py`). The interpreter runs Python that
a GPU compile rejects (a `break`, a dot whose K is under 16: both ran under TRITON_INTERPRET=1 and failed here);
this compiles what a GPU would, and checks each kernel fits an SM: no spills, shared memory within the limit."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.server_harness import REPO

# as tests/attention/test_triton_attention.py: whichever module imports triton first decides for the whole session,
# and the interpreter is what that file's CPU runs need (the compiles below run in a child without it)
os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")
pytest.importorskip("pdserve.attention.triton_aot")

if not os.path.exists(triton.knobs.nvidia.ptxas.path or ""):
    pytest.skip("this triton wheel bundles no ptxas", allow_module_level=True)

CASES = [  # dtype, q (1 + K), GQA group, head_dim, block size, KV heads
    ("bfloat16", 1, 2, 128, 16, 8),  # Qwen3-0.6B, the device scripts' shape
    ("bfloat16", 4, 2, 128, 16, 8),  # the same with K = 3
    ("float32", 1, 2, 64, 16, 2),  # the tiny model
    ("float32", 2, 3, 64, 32, 4),  # the small model (group 3: rows padded to 16), K = 1
    ("float16", 3, 4, 128, 4, 2),  # blocks under a tile
    ("float32", 1, 4, 256, 128, 2),  # blocks over a tile: a whole block of fp32 K/V (287 KB) would not fit
    ("bfloat16", 16, 8, 128, 32, 1),  # the largest q the backend sends and the largest group
]
# Eager and PIECEWISE steps call the kernel on width groups: split counts of 1, 3 or 16, odd table widths, and
# tables and positions sliced at odd rows (8-byte aligned)
SLICES = [(1, 6, 0), (3, 5, 1), (16, 32, 1), (2, 7, 3)]  # splits, table width, first row

# The compiles run in a child without TRITON_INTERPRET: with it set when triton is imported, triton.language's own
# @jit helpers (tl.cdiv, tl.max) are interpreted functions a compile cannot call, and an interpreted kernel that
# called them leaves tl's builtins patched for the interpreter (triton 3.6) in this process.
_CHILD = """
import dataclasses, json, sys, torch
from pdserve.attention import triton_aot as aot
from pdserve.attention.triton_decode import DecodeWorkspace, paged_decode
cases, slices = json.loads(sys.argv[1])
sys.path.insert(0, "benchmarks")
from cuda_decode_bench import LAUNCHES
out = {"cases": [], "slice_keys": [], "launches": []}
def records(dtype, *shape, **launch):
    return [dict(dataclasses.asdict(r), ctas_per_sm=r.ctas_per_sm())
            for r in aot.compile_decode(getattr(torch, dtype), *shape, **launch)]
for dtype, *shape in cases:
    out["cases"].append(records(dtype, *shape))
for tile, warps, stages in LAUNCHES:  # what the device script times beside the default, on its shape
    out["launches"].append(records(*cases[0], tile=tile, num_warps=warps, num_stages=stages)[0])
for splits, width, first_row in slices:
    rows = 4
    q = torch.zeros(rows, 16, 128, dtype=torch.bfloat16)
    cache = torch.zeros(2, 9, 16, 8, 128, dtype=torch.bfloat16)
    table = torch.zeros(first_row + rows, width, dtype=torch.long)[first_row:]
    positions = torch.zeros(first_row + rows, 1, dtype=torch.long)[first_row:]
    with aot.compile_launches() as records:
        paged_decode(q, cache, table, positions, 0.1, splits, DecodeWorkspace(torch.device("cpu")))
    out["slice_keys"] += [[r.kernel, r.key] for r in records]
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def compiled():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run([sys.executable, "-c", _CHILD, json.dumps([CASES, SLICES])], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.splitlines()[-1])


@pytest.mark.parametrize("i", range(len(CASES)), ids=["-".join(map(str, c)) for c in CASES])
def test_decode_kernels_compile_for_sm90_and_fit(compiled, i):
    from pdserve.attention.triton_aot import SM90
    dtype, qlen, group, head_dim, block_size, kv_heads = CASES[i]
    records = compiled["cases"][i]
    assert [r["kernel"] for r in records] == ["_decode_split", "_combine"]
    for r in records:
        assert r["local_bytes"] == 0, f"{r['kernel']} spills to local memory: {r}"
        assert r["shared_bytes"] <= SM90["shared_per_cta"], r
        assert r["ctas_per_sm"] >= 1, r
    split = records[0]
    assert split["constexprs"]["IEEE"] == (dtype == "float32")
    assert split["constexprs"]["TILE"] == min(max(block_size, 16), 64)


def test_one_variant_per_shape_whatever_the_splits_widths_and_slices(compiled):
    """None of SLICES' launches may make a new variant, which Triton would compile in the middle of a served
    step."""
    keys = {tuple(k) for k in compiled["slice_keys"]}
    assert len(compiled["slice_keys"]) == 2 * len(SLICES) and len(keys) == 2, keys


def test_the_launches_the_device_script_times_compile_and_fit(compiled):
    """cuda_decode_bench.py times other tiles, warp counts and pipeline depths beside the default: each compiles
    for sm_90 without spills and within shared memory, so none wastes the GPU run on an error."""
    from pdserve.attention.triton_aot import SM90
    assert len(compiled["launches"]) >= 8
    for r in compiled["launches"]:
        assert r["local_bytes"] == 0 and r["shared_bytes"] <= SM90["shared_per_cta"], r
    assert len({r["key"] for r in compiled["launches"]}) == len(compiled["launches"])  # stages count too
    assert {r["num_warps"] for r in compiled["launches"]} == {4, 8}
    assert {r["constexprs"]["TILE"] for r in compiled["launches"]} == {16, 32, 64}
