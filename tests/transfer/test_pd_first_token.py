"""P's first token (issue 35) at the engine level, over the tcp connector: P samples the first token with the
request's own params and hands it to D with all n prompt tokens' KV; D's first step is a plain decode of it.

Oracle: a collocated engine on the same weights (float64: greedy and seeded tokens identical), the same text and
logprobs; both block pools whole after every case."""
from __future__ import annotations

import contextlib
import itertools
import time

import pytest

from pdserve import LLM, SamplingParams
from pdserve.sampling_params import RequestOutputKind
from tests.server_harness import free_port
from tests.transfer.test_pd_engine import assert_whole, drain

ENGINE = dict(max_model_len=509, kv_cache_memory_gb=0.05, dtype="float64")  # odd max_model_len on purpose
B = 16  # block_size
_ids = itertools.count()  # request ids: a P's id stays in use while its lease lasts


def _kv(role, **kv):
    return {"kv_connector": "TcpConnector", "kv_role": role, "engine_id": "P0", "kv_auth_token": "secret", **kv}


@pytest.fixture(scope="module")
def col(qwen3_tiny):
    return LLM(qwen3_tiny, **ENGINE)


@contextlib.contextmanager
def p_and_d(model: str, async_scheduling: bool):
    """A P and a D over the tcp connector (loopback), float64, shut down on leaving."""
    p = LLM(model, kv_transfer_config=_kv("kv_producer", kv_port=free_port()), async_scheduling=async_scheduling,
            **ENGINE)
    d = LLM(model, kv_transfer_config=_kv("kv_consumer", kv_transfer_timeout=2.0), async_scheduling=async_scheduling,
            **ENGINE)
    try:
        yield p, d
    finally:
        p.engine.shutdown()
        d.engine.shutdown()


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def pd(qwen3_tiny, request):
    """P and D with async scheduling off (the CPU default) and on: P's one token is in flight when it hands off."""
    with p_and_d(qwen3_tiny, request.param) as pair:
        yield pair


@pytest.fixture(scope="module", params=[2, 4], ids=lambda k: f"K{k}")
def pd_spec(qwen3_tiny, request):
    spec = {"method": "ngram", "num_speculative_tokens": request.param, "prompt_lookup_max": 3}
    p = LLM(qwen3_tiny, kv_transfer_config=_kv("kv_producer", kv_port=free_port()), **ENGINE)
    d = LLM(qwen3_tiny, kv_transfer_config=_kv("kv_consumer", kv_transfer_timeout=2.0), speculative_config=spec,
            **ENGINE)
    c = LLM(qwen3_tiny, speculative_config=spec, **ENGINE)
    yield p, d, c
    p.engine.shutdown()
    d.engine.shutdown()


def prompt_of(llm, n: int) -> list[int]:
    """A prompt of exactly n token ids (repetitive, so n-gram drafts find matches)."""
    ids = llm.get_tokenizer()("def fibonacci(n):\n    return n if n < 2 else fib(n - 1)\n" * 20).input_ids
    return ids[:n]


def run_col(col, prompt, sp) -> tuple:
    """Collocated: (final output, the text the stream had after the first token)."""
    sp = sp.clone()
    sp.output_kind = RequestOutputKind.CUMULATIVE
    req = col.engine.add_request(prompt, sp, request_id="c")
    first_text, final = None, None
    while col.engine.has_unfinished_requests():
        for o in col.engine.step():
            if first_text is None and o.outputs[0].token_ids:
                first_text = o.outputs[0].text
            if o.finished:
                final = o
    assert req.is_finished
    assert_whole(col)
    return final, first_text


def prefill(p, prompt, sp, ask=True):
    params = {"do_remote_decode": True, **({"first_token": True} if ask else {})}
    p.engine.add_request(prompt, sp, request_id=f"p{next(_ids)}", kv_transfer_params=params)
    while p.engine.scheduler.has_unfinished():  # not drain: P's lease keeps the engine polling until D reads it
        for o in p.engine.step():
            if o.finished:
                return o
    raise AssertionError("P made no final output")


def decode(d, prompt, sp, params):
    d.engine.add_request(prompt, sp, request_id="d", kv_transfer_params=params)
    return drain(d)["d"]


def lp_view(out):
    lps = out.outputs[0].logprobs
    return None if lps is None else [{t: (round(v.logprob, 9), v.rank) for t, v in e.items()} for e in lps]


SAMPLING = {
    "greedy": dict(temperature=0),
    "seeded": dict(temperature=0.9, top_p=0.95, seed=1234),
    "seeded-topk-logprobs": dict(temperature=1.2, top_k=20, seed=7, logprobs=3),
    "penalties": dict(temperature=0.8, seed=3, presence_penalty=0.5, frequency_penalty=0.4, repetition_penalty=1.3),
    "min-tokens": dict(temperature=0, min_tokens=5),
    "bad-words-bias": dict(temperature=0.7, seed=21, bad_words=["fib", " n"], logit_bias={10: 2.0, 11: -3.0}),
}


@pytest.mark.parametrize("n", [1, 2, B, B + 1, 3 * B, 3 * B + 1])
@pytest.mark.parametrize("kind", list(SAMPLING))
def test_first_token_from_p_equals_collocated(pd, col, n, kind):
    p, d = pd
    prompt = prompt_of(col, n)
    sp = SamplingParams(max_tokens=12, **SAMPLING[kind])
    want, _ = run_col(col, prompt, sp)
    p_out = prefill(p, prompt, sp)
    params = p_out.kv_transfer_params
    assert params is not None and params["first_token"]["id"] == want.outputs[0].token_ids[0]
    assert len(params["remote_block_ids"]) == -(-n // B)  # all n prompt tokens' KV, not n - 1
    before = d.engine.graph_stats()
    got = decode(d, prompt, sp, params)
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert got.outputs[0].text == want.outputs[0].text
    assert lp_view(got) == lp_view(want)
    # imported (past D's own prefix-cache hit): nothing prefilled or replayed on D
    assert got.num_external_tokens + got.num_cached_tokens == n
    after = d.engine.graph_stats()
    assert after["non_full_by_reason"].get("prefill", 0) == before["non_full_by_reason"].get("prefill", 0), after
    drain(p)
    assert_whole(p, d)


def test_replayed_when_p_drew_with_other_params(pd, col):
    """vllm-router sends P other params (max_tokens 1, ignore_eos; here another seed): D replays, still exact."""
    p, d = pd
    prompt = prompt_of(col, 2 * B + 3)
    sp = SamplingParams(temperature=0.9, seed=11, max_tokens=8)
    want, _ = run_col(col, prompt, sp)
    p_out = prefill(p, prompt, SamplingParams(temperature=0.9, seed=12, max_tokens=8))
    assert "first_token" in p_out.kv_transfer_params
    got = decode(d, prompt, sp, p_out.kv_transfer_params)
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert got.num_external_tokens + got.num_cached_tokens == 2 * B + 2  # n - 1: the last prompt token replayed
    drain(p)
    assert_whole(p, d)


@pytest.mark.parametrize("how", ["max_tokens", "stop_token_id", "stop_string"])
def test_first_token_that_ends_the_request(pd, col, how):
    """P's token ends it: P answers the whole request, no params, its lease released at once; D is never asked."""
    p, d = pd
    prompt = prompt_of(col, B + 5)
    first, _ = run_col(col, prompt, SamplingParams(temperature=0, max_tokens=2))
    t1 = first.outputs[0].token_ids[0]
    text1 = col.get_tokenizer().decode([t1])
    extra = {"max_tokens": dict(max_tokens=1), "stop_token_id": dict(stop_token_ids=[t1]),
             "stop_string": dict(stop=[text1.strip() or text1])}[how]
    sp = SamplingParams(temperature=0, **{"max_tokens": 8, **extra})
    want, _ = run_col(col, prompt, sp)
    assert len(want.outputs[0].token_ids) == 1
    p_out = prefill(p, prompt, sp)
    assert p_out.kv_transfer_params is None
    assert (p_out.outputs[0].text, p_out.outputs[0].finish_reason) == (want.outputs[0].text,
                                                                      want.outputs[0].finish_reason)
    drain(p)
    assert_whole(p, d)


def test_stop_string_across_the_first_token(pd, col):
    """A stop string that starts in the first token's text is held back on P exactly as a collocated stream holds
    it, and D completes it: P's text is the stream's after one token, D's the final text, both collocated's."""
    p, d = pd
    prompt = prompt_of(col, 2 * B)
    plain, _ = run_col(col, prompt, SamplingParams(temperature=0, max_tokens=6))
    tok = col.get_tokenizer()
    t1, t2 = plain.outputs[0].token_ids[:2]
    a, b = tok.decode([t1]), tok.decode([t2])
    assert a and b, "the oracle needs two tokens with text"
    sp = SamplingParams(temperature=0, max_tokens=6, stop=[a[-1] + b[0]])
    want, first_text = run_col(col, prompt, sp)
    p_out = prefill(p, prompt, sp)
    assert p_out.outputs[0].text == first_text == a[:-1]  # the stop's first character held back, as collocated
    got = decode(d, prompt, sp, p_out.kv_transfer_params)
    assert got.outputs[0].text == want.outputs[0].text
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    drain(p)
    assert_whole(p, d)


def test_d_first_token_stops_at_admission_releases_p(pd, col):
    """D's own params stop the request at P's first token (D asked max_tokens 1 where P drew for 8: the key does not
    cover max_tokens): D answers it at admission, pulls nothing and releases P's lease. And a replay-mode node
    hands no token unless asked: its lease then covers n - 1 tokens (B here: one block, not two)."""
    p, d = pd
    prompt = prompt_of(col, B + 1)
    t1 = run_col(col, prompt, SamplingParams(temperature=0, max_tokens=1))[0].outputs[0].token_ids[0]
    vllm_style = prefill(p, prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), ask=False)
    assert "first_token" not in vllm_style.kv_transfer_params
    assert len(vllm_style.kv_transfer_params["remote_block_ids"]) == 1
    assert p.engine.gateway.release_lease(vllm_style.kv_transfer_params) == "released"
    p_out = prefill(p, prompt, SamplingParams(temperature=0, max_tokens=8))
    assert len(p_out.kv_transfer_params["remote_block_ids"]) == 2
    got = decode(d, prompt, SamplingParams(temperature=0, max_tokens=1), p_out.kv_transfer_params)
    assert got.outputs[0].token_ids == [t1] and got.outputs[0].finish_reason == "length"
    assert got.num_external_tokens == 0
    drain(p)  # P hears D's `done` and frees the lease
    assert_whole(p, d)


def test_failed_pull_recomputes_prompt_and_first_token(pd, col):
    """P's lease gone before D pulls: D prefills the prompt and P's first token itself and goes on, no token
    repeated or skipped."""
    p, d = pd
    prompt = prompt_of(col, 2 * B + 1)
    sp = SamplingParams(temperature=0.7, seed=5, max_tokens=10)
    want, _ = run_col(col, prompt, sp)
    params = prefill(p, prompt, sp).kv_transfer_params
    for lease in p.engine.connector.leases.values():
        lease.expiry = 0.0
    drain(p)  # expired: P frees the blocks
    got = decode(d, prompt, sp, params)
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert got.num_external_tokens == 0
    assert_whole(p, d)


@pytest.mark.parametrize("max_tokens", [2, 6])  # 2: D's first own step is also its last
@pytest.mark.parametrize("lease", ["held", "gone"])
def test_d_splits_its_own_first_step_not_ps_token(pd, col, lease, max_tokens):
    """D's records of a request that came with P's token, as the server reads them: the admission record (P's
    token, before any load) has no TTFT split and does not claim D took none of P's KV (not known yet: a streamed
    answer's X-PD-KV-Unused header goes with it); the record of D's first own step has the split, with the KV
    wait, and says whether the KV was imported (P's lease gone: prefilled here, so kv_unused)."""
    from pdserve.serve.engine_messages import record
    p, d = pd
    # 2B + 1 tokens, a prefix no other case left in D's cache
    prompt = [7 + max_tokens + 50 * (lease == "gone")] + prompt_of(col, 2 * B)
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, output_kind=RequestOutputKind.DELTA)
    want, _ = run_col(col, prompt, sp)
    params = prefill(p, prompt, sp).kv_transfer_params
    if lease == "gone":
        for held in p.engine.connector.leases.values():
            held.expiry = 0.0
        drain(p)
    d.engine.add_request(prompt, sp, request_id="d", kv_transfer_params=params)
    admission = d.engine._admitted[0]
    admitted = [record(o) for o in d.engine._admitted]  # read before any step: its load has not even started
    assert [r.new_token_ids for r in admitted] == [want.outputs[0].token_ids[:1]]
    assert admitted[0].timing is None and not admitted[0].kv_unused
    recs, t0 = [], time.monotonic()
    while d.engine.has_unfinished_requests():
        assert time.monotonic() - t0 < 20, "D did not finish"
        recs += [record(o) for o in d.engine.step() if o.request_id == "d"]
    assert [t for r in recs for t in r.new_token_ids] == want.outputs[0].token_ids
    timed = [r for r in recs if r.timing]
    assert len(timed) == 1 and timed[0] is not recs[0] and timed[0].new_token_ids  # D's first own step
    split = timed[0].timing
    assert split["queue"] >= 0 and split["prefill"] > 0 and split["ttft"] <= split["queue"] + split["kv_transfer"]
    assert split["kv_transfer"] > 0  # the pull, or P's answer that the lease is gone
    # held: no record says D took none of P's KV; gone: D's own step says it, and so may the admission record read
    # after that step's load wait (the load's end is final), never one read before the load was decided
    assert timed[0].kv_unused == (lease == "gone") and (lease == "gone" or not any(r.kv_unused for r in recs))
    assert record(admission).kv_unused == (lease == "gone")  # read once the load was decided (a server that lags)
    assert (timed[0].num_external_tokens == 2 * B + 1) == (lease == "held")
    drain(p)
    assert_whole(p, d)


@pytest.mark.parametrize("n", [B, B + 1, 3 * B + 1])
def test_first_token_with_spec_decode_on_d(pd_spec, n):
    p, d, c = pd_spec
    prompt = prompt_of(c, n)
    for sp in (SamplingParams(temperature=0, max_tokens=14), SamplingParams(temperature=0.8, seed=9, max_tokens=14)):
        want, _ = run_col(c, prompt, sp)
        got = decode(d, prompt, sp, prefill(p, prompt, sp).kv_transfer_params)
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        drain(p)
        assert_whole(p, d)


def test_abort_right_after_admission_makes_one_final_output(pd, col):
    """D aborted before the step that hands out P's token: the abort's output is the last, and P's lease ends."""
    p, d = pd
    prompt = prompt_of(col, B + 3)
    sp = SamplingParams(temperature=0, max_tokens=8)
    params = prefill(p, prompt, sp).kv_transfer_params
    d.engine.add_request(prompt, sp, request_id="d-abort", kv_transfer_params=params)
    final = d.engine.abort_request("d-abort")
    assert final.finished and final.outputs[0].finish_reason == "abort"
    assert all(o.request_id != "d-abort" for o in d.engine.step())
    drain(d)
    t0 = time.monotonic()
    while p.engine.scheduler.transfers.leased and time.monotonic() - t0 < 10:
        p.engine.step()  # D's bare `done` releases the lease
    assert_whole(p, d)


@pytest.mark.parametrize("n", [2 * B, 3 * B - 1])
def test_full_pool_on_d_waits_for_blocks(pd, col, qwen3_tiny, n):
    """D's pool (4 usable blocks, max_model_len 4B) holds one first-token request (n prompt tokens + the first
    token's slot = 3 blocks): the second waits for the first's blocks, not an error, and both equal collocated."""
    p, _ = pd
    d = LLM(qwen3_tiny, kv_transfer_config=_kv("kv_consumer", kv_transfer_timeout=2.0), num_gpu_blocks_override=5,
            **{**ENGINE, "max_model_len": 4 * B})
    try:
        prompts = [prompt_of(col, n), prompt_of(col, n)[1:] + [prompt_of(col, n)[0]]]
        sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
        wants = [run_col(col, pr, sp)[0].outputs[0].token_ids for pr in prompts]
        params = [prefill(p, pr, sp).kv_transfer_params for pr in prompts]
        for i, (pr, par) in enumerate(zip(prompts, params)):
            d.engine.add_request(pr, sp, request_id=f"full{i}", kv_transfer_params=par)
        d.engine.step()
        assert d.engine.kv.num_free_blocks() < 3  # the first holds three blocks: the second waits for them
        got = drain(d)
        assert [got[f"full{i}"].outputs[0].token_ids for i in range(2)] == wants
        assert all(got[f"full{i}"].num_external_tokens + got[f"full{i}"].num_cached_tokens == n for i in range(2))
        drain(p)
        assert_whole(p, d)
    finally:
        d.engine.shutdown()
