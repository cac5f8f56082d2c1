"""The Triton paged decode kernel against the torch backend, on the CPU through Triton's interpreter
(TRITON_INTERPRET=1, set before triton is imported): random shapes, block sizes 4 to 128, contexts ending
mid-block, q = 1..5, GQA groups 1..8, padding rows on the null block, splits that get no blocks."""
from __future__ import annotations

import os
import random

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")
# the interpreter's numpy ops: 0-d conversions (numpy deprecation) and -inf - -inf in masked-off softmax lanes
pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              pytest.mark.filterwarnings("ignore::RuntimeWarning")]

from pdserve.attention.triton_decode import DecodeWorkspace, paged_decode  # noqa: E402
from pdserve.attention.metadata import AttentionMetadata, AttnGroup  # noqa: E402
from pdserve.attention.torch_backend import attention_masks, paged_attention  # noqa: E402


def reference(q, cache, table, positions, scale):
    rows, qlen = positions.shape
    bs, kvh = cache.shape[2], cache.shape[3]
    meta = AttentionMetadata(torch.zeros(0, dtype=torch.long), [AttnGroup(slice(0, rows * qlen), table, positions)])
    mask = attention_masks(meta, bs, q.shape[1] // kvh, q.dtype)[0]
    return paged_attention(q, cache, table, positions, mask, scale)


def case(rng: random.Random, bs: int, qlen: int, group: int, rows: int, pad_rows: int, width: int,
         dtype=torch.float32):
    kvh, dim = rng.choice([1, 2]), rng.choice([16, 32])
    num_blocks = rows * width + 2  # the null block, the rows' blocks, one more for poisoning
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    cache = torch.randn(2, num_blocks, bs, kvh, dim, generator=g, dtype=dtype)
    cache[:, 0] = 0  # the null block
    table = torch.zeros(rows + pad_rows, width, dtype=torch.long)
    positions = torch.zeros(rows + pad_rows, qlen, dtype=torch.long)
    free = list(range(1, num_blocks - 1))
    rng.shuffle(free)
    for r in range(rows):
        ctx = rng.randrange(qlen, width * bs + 1)  # often ends mid-block
        nb = -(-ctx // bs)
        table[r, :nb] = torch.tensor([free.pop() for _ in range(nb)])
        positions[r] = torch.arange(ctx - qlen, ctx)
    q = torch.randn((rows + pad_rows) * qlen, kvh * group, dim, generator=g, dtype=dtype)
    return q, cache, table, positions


def test_decode_kernel_half_precision_path():
    """The non-IEEE branch (bf16/fp16 on a GPU) in fp16, which the interpreter computes faithfully (its bf16 dot
    does not: a bf16 check needs a GPU, see benchmarks/cuda_decode_bench.py), against the torch backend in fp32."""
    rng = random.Random(7)
    ws = DecodeWorkspace(torch.device("cpu"))
    for qlen, group in [(1, 4), (4, 2)]:
        q, cache, table, positions = case(rng, 16, qlen, group, rows=3, pad_rows=1, width=3)
        scale = q.shape[-1] ** -0.5
        want = reference(q, cache, table, positions, scale)
        got = paged_decode(q.half(), cache.half(), table, positions, scale, 2, ws)
        torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("bs", [4, 16, 32, 128])
def test_decode_kernel_matches_torch_backend(bs):
    """Block sizes under the kernel's 16-key tile (a tile spans blocks), equal to it, and over its 64-key cap
    (a block spans tiles)."""
    rng = random.Random(bs)
    ws = DecodeWorkspace(torch.device("cpu"))
    for qlen, group in [(1, 1), (1, 8), (2, 4), (4, 2), (5, 1), (3, 3)]:
        q, cache, table, positions = case(rng, bs, qlen, group, rows=rng.randrange(1, 4), pad_rows=rng.randrange(0, 2),
                                          width=rng.randrange(1, 4 if bs >= 16 else 11))
        scale = q.shape[-1] ** -0.5
        want = reference(q, cache, table, positions, scale)
        # the table past each row's own blocks names a block of NaNs: a kernel that read past a row's length
        # (as the torch backend's whole-table gather does) would return NaN
        poisoned = table.clone()
        cache[:, -1] = float("nan")
        for r in range(table.shape[0]):
            nb = -(-(int(positions[r, -1]) + 1) // bs)
            poisoned[r, nb:] = cache.shape[1] - 1
        for splits in (1, 3):  # 3 splits over 1-3 blocks: some splits get none
            got = paged_decode(q, cache, poisoned, positions, scale, splits, ws)
            assert torch.isfinite(got).all()
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5), (qlen, group, splits)


def test_tiny_model_with_the_triton_backend_gives_the_torch_backends_tokens(qwen3_tiny):
    """Under the interpreter: prefill through SDPA, decode (FULL layout over the whole table) through the kernel;
    float32 tokens equal the torch backend's and the logits agree to 1e-4."""
    from pdserve import LLM, SamplingParams
    prompts = ["def fibonacci(n):", "import os\nimport sys\nimport re\n"]
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    runs = {}
    for backend in ("torch", "triton"):
        llm = LLM(qwen3_tiny, attention_backend=backend, max_model_len=96, max_num_seqs=2, block_size=16)
        logits = []
        llm.engine.runner.logits_hook = lambda reqs, lg: logits.append(lg.clone())
        runs[backend] = ([o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)], logits)
        assert llm.engine.graph_stats()["full_steps"] == 5
    assert runs["triton"][0] == runs["torch"][0]
    for a, b in zip(runs["triton"][1], runs["torch"][1]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_triton_backend_refuses_what_it_cannot_run(qwen3_tiny):
    from pdserve import LLM
    with pytest.raises(ValueError, match="float64"):
        LLM(qwen3_tiny, attention_backend="triton", max_model_len=64, dtype="float64")
