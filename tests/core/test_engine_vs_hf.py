"""Greedy output equals transformers on the same weights: chunked prefill, prefix-cache hits, preemption."""
from __future__ import annotations

import pytest
import torch

from pdserve import LLM, SamplingParams
from tests.oracle import BF16_LOGIT_RTOL, BF16_NEAR_TIE, compare, hf_greedy, make_prompts

LENGTHS = [5, 17, 33, 64, 100, 150, 211, 300]
NEW_TOKENS = 24


def run_engine(model_dir, dtype, prompts, **engine_args):
    llm = LLM(model_dir, dtype=dtype, **engine_args)
    logits: dict[str, list[torch.Tensor]] = {}

    def hook(reqs, lg):
        for r, row in zip(reqs, lg):
            logits.setdefault(r.request_id, []).append(row.double().clone())

    llm.engine.runner.logits_hook = hook
    sp = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    rounds = [llm.generate(prompts, sp, use_tqdm=False)]
    # Second round: every prompt again, now with prefix-cache hits (and shared prefixes inside the round).
    rounds.append(llm.generate(prompts, sp, use_tqdm=False))
    llm.engine.check_invariants()
    assert llm.engine.kv.num_free_blocks() == llm.engine.num_blocks - 1, "blocks leaked"
    return llm, rounds, logits


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_greedy_matches_transformers(tiny_models, arch, dtype):
    model_dir = tiny_models[arch]
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = make_prompts(tok, LENGTHS, seed=1)
    prompts.append(prompts[6][:120] + prompts[2][:40])  # shares a 120-token prefix with prompt 6
    prompts.append(list(prompts[7]))  # an identical prompt in the same batch
    ref = [hf_greedy(model_dir, getattr(torch, dtype), p, NEW_TOKENS) for p in prompts]
    configs = [
        dict(max_num_batched_tokens=64, block_size=16),  # chunked prefill splits every long prompt
        dict(max_num_batched_tokens=512, block_size=16, num_gpu_blocks_override=40, max_num_seqs=8,
             max_model_len=512),  # preemption
        dict(max_num_batched_tokens=512, block_size=16, long_prefill_token_threshold=7),  # 7-token chunks, mid-block
    ]
    divergences = 0
    for cfg in configs:
        llm, rounds, logits = run_engine(model_dir, dtype, prompts, **cfg)
        if "num_gpu_blocks_override" in cfg:
            assert llm.engine.scheduler.num_preemptions > 0, "the preemption config did not preempt"
        assert sum(o.num_cached_tokens for o in rounds[1]) > 0, "second round had no prefix-cache hits"
        for outs in rounds:
            for out, (ref_tokens, ref_logits) in zip(outs, ref):
                ours = out.outputs[0].token_ids
                verdict = compare(ours, torch.stack(logits[out.request_id]), ref_tokens, ref_logits,
                                  exact=dtype == "float64")
                divergences += verdict != "same"
    # float32: at most 1 sequence in 8 may diverge, and only at a near-tie.
    assert divergences <= max(1, len(prompts) * len(configs) * 2 // 8)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_bfloat16_greedy_matches_transformers(tiny_models, arch):
    """bfloat16 on CPU runs the oneDNN-packed GEMMs (model/layers.py); its tokens follow transformers' in bf16 up to a
    bf16 near-tie, logits within bf16's resolution."""
    model_dir = tiny_models[arch]
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = make_prompts(tok, LENGTHS[:6], seed=1)
    ref = [hf_greedy(model_dir, torch.bfloat16, p, NEW_TOKENS) for p in prompts]
    llm, rounds, logits = run_engine(model_dir, "bfloat16", prompts, max_num_batched_tokens=64, block_size=16)
    assert any(m.packed is not None for m in llm.engine.runner.model.modules() if hasattr(m, "packed")) == bool(
        torch.ops.mkldnn._is_mkldnn_bf16_supported())
    verdicts = [compare(out.outputs[0].token_ids, torch.stack(logits[out.request_id]), ref_tokens, ref_logits,
                        exact=False, near_tie=BF16_NEAR_TIE, logit_rtol=BF16_LOGIT_RTOL)
                for outs in rounds for out, (ref_tokens, ref_logits) in zip(outs, ref)]
    assert verdicts.count("same") >= len(verdicts) // 2
