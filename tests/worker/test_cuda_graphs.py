"""CUDA graph capture and replay (skipped without a GPU): FULL replays give the eager outputs."""
from __future__ import annotations

import pytest
import torch

from pdserve import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _run(model, **kw):
    llm = LLM(model, device="cuda", dtype="float32", max_model_len=256, max_num_seqs=16,
              kv_cache_memory_gb=0.2, kv_transfer_config={"kv_connector": "DecodeBenchConnector",
                                                          "kv_role": "kv_consumer"}, **kw)
    e = llm.engine
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    for i in range(12):
        e.add_prefilled_request([3 + (i * 31 + j * 7) % 8000 for j in range(20 + 5 * i)], sp, request_id=f"r{i}")
    out = {}
    while e.has_unfinished_requests():
        for o in e.step():
            if o.finished:
                out[o.request_id] = o.outputs[0].token_ids
    e.check_invariants()
    return e, out


def test_capture_and_replay_match_eager(qwen3_tiny):
    graphs, toks_graph = _run(qwen3_tiny)
    assert graphs.graph_stats()["captured"] and graphs.runner.full_graphs.graphs
    assert graphs.graph_stats()["full_steps"] > 0
    _, toks_eager = _run(qwen3_tiny, enforce_eager=True)
    assert toks_graph == toks_eager


def test_piecewise_capture_and_replay_match_eager(qwen3_tiny):
    graphs, toks_graph = _run(qwen3_tiny, cudagraph_mode="PIECEWISE")
    assert graphs.runner.piecewise.graphs and not graphs.runner.full_graphs.graphs
    assert graphs.graph_stats()["steps"].get("PIECEWISE/none", 0) > 0
    _, toks_eager = _run(qwen3_tiny, enforce_eager=True)
    assert toks_graph == toks_eager


def test_kv_cache_sized_after_graph_memory(qwen3_tiny):
    free, total = torch.cuda.mem_get_info()
    util = min(0.9, (total - free) / total + 0.01)  # 1% of the GPU above what is in use now
    seqs, max_len = 1024, 2048
    llm = LLM(qwen3_tiny, device="cuda", dtype="float32", max_model_len=max_len, max_num_seqs=seqs,
              max_num_batched_tokens=4096, gpu_memory_utilization=util)
    e = llm.engine
    assert e.runner.full_graphs.graphs and e.runner.piecewise.graphs
    assert e.num_blocks - 1 < seqs * max_len // 16, "the max_num_seqs cap bound: the budget was not tested"
    free_after, _ = torch.cuda.mem_get_info()
    over = total - free_after - util * total
    assert over <= 64 * 2 ** 20, f"{over / 2 ** 20:.0f} MiB over the budget (instantiated graphs, lazily loaded " \
        "kernels and pool fragmentation are outside the probe)"
    out = llm.generate([[3, 4, 5, 6]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
