"""A request resumed from the tokens its client already has (`kv_transfer_params.resume_token_ids`, what the router
sends another node when a stream's node fails: router/migration.py), at the engine level.

Oracle: the same request run whole on another engine (float64: greedy and seeded tokens identical). The resumed
request's first output is the text the whole run's stream had after those tokens, and the rest of its tokens and
text equal the whole run's; the pool is whole after every case."""
from __future__ import annotations

import pytest

from pdserve import LLM, SamplingParams
from pdserve.sampling_params import RequestOutputKind
from tests.transfer.test_pd_engine import assert_whole, drain

ENGINE = dict(max_model_len=509, kv_cache_memory_gb=0.05, dtype="float64")  # odd max_model_len on purpose
B = 16  # block_size


@pytest.fixture(scope="module")
def whole(qwen3_tiny):
    return LLM(qwen3_tiny, **ENGINE)


@pytest.fixture(scope="module")
def other(qwen3_tiny):
    """The node the request resumes on (its own prefix cache: nothing of the first run is cached there)."""
    return LLM(qwen3_tiny, **ENGINE)


@pytest.fixture(scope="module")
def other_spec(qwen3_tiny):
    return LLM(qwen3_tiny, speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                               "prompt_lookup_max": 3}, **ENGINE)


def prompt_of(llm, n: int) -> list[int]:
    ids = llm.get_tokenizer()("def fibonacci(n):\n    return n if n < 2 else fib(n - 1)\n" * 20).input_ids
    return ids[:n]


def run(llm, prompt, sp, rid, kv=None) -> list:
    """Every output of one request, cumulative, in order."""
    sp = sp.clone()
    sp.output_kind = RequestOutputKind.CUMULATIVE
    llm.engine.add_request(prompt, sp, request_id=rid, kv_transfer_params=kv)
    outs = []
    while llm.engine.has_unfinished_requests():
        outs += [o for o in llm.engine.step() if o.request_id == rid]
    assert outs and outs[-1].finished
    assert_whole(llm)
    return outs


SAMPLING = {
    "greedy": dict(temperature=0),
    "seeded": dict(temperature=0.9, top_p=0.95, seed=1234),
    "penalties": dict(temperature=0.8, seed=3, presence_penalty=0.5, frequency_penalty=0.4, repetition_penalty=1.3),
    "min-tokens": dict(temperature=0, min_tokens=9, stop_token_ids=[198]),
    "bad-words-bias": dict(temperature=0.7, seed=21, bad_words=["fib", " n"], logit_bias={10: 2.0, 11: -3.0}),
    "seeded-logprobs": dict(temperature=1.1, top_k=20, seed=7, logprobs=2),
}


@pytest.mark.parametrize("n,k", [(1, 1), (2, 5), (B, B), (B + 1, B - 1), (3 * B + 1, 2)])
@pytest.mark.parametrize("kind", list(SAMPLING))
def test_resumed_request_goes_on_as_the_whole_run(whole, other, n, k, kind):
    prompt = prompt_of(whole, n)
    sp = SamplingParams(max_tokens=k + 10, ignore_eos=True, **SAMPLING[kind])
    full = run(whole, prompt, sp, f"w-{kind}-{n}-{k}")
    ids = full[-1].outputs[0].token_ids
    at_k = next(o for o in full if len(o.outputs[0].token_ids) >= k)
    assert len(at_k.outputs[0].token_ids) == k  # one token per step: the stream stood at k tokens once
    got = run(other, prompt, sp, f"r-{kind}-{n}-{k}", {"resume_token_ids": ids[:k]})
    assert got[0].outputs[0].token_ids == ids[:k]  # out at admission, before any step
    assert got[0].outputs[0].text == at_k.outputs[0].text  # the text the client has: nothing held back differs
    assert got[-1].outputs[0].token_ids == ids and got[-1].outputs[0].text == full[-1].outputs[0].text
    assert got[-1].outputs[0].finish_reason == full[-1].outputs[0].finish_reason
    if sp.logprobs is not None:  # the resumed tokens' logprobs are the client's already: only the new ones here
        want = [{t: round(v.logprob, 9) for t, v in e.items()} for e in full[-1].outputs[0].logprobs[k:]]
        assert [{t: round(v.logprob, 9) for t, v in e.items()} for e in got[-1].outputs[0].logprobs] == want


def test_a_stop_string_across_the_resumed_tokens(whole, other):
    """The stop string starts in the resumed tokens' text and ends in the next token's: cut as the whole run cut
    it, and the text the resumed request put out at admission held back the string's start as the whole run's
    stream did."""
    prompt = prompt_of(whole, 20)
    free = run(whole, prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), "probe")[-1].outputs[0]
    text = free.text
    stop = text[len(text) // 2 - 1: len(text) // 2 + 2]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop])
    full = run(whole, prompt, sp, "w-stop")
    ids = full[-1].outputs[0].token_ids
    assert full[-1].outputs[0].finish_reason == "stop"
    k = len(ids) - 1  # resumed up to the token before the one that completes the string
    at_k = next(o for o in full if len(o.outputs[0].token_ids) >= k)
    got = run(other, prompt, sp, "r-stop", {"resume_token_ids": ids[:k]})
    assert got[0].outputs[0].text == at_k.outputs[0].text
    assert got[-1].outputs[0].text == full[-1].outputs[0].text and got[-1].outputs[0].finish_reason == "stop"


def test_resumed_on_speculative_decoding(whole, other_spec):
    prompt = prompt_of(whole, B + 1)
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ids = run(whole, prompt, sp, "w-spec")[-1].outputs[0].token_ids
    got = run(other_spec, prompt, sp, "r-spec", {"resume_token_ids": ids[:7]})
    assert got[-1].outputs[0].token_ids == ids


def test_resumed_tokens_that_end_the_request_end_it_at_admission(other):
    """The last resumed token is the cap (max_tokens reached is refused; a stop id is not): finished with no step."""
    prompt = prompt_of(other, 9)
    sp = SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[5])
    outs = run(other, prompt, sp, "r-ends", {"resume_token_ids": [7, 8, 5]})
    assert len(outs) == 1 and outs[0].outputs[0].finish_reason == "stop" and outs[0].outputs[0].token_ids == [7, 8, 5]


@pytest.mark.parametrize("bad,why", [
    ([1, -1], "token ids in"), ([1, 10 ** 9], "token ids in"), ("12", "token ids in"), ([True], "token ids in"),
    (list(range(10)), "no room"),  # max_tokens 10
])
def test_bad_resume_token_ids_are_refused_naming_the_field(other, bad, why):
    with pytest.raises(ValueError, match=f"resume_token_ids.*{why}"):
        other.engine.add_request(prompt_of(other, 5), SamplingParams(max_tokens=10),
                                 kv_transfer_params={"resume_token_ids": bad})
    assert_whole(other)


def test_resume_past_max_model_len_is_refused(other):
    prompt = prompt_of(other, 500)
    sp = SamplingParams(max_tokens=None)  # up to the end of the context: 9 tokens
    with pytest.raises(ValueError, match="resume_token_ids: 9 tokens.*max_model_len 509"):
        other.engine.add_request(prompt, sp, kv_transfer_params={"resume_token_ids": [1] * 9})
    other.engine.add_request(prompt, sp, request_id="r-8", kv_transfer_params={"resume_token_ids": [1] * 8})
    assert len(drain(other)["r-8"].outputs[0].token_ids) == 9  # one more: the context is full
    assert_whole(other)


def test_resume_is_not_served_p_d(other):
    with pytest.raises(ValueError, match="resume_token_ids.*not served P/D"):
        other.engine.add_request(prompt_of(other, 5), SamplingParams(max_tokens=10),
                                 kv_transfer_params={"resume_token_ids": [1], "do_remote_decode": True})
    assert_whole(other)
