"""The Triton decode kernels compiled for sm_90 (the H200 the device scripts target) with Triton's bundled ptxas,
on the CPU, through the launches `paged_decode` makes (`attention/triton_aot.py`). The interpreter runs Python that
a GPU compile rejects (a `break`, a dot whose K is under 16: both ran under TRITON_INTERPRET=1 and failed here);
this compiles what a GPU would, and checks each kernel fits an SM: no spills, shared memory within the limit."""
from __future__ import annotations

import os

import pytest
import torch

# as tests/test_triton_attention.py, whichever imports triton first: the kernels' module then holds interpreted
# functions for that file's CPU runs, and triton_aot rebuilds the JIT ones from them
os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")
aot = pytest.importorskip("pdserve.attention.triton_aot")

if not os.path.exists(triton.knobs.nvidia.ptxas.path or ""):
    pytest.skip("this triton wheel bundles no ptxas", allow_module_level=True)

CASES = [  # dtype, q (1 + K), GQA group, head_dim, block size, KV heads
    (torch.bfloat16, 1, 2, 128, 16, 8),  # Qwen3-0.6B, the device scripts' shape
    (torch.bfloat16, 4, 2, 128, 16, 8),  # the same with K = 3
    (torch.float32, 1, 2, 64, 16, 2),  # the tiny model
    (torch.float32, 2, 3, 64, 32, 4),  # the small model (group 3: rows padded to 16), K = 1
    (torch.float16, 3, 4, 128, 4, 2),  # blocks under a tile
    (torch.float32, 1, 4, 256, 128, 2),  # blocks over a tile: a whole block of fp32 K/V (287 KB) would not fit
    (torch.bfloat16, 16, 8, 128, 32, 1),  # the largest q the backend sends and the largest group
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(x).removeprefix("torch.") for x in c))
def test_decode_kernels_compile_for_sm90_and_fit(case):
    dtype, qlen, group, head_dim, block_size, kv_heads = case
    records = aot.compile_decode(dtype, qlen, group, head_dim, block_size, kv_heads)
    assert [r.kernel for r in records] == ["_decode_split", "_combine"]
    for r in records:
        assert r.local_bytes == 0, f"{r.kernel} spills to local memory: {r}"
        assert r.shared_bytes <= aot.SM90["shared_per_cta"], r
        assert r.ctas_per_sm() >= 1, r
    split = records[0]
    assert split.constexprs["IEEE"] == (dtype == torch.float32)
    assert split.constexprs["TILE"] == min(max(block_size, 16), 64)


def test_one_variant_per_shape_whatever_the_splits_widths_and_slices():
    """Eager and PIECEWISE steps call the kernel on width groups: split counts of 1, 3 or 16, odd table widths, and
    tables and positions sliced at odd rows (8-byte aligned). None of these may make a new variant, which Triton
    would compile in the middle of a served step."""
    from pdserve.attention.triton_decode import DecodeWorkspace, paged_decode
    keys = set()
    for splits, width, first_row in [(1, 6, 0), (3, 5, 1), (16, 32, 1), (2, 7, 3)]:
        rows = 4
        q = torch.zeros(rows, 16, 128, dtype=torch.bfloat16)
        cache = torch.zeros(2, 9, 16, 8, 128, dtype=torch.bfloat16)
        table = torch.zeros(first_row + rows, width, dtype=torch.long)[first_row:]
        positions = torch.zeros(first_row + rows, 1, dtype=torch.long)[first_row:]
        with aot.compile_launches() as records:
            paged_decode(q, cache, table, positions, 0.1, splits, DecodeWorkspace(torch.device("cpu")))
        keys |= {(r.kernel, r.key) for r in records}
    assert len(keys) == 2, keys
