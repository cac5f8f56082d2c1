"""PIECEWISE steps on CPU: the segment callables, run eagerly with attention between them, give the unsegmented
forward's hidden states on the same padded buffers; the segments read and write only the runner's static buffers;
whole runs give eager's tokens."""
from __future__ import annotations

import pytest
import torch

from pdserve import LLM, SamplingParams

from tests.worker.test_graphs import finish_all, greedy, prompt

# synchronous steps: mixed_rows schedules a step by hand, which must see every token landed
SMALL = dict(max_model_len=211, kv_cache_memory_gb=0.05, max_num_seqs=24, async_scheduling=False)


def mixed_rows(e, decodes: int, prefill_len: int):
    """A step's rows with `decodes` decoding requests and one prompt of `prefill_len` tokens, scheduled."""
    for i in range(decodes):
        e.add_request(prompt(i, 17 + 3 * i), greedy(30), request_id=f"d{i}")
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in e.scheduler.running + list(e.scheduler.waiting)):
        e.step()
    e.add_request(prompt(50, prefill_len), greedy(4), request_id="p")
    return e.scheduler.schedule().rows


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("decodes,prefill_len", [(0, 1), (3, 16), (5, 33), (7, 37)])
def test_segments_equal_unsegmented_forward(qwen3_tiny, dtype, decodes, prefill_len):
    llm = LLM(qwen3_tiny, dtype=dtype, cudagraph_mode="PIECEWISE", **SMALL)
    e = llm.engine
    runner = e.runner
    rows = mixed_rows(e, decodes, prefill_len)
    mode, desc, reason, num_tokens = runner.choose_graph(rows)
    assert mode.value == "PIECEWISE" and desc.num_tokens >= num_tokens == decodes + prefill_len
    batch = runner.buffers.prepare(rows, e.kv.blocks_of, desc.num_tokens)
    with torch.inference_mode():
        whole = runner.model(runner.buffers.input_ids[:desc.num_tokens], runner.buffers.positions[:desc.num_tokens],
                             batch.meta).clone()
        kv_whole = [c.clone() for c in runner.kv_caches]
        pieces = runner.piecewise.run(desc.num_tokens, batch.meta).clone()
    # the same ops on the same inputs: bit-identical in both dtypes (copies into static buffers change no value)
    assert torch.equal(whole, pieces)
    assert all(torch.equal(a, b) for a, b in zip(kv_whole, runner.kv_caches))
    for rid in list(e.scheduler.requests):
        e.abort_request(rid)
    e.check_invariants()


def test_segments_touch_only_static_buffers(qwen3_tiny):
    """What capture needs, checked on CPU: one callable per (size, segment), L + 1 of them, each compiling without
    a graph break, reading the step's inputs and writing its outputs only through the runner's static buffers."""
    llm = LLM(qwen3_tiny, dtype="float64", cudagraph_mode="PIECEWISE", **SMALL)
    e = llm.engine
    pw = e.runner.piecewise
    rows = mixed_rows(e, 2, 9)
    mode, desc, _, _ = e.runner.choose_graph(rows)
    n = desc.num_tokens
    batch = e.runner.buffers.prepare(rows, e.kv.blocks_of, n)
    segs = pw.segments(n)
    assert len(segs) == len(e.runner.model.layers) + 1 and pw.segments(n) is segs
    ptrs = [t.data_ptr() for t in (pw.x, pw.q, pw.k, pw.v, pw.attn_out)]
    with torch.inference_mode():
        expected = pw.run(n, batch.meta).clone()
        torch._dynamo.reset()
        compiled = [torch.compile(s, backend="eager", fullgraph=True) for s in segs]
        for s in compiled:
            s()  # a graph break would raise under fullgraph=True
        # replay the captured-style path: compiled segments, eager attention between, same buffers
        pw.graphs[n] = [type("G", (), {"replay": staticmethod(s)})() for s in compiled]
        try:
            got = pw.run(n, batch.meta).clone()
        finally:
            del pw.graphs[n]
    assert torch.equal(got, expected)
    assert [t.data_ptr() for t in (pw.x, pw.q, pw.k, pw.v, pw.attn_out)] == ptrs
    for rid in list(e.scheduler.requests):
        e.abort_request(rid)
    e.check_invariants()


@pytest.mark.parametrize("mode", ["PIECEWISE", "FULL_AND_PIECEWISE"])
def test_piecewise_runs_give_eager_tokens(qwen3_tiny, mode):
    prompts = [prompt(i, n) for i, n in enumerate((1, 15, 16, 17, 33, 60))]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = {}
    for name, kw in (("graphs", dict(cudagraph_mode=mode)), ("eager", dict(enforce_eager=True))):
        llm = LLM(qwen3_tiny, dtype="float64", max_num_batched_tokens=40, **SMALL, **kw)
        outs[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
        stats = llm.engine.graph_stats()
        if name == "graphs":
            assert any(k.startswith("PIECEWISE/") for k in stats["steps"]), stats
            assert stats["padded_tokens"] > 0, stats
        finish_all(llm)
    assert outs["graphs"] == outs["eager"]
