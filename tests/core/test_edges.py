"""Edges that round numbers miss: context lengths whose block count is no multiple of the FULL layout's rounding,
rows that reach the very end of their context."""
from __future__ import annotations

import pytest

from pdserve import LLM, SamplingParams


@pytest.mark.parametrize("max_model_len,block_size", [(100, 16), (1000, 16), (45, 2), (51, 1)])
def test_rows_reaching_max_model_len_ride_full(qwen3_tiny, max_model_len, block_size):
    """A row nearing the end of its context next to a short one: the CPU FULL layout rounds group widths up to 4
    blocks, which must stop at the table's width (it used to raise IndexError and fail every request of the step).
    Outputs equal eager ones and run to max_model_len."""
    prompts = [[5 + i % 50 for i in range(max_model_len - min(30, max_model_len // 3))], [9, 8, 7, 6]]
    sp = [SamplingParams(temperature=0, ignore_eos=True, max_tokens=n) for n in (max_model_len - len(prompts[0]), 8)]
    outs = {}
    for eager in (False, True):
        llm = LLM(qwen3_tiny, max_model_len=max_model_len, block_size=block_size, enforce_eager=eager,
                  max_num_batched_tokens=max(max_model_len, 64))
        outs[eager] = llm.generate(prompts, sp, use_tqdm=False)
        if not eager:
            stats = llm.engine.graph_stats()
            assert stats["full_steps"] > 0, stats
    for o, e in zip(outs[False], outs[True]):
        assert o.outputs[0].finish_reason == "length", o.error
        assert o.outputs[0].token_ids == e.outputs[0].token_ids
    assert len(prompts[0]) + len(outs[False][0].outputs[0].token_ids) == max_model_len


def test_block_table_arrays_follow_the_block_lists():
    """The per-request int64 block arrays the model runner copies from grow with the block lists (past their first
    capacity too) and go with them."""
    import numpy as np

    from pdserve.core.kv_cache_manager import KVCacheManager
    from pdserve.request import Request
    kv = KVCacheManager(200, 2)
    reqs = [Request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=5)) for i in range(3)]
    for step in range(60):
        for i, r in enumerate(reqs):
            if step % (i + 1) == 0:
                assert kv.allocate_slots(r, 1 + i)
                r.num_computed_tokens += 1 + i
            assert np.array_equal(kv.block_table(r.request_id), kv.blocks_of(r.request_id))
    kv.free(reqs[0])
    assert kv.block_table("r0").size == 0
    assert kv.allocate_slots(reqs[0], 3) and kv.block_table("r0").tolist() == kv.blocks_of("r0")
