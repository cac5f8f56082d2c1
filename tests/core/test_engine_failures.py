"""The engine's own failure paths: a model step that raises fails the requests it ran (with the error as their
output) and the engine goes on serving; an import the pool cannot hold, or whose local prefill raises, is refused
with nothing left behind. Every case ends with the pool whole and no per-request state."""
from __future__ import annotations

import pytest

from pdserve import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def whole(e):
    e.check_invariants()
    assert e.kv.num_free_blocks() == e.num_blocks - 1, "blocks leaked"
    assert not e.scheduler.requests and not e.has_unfinished_requests()


def run(e):
    outs = {}
    while e.has_unfinished_requests():
        for o in e.step():
            outs[o.request_id] = o
    return outs


def test_a_failed_step_fails_its_requests_and_the_engine_goes_on(qwen3_tiny):
    llm = LLM(qwen3_tiny, block_size=4, max_model_len=53)
    e = llm.engine
    real = e.runner.run  # the model's half of a step: run by execute, or on the worker thread (async scheduling)
    calls = [0]

    def flaky(step):
        calls[0] += 1
        if calls[0] == 3:  # mid-decode, both requests running
            raise RuntimeError("device lost")
        return real(step)
    e.runner.run = flaky
    e.add_request([5, 6, 7, 8, 9], GREEDY, request_id="a")
    e.add_request(list(range(10, 23)), GREEDY, request_id="b")
    outs = run(e)
    for rid in ("a", "b"):
        o = outs[rid]
        assert o.finished and o.outputs[0].finish_reason == "error" and "device lost" in o.error
        assert 0 < len(o.outputs[0].token_ids) < GREEDY.max_tokens
    whole(e)
    e.runner.run = real  # the next request is served as if nothing happened
    ref = LLM(qwen3_tiny, block_size=4, max_model_len=53).generate([[5, 6, 7, 8, 9]], GREEDY, use_tqdm=False)
    e.add_request([5, 6, 7, 8, 9], GREEDY, request_id="c")
    assert run(e)["c"].outputs[0].token_ids == ref[0].outputs[0].token_ids
    whole(e)


@pytest.mark.parametrize("held", [1, 2])
def test_an_import_the_pool_cannot_hold_is_refused_whole(qwen3_tiny, held):
    """11 prompt tokens at block size 4 need 3 blocks (10 imported + the replay's slot). A pool of 4 usable blocks
    with `held` of them taken by a running request has just room for it (1) or one block too few (2)."""
    llm = LLM(qwen3_tiny, block_size=4, max_model_len=16, num_gpu_blocks_override=5)
    e = llm.engine
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    e.add_request(list(range(1, 4 * held)), sp, request_id="running")
    e.step()  # its prefill: `held` blocks
    assert e.kv.num_free_blocks() == 4 - held
    prompt = list(range(30, 41))
    if held == 1:
        e.add_prefilled_request(prompt, sp, request_id="imp")
        outs = run(e)
        assert len(outs["imp"].outputs[0].token_ids) == sp.max_tokens
    else:
        with pytest.raises(RuntimeError, match="no free KV blocks"):
            e.add_prefilled_request(prompt, sp, request_id="imp")
        assert "imp" not in e.scheduler.requests
        outs = run(e)
        assert "imp" not in outs
    assert len(outs["running"].outputs[0].token_ids) == sp.max_tokens
    whole(e)


def test_an_import_whose_prefill_raises_leaves_nothing(qwen3_tiny):
    llm = LLM(qwen3_tiny, block_size=4, max_model_len=40)
    e = llm.engine
    e.runner.prefill_kv = lambda *a: (_ for _ in ()).throw(RuntimeError("kernel fault"))
    with pytest.raises(RuntimeError, match="kernel fault"):
        e.add_prefilled_request(list(range(30, 47)), GREEDY, request_id="imp")
    assert "imp" not in e.scheduler.requests
    whole(e)


def test_stop_token_ids_outside_the_vocabulary_are_refused_before_any_step(qwen3_tiny):
    """With min_tokens the stop ids index the logits (the ban): out of range, that failed the whole step."""
    llm = LLM(qwen3_tiny, block_size=4, max_model_len=53)
    vocab = llm.engine.vocab_size
    with pytest.raises(ValueError, match=f"stop_token_ids: token id {vocab} is outside"):
        llm.generate(["hi"], SamplingParams(max_tokens=3, min_tokens=2, stop_token_ids=[1, vocab]), use_tqdm=False)
    out = llm.generate(["hi"], SamplingParams(max_tokens=3, min_tokens=2, stop_token_ids=[vocab - 1]), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    llm.engine.check_invariants()
