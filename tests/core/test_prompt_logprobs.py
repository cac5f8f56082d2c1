"""Prompt logprobs (`SamplingParams.prompt_logprobs`) against transformers on the same weights, in float64: every
prompt token's logprob and rank given the ones before it, through chunked prefill (chunks ending mid-block and on a
block edge), with prefix caching on (such a request takes no hit), under preemption, with speculative decoding, and
with one-token and exactly-one-block prompts."""
from __future__ import annotations

import pytest
import torch

from pdserve import LLM, SamplingParams
from tests.oracle import _hf_model, make_prompts

LENGTHS = [1, 2, 16, 17, 33, 70]
TOP = 3


@pytest.fixture(scope="module")
def setup(qwen3_tiny):
    from transformers import AutoTokenizer
    prompts = make_prompts(AutoTokenizer.from_pretrained(qwen3_tiny), LENGTHS, seed=4)
    model = _hf_model(qwen3_tiny, torch.float64)
    ref = []
    with torch.no_grad():
        for p in prompts:
            ref.append(model(torch.tensor([p])).logits[0].double().log_softmax(-1))
    return qwen3_tiny, prompts, ref


def check(out, prompt, ref) -> None:
    plp = out.prompt_logprobs
    assert plp is not None and len(plp) == len(prompt) and plp[0] is None, (len(plp or ()), len(prompt))
    for k in range(1, len(prompt)):
        row, tok = ref[k - 1], prompt[k]
        entry = plp[k]
        assert abs(entry[tok].logprob - row[tok].item()) < 1e-5, (k, entry[tok], row[tok].item())
        assert entry[tok].rank == int((row > row[tok]).sum()) + 1, k  # float32 log_softmax: no tie here
        top = set(row.topk(TOP).indices.tolist())
        assert set(entry) == top | {tok}, k
        assert all(lp.decoded_token is not None for lp in entry.values())


@pytest.mark.parametrize("cfg", [
    # chunks on block edges (17 and 33 end one token past one); an odd max_model_len, 70 + 12 tokens fit in 83
    dict(max_num_batched_tokens=16, block_size=16, max_model_len=83),
    dict(max_num_batched_tokens=64, block_size=16, long_prefill_token_threshold=7),  # 7-token chunks, mid-block
    dict(max_num_batched_tokens=128, block_size=16, num_gpu_blocks_override=9, max_num_seqs=6, max_model_len=101),
    # one-token chunks past the first: mid-prompt rows that are decode-shaped ride FULL steps (q = 1)
    dict(max_num_batched_tokens=64, block_size=16, long_prefill_token_threshold=1),
    # 4-token chunks beside drafting rows: prompt rows on FULL steps at q = 1 + K
    dict(max_num_batched_tokens=64, block_size=16, long_prefill_token_threshold=4, speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}),
])
def test_prompt_logprobs_equal_transformers(setup, cfg):
    model_dir, prompts, ref = setup
    llm = LLM(model_dir, dtype="float64", enable_prefix_caching=True, **cfg)
    runner, on_full = llm.engine.runner, [0]
    choose = runner.choose_graph

    def counting(rows):  # steps whose prompt-logprob rows ride a FULL graph
        mode, *rest = choose(rows)
        on_full[0] += mode.name == "FULL" and any(runner.prompt_logprobs.todo(r.request) for r in rows)
        return (mode, *rest)
    runner.choose_graph = counting
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, prompt_logprobs=TOP)
    for round_ in range(2):  # the second round would hit the prefix cache if a prompt-logprobs request could
        outs = llm.generate(prompts, sp, use_tqdm=False)
        for out, p, r in zip(outs, prompts, ref):
            check(out, p, r)
            assert out.num_cached_tokens == 0
    if "num_gpu_blocks_override" in cfg:
        assert llm.engine.scheduler.num_preemptions > 0, "the preemption config did not preempt"
    if cfg.get("long_prefill_token_threshold") in (1, 4):  # the two FULL configs
        assert on_full[0] > 0, "no prompt-logprob row rode a FULL step"
    plain = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in plain] == [o.outputs[0].token_ids for o in outs]
    assert all(o.prompt_logprobs is None for o in plain)
    if "num_gpu_blocks_override" not in cfg:  # (9 blocks keep nothing cached for long)
        assert sum(o.num_cached_tokens for o in plain) > 0  # others hit the cache the prompt-logprob ones wrote
    llm.engine.check_invariants()
    assert llm.engine.kv.num_free_blocks() == llm.engine.num_blocks - 1, "blocks leaked"


def test_prompt_logprobs_are_refused_with_imported_kv(setup):
    """A request whose prompt KV is imported (P/D, the arrival driver) has no logits for its prompt: refused, never
    answered with a short list."""
    model_dir, prompts, _ = setup
    llm = LLM(model_dir, dtype="float64")
    sp = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=1)
    for add in (lambda: llm.engine.add_prefilled_request(prompts[4], sp),
                lambda: llm.engine.add_request(prompts[4], sp, kv_transfer_params={"do_remote_prefill": True})):
        with pytest.raises(ValueError, match="prompt_logprobs: not with imported KV"):
            add()
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.kv.num_free_blocks() == llm.engine.num_blocks - 1


def test_prompt_logprobs_with_spec_decode_and_delta_outputs(setup):
    """With n-gram drafts the prompt logprobs are the same; a DELTA request gets them once, in its first output
    with a token (vLLM's), a CUMULATIVE one in every output from then on."""
    from pdserve.sampling_params import RequestOutputKind
    model_dir, prompts, ref = setup
    llm = LLM(model_dir, dtype="float64", max_num_batched_tokens=32, speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3})
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True,
                                                prompt_logprobs=TOP), use_tqdm=False)
    for out, p, r in zip(outs, prompts, ref):
        check(out, p, r)
    e = llm.engine
    for kind in (RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE):
        e.add_request(prompts[4], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, prompt_logprobs=0,
                                                 output_kind=kind), request_id=f"k{int(kind)}")
        seen = []
        while e.has_unfinished_requests():
            seen += [o for o in e.step() if o.outputs[0].delta_token_ids]
        with_lps = [o.prompt_logprobs is not None for o in seen]
        assert with_lps == ([True] + [False] * (len(seen) - 1) if kind == RequestOutputKind.DELTA
                            else [True] * len(seen)), with_lps
        assert len(seen[0].prompt_logprobs) == len(prompts[4])
    e.check_invariants()
