"""--gpu-memory-utilization: the KV cache gets the budget less what was measured; the errors name the flag. The
measuring itself needs CUDA (tests/worker/test_cuda_graphs.py); here the arithmetic and the CPU refusal."""
from __future__ import annotations

import pytest

from pdserve import LLM
from pdserve.worker.memory import MemoryProfile, kv_cache_bytes, num_blocks_for

GIB = 2 ** 30


def test_budget_less_every_measured_part():
    p = MemoryProfile(total=80 * GIB, held=4 * GIB, activations=2 * GIB, graphs=GIB // 2)
    assert kv_cache_bytes(p, 0.9) == int(0.9 * 80 * GIB) - 4 * GIB - 2 * GIB - GIB // 2
    per_block = 3 * 2 ** 20 + 1  # odd: the floor matters
    want = kv_cache_bytes(p, 0.9) // per_block
    assert num_blocks_for(p, 0.9, per_block, 10 ** 9, 257) == want + 1  # + the null block
    assert num_blocks_for(p, 0.9, per_block, 1000, 257) == 1001  # capped at max_num_seqs x max_model_len
    # the graphs' pool is what a cache sized without it would have taken
    assert num_blocks_for(p, 0.9, per_block, 10 ** 9, 257) < \
        num_blocks_for(MemoryProfile(**{**p.__dict__, "graphs": 0}), 0.9, per_block, 10 ** 9, 257)


@pytest.mark.parametrize("utilization", [0.05, 0.06])
def test_too_little_names_the_flag_and_the_parts(utilization):
    p = MemoryProfile(total=80 * GIB, held=4 * GIB, activations=GIB, graphs=GIB // 4)
    with pytest.raises(ValueError, match=r"--gpu-memory-utilization .* CUDA graphs"):
        num_blocks_for(p, utilization, 2 ** 20, 10 ** 9, 4)


def test_exactly_one_sequence_fits():
    p = MemoryProfile(total=100 * GIB, held=0, activations=0, graphs=0)
    per_block = int(0.5 * 100 * GIB) // 7
    assert num_blocks_for(p, 0.5, per_block, 10 ** 6, 7) == 8
    with pytest.raises(ValueError):
        num_blocks_for(p, 0.5, per_block, 10 ** 6, 8)


def test_cpu_refuses_the_flag(qwen3_tiny):
    with pytest.raises(ValueError, match="--gpu-memory-utilization.*CUDA.*--kv-cache-memory-gb"):
        LLM(qwen3_tiny, device="cpu", gpu_memory_utilization=0.5)
    with pytest.raises(ValueError, match=r"gpu_memory_utilization must be in \(0, 1\]"):
        LLM(qwen3_tiny, device="cpu", gpu_memory_utilization=1.5)


@pytest.mark.parametrize("max_model_len,budget", [(97, 300), (211, 211), (50, 33)])
def test_profile_run_and_resize_on_cpu(qwen3_tiny, max_model_len, budget):
    """The device-neutral steps of the CUDA sizing: the profile steps touch only the null block, at odd lengths
    and budgets; a resized cache serves requests."""
    import torch
    from pdserve import SamplingParams
    llm = LLM(qwen3_tiny, device="cpu", dtype="float32", max_model_len=max_model_len, max_num_seqs=5,
              max_num_batched_tokens=budget, num_gpu_blocks_override=40)
    e = llm.engine
    for c in e.runner.kv_caches:
        c.normal_()
    before = [c.clone() for c in e.runner.kv_caches]
    e.runner.profile_run()
    for b, a in zip(before, e.runner.kv_caches):
        assert torch.equal(b[:, 1:], a[:, 1:]) and not torch.equal(b[:, 0], a[:, 0])
    e.runner.resize_kv(40)
    assert [c.shape[1] for c in e.runner.kv_caches] == [40] * len(before)
    assert e.runner.model.kv_caches is e.runner.kv_caches
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    fresh = LLM(qwen3_tiny, device="cpu", dtype="float32", max_model_len=max_model_len, max_num_seqs=5,
                max_num_batched_tokens=budget, num_gpu_blocks_override=40)
    prompts = [[3 + i for i in range(n)] for n in (1, 16, 17)]
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)] == \
        [o.outputs[0].token_ids for o in fresh.generate(prompts, sp, use_tqdm=False)]
