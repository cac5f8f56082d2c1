"""The Triton decode kernels compiled for sm_90 (the H200 the device scripts target) with Triton's bundled ptxas,
on the CPU, through the launches `paged_decode` makes (`attention/triton_aot.py`). The interpreter runs Python that
a GPU compile rejects (a `break`, a dot whose K is under 16: both ran under TRITON_INTERPRET=1 and failed here);
this compiles what a GPU would, and checks each kernel fits an SM: no spills, shared memory within the limit."""
from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")
aot = pytest.importorskip("pdserve.attention.triton_aot")

if not __import__("os").path.exists(triton.knobs.nvidia.ptxas.path or ""):
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
