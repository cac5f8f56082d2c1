"""The direct hand-off (channel/handoffs.py) at the engine level, over the tcp connector: D takes the request before P
prefills it (`await_kv`: P's KV endpoint and the handoff key), its loader awaits P's post on P's KV server, and P's
params and KV come in one operation; D checks the params and runs the request from P's first token.

Oracle: a collocated engine on the same weights (float64); both block pools whole after every case, including the
ways it fails: P hands nothing over, the params do not check, the await runs out, P is not there, D's request ends
while it awaits."""
from __future__ import annotations

import time
import uuid

import pytest

from pdserve import LLM, SamplingParams
from pdserve.transfer.base import FinishedTransfers
from pdserve.transfer.channel import handoffs
from pdserve.transfer.tcp import consumer as tcp_consumer
from tests.server_harness import free_port
from tests.transfer.test_pd_engine import assert_whole, drain
from tests.transfer.test_pd_first_token import ENGINE, SAMPLING, B, _ids, _kv, lp_view, p_and_d, pd_spec, prompt_of, \
    run_col  # noqa: F401  (pd_spec: a fixture)

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


@pytest.fixture(scope="module")
def col(qwen3_tiny):
    return LLM(qwen3_tiny, **ENGINE)


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def pd(qwen3_tiny, request):
    with p_and_d(qwen3_tiny, request.param) as pair:
        yield pair


def await_params(p, key=None) -> dict:
    return {"await_kv": {"host": "127.0.0.1", "port": p.engine.connector.port, "key": key or uuid.uuid4().hex}}


def start_d(d, prompt, sp, params, rid="d", steps=3):
    """D takes the request and steps a while: it allocates the blocks and its await waits for P."""
    d.engine.add_request(prompt, sp, request_id=rid, kv_transfer_params=params)
    outs = [o for _ in range(steps) for o in d.engine.step()]
    assert not any(o.outputs[0].token_ids for o in outs if o.request_id == rid)  # nothing before P's post
    assert rid in d.engine.scheduler.transfers.loading  # blocks held while it awaits
    return outs


def run_p(p, prompt, sp, key, ask=True, abort=False):
    rid = f"p{next(_ids)}"
    params = {"do_remote_decode": True, "handoff_key": key, **({"first_token": True} if ask else {})}
    p.engine.add_request(prompt, sp, request_id=rid, kv_transfer_params=params)
    if abort:
        return p.engine.abort_request(rid)
    while p.engine.scheduler.has_unfinished():
        for o in p.engine.step():
            if o.finished:
                return o
    raise AssertionError("P made no final output")


def hand_off(p, d, prompt, sp, p_prompt=None, **p_kw):
    """D takes the request first, then P prefills it (`p_prompt`: another prompt under the same key; `ask`,
    `abort` as run_p): (P's final output, D's)."""
    params = await_params(p)
    start_d(d, prompt, sp, params)
    p_out = run_p(p, prompt if p_prompt is None else p_prompt, sp, params["await_kv"]["key"], **p_kw)
    return p_out, drain(d)["d"]


def finish_p(p, timeout=10.0):
    """P's lease ends once D's await read it (or the router's release): its blocks come back."""
    t0 = time.monotonic()
    while p.engine.scheduler.transfers.leased and time.monotonic() - t0 < timeout:
        p.engine.step()
        time.sleep(0.002)


@pytest.mark.parametrize("n", [1, 2, B, B + 1, 3 * B + 1])
@pytest.mark.parametrize("kind", ["greedy", "seeded-topk-logprobs", "penalties"])
def test_awaited_hand_off_equals_collocated(pd, col, n, kind):
    p, d = pd
    prompt, sp = prompt_of(col, n), SamplingParams(max_tokens=10, **SAMPLING[kind])
    want, _ = run_col(col, prompt, sp)
    before = d.engine.graph_stats()
    p_out, got = hand_off(p, d, prompt, sp)
    assert p_out.kv_transfer_params["first_token"]["id"] == want.outputs[0].token_ids[0]
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert got.outputs[0].text == want.outputs[0].text
    assert lp_view(got) == lp_view(want)
    assert got.num_external_tokens + got.num_cached_tokens == n  # all n imported: no prefill, no replay on D
    after = d.engine.graph_stats()
    assert after["non_full_by_reason"].get("prefill", 0) == before["non_full_by_reason"].get("prefill", 0), after
    finish_p(p)
    assert_whole(p, d)


def test_a_prompt_over_one_read_comes_in_several_frames(pd, col, monkeypatch):
    """More blocks than one read answer carries: the await's blocks follow in several frames."""
    p, d = pd
    monkeypatch.setattr(tcp_consumer, "BLOCKS_PER_READ", 2)
    monkeypatch.setattr("pdserve.transfer.tcp.producer.BLOCKS_PER_READ", 2)
    prompt, sp = prompt_of(col, 5 * B + 3), SamplingParams(temperature=0, max_tokens=4)
    want, _ = run_col(col, prompt, sp)
    _, got = hand_off(p, d, prompt, sp)
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert got.num_external_tokens + got.num_cached_tokens == 5 * B + 3
    finish_p(p)
    assert_whole(p, d)


@pytest.mark.parametrize("how", ["p-aborted", "first-token-ends-it"])
def test_nothing_handed_over_ends_ds_request(pd, col, how):
    """P's request ends without handing anything over (aborted; its first token ended it, which the router then
    answers from P): D's request ends too, with a 409 for its server, and no token; pools whole."""
    p, d = pd
    prompt = prompt_of(col, 2 * B + 1)
    sp = SamplingParams(temperature=0.9, seed=5, max_tokens=1 if how == "first-token-ends-it" else 6)
    _, got = hand_off(p, d, prompt, sp, abort=how == "p-aborted")
    assert got.outputs[0].finish_reason == "error" and got.error_status == 409, got
    assert got.outputs[0].token_ids == [] and "handed nothing over" in got.error
    assert ("first token ended" in got.error) == (how == "first-token-ends-it"), got.error
    finish_p(p)
    assert_whole(p, d)


@pytest.mark.parametrize("how", ["params-for-another-prompt", "no-first-token"])
def test_params_d_cannot_take_whole(pd, col, how):
    """P's params are for another prompt (a different tokenization): they do not check, the KV read is dropped
    unpublished and D prefills the prompt itself. P drew no first token (not asked): D replays the last prompt token
    on the KV it got. Either way the output equals collocated."""
    p, d = pd
    prompt = prompt_of(col, 2 * B + 1)
    sp = SamplingParams(temperature=0.9, seed=5, max_tokens=6)
    want, _ = run_col(col, prompt, sp)
    if how == "params-for-another-prompt":
        _, got = hand_off(p, d, prompt, sp, p_prompt=prompt[1:] + prompt[:1])
    else:
        _, got = hand_off(p, d, prompt, sp, ask=False)
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert got.outputs[0].text == want.outputs[0].text
    if how == "no-first-token":
        assert got.num_external_tokens + got.num_cached_tokens == len(prompt) - 1  # imported n - 1, replayed 1
    else:
        assert got.num_external_tokens == 0
    finish_p(p)
    assert_whole(p, d)


def test_d_ending_while_it_awaits_frees_its_blocks(pd, col):
    """An abort while the await waits: the blocks come back within a slice, P's post later goes to no one and its
    lease ends by the router's release."""
    p, d = pd
    prompt, sp = prompt_of(col, B + 5), SamplingParams(temperature=0, max_tokens=4)
    params = await_params(p)
    start_d(d, prompt, sp, params, rid="d-gone")
    final = d.engine.abort_request("d-gone")
    assert final.finished and final.outputs[0].finish_reason == "abort"
    assert d.engine.scheduler.transfers.deferred_free  # the blocks wait for the await to stop
    t0 = time.monotonic()
    drain(d, deadline=3 * handoffs.SLICE + 2)
    assert time.monotonic() - t0 < 2 * handoffs.SLICE + 1
    assert_whole(d)
    out = run_p(p, prompt, sp, params["await_kv"]["key"])
    assert p.engine.gateway.release_lease(out.kv_transfer_params) == "released"
    finish_p(p)
    assert_whole(p, d)


@pytest.mark.parametrize("how", ["timeout", "no-producer"])
def test_an_await_that_fails_is_recomputed(pd, col, monkeypatch, how):
    """The await runs out (P never posts): the failure policy (recompute) prefills the prompt on D. P's KV server
    not there (the endpoint D's server learnt is stale: P restarted elsewhere) is nobody's failure: prefilled here
    whatever the policy (the next test)."""
    p, d = pd
    prompt, sp = prompt_of(col, 2 * B), SamplingParams(temperature=0, max_tokens=5)
    want, _ = run_col(col, prompt, sp)
    params = await_params(p)
    if how == "timeout":
        monkeypatch.setattr(tcp_consumer, "WAIT_SECONDS", 0.3)
    else:
        params["await_kv"]["port"] = free_port()
    d.engine.add_request(prompt, sp, request_id="d-fail", kv_transfer_params=params)
    got = drain(d, deadline=10)["d-fail"]
    assert got.outputs[0].token_ids == want.outputs[0].token_ids and got.num_external_tokens == 0
    assert_whole(p, d)


@pytest.mark.parametrize("bad", [
    {"host": "127.0.0.1", "port": 1, "key": "x" * 32},
    {"host": "127.0.0.1", "port": "1", "key": "a" * 32},
    {"host": "127.0.0.1", "port": 1},
    {"host": "127.0.0.1", "port": 1, "key": "a" * 32, "more": 1},
])
def test_malformed_await_params_are_refused(pd, bad):
    _, d = pd
    with pytest.raises(ValueError, match="await_kv"):
        d.engine.add_request([1, 2, 3], SamplingParams(max_tokens=2), request_id="bad",
                             kv_transfer_params={"await_kv": bad})
    with pytest.raises(ValueError, match="await_kv"):
        d.engine.add_request([1, 2, 3], SamplingParams(max_tokens=2), request_id="bad",
                             kv_transfer_params={"await_kv": {"host": "127.0.0.1", "port": 1, "key": "a" * 32},
                                                 "do_remote_prefill": True})


def test_a_node_without_a_tcp_consumer_refuses_await(col):
    with pytest.raises(ValueError, match="no KV connector|cannot await"):
        col.engine.add_request([1, 2, 3], SamplingParams(max_tokens=2), request_id="bad",
                               kv_transfer_params={"await_kv": {"host": "127.0.0.1", "port": 1, "key": "a" * 32}})


def test_a_step_does_not_wait_out_an_await(pd, col, qwen3_tiny):
    """D's step waits up to kv_load_wait_ms for the loads it just started (a short pull runs in this step), but never
    for an await, which lasts P's queue and prefill: with a 1 s wait, D's steps still go on while P has not posted."""
    p, _ = pd
    d = LLM(qwen3_tiny, kv_transfer_config=_kv("kv_consumer", kv_transfer_timeout=2.0, kv_load_wait_ms=1000),
            **ENGINE)
    try:
        prompt, sp = prompt_of(col, B + 2), SamplingParams(temperature=0, max_tokens=3)
        want, _ = run_col(col, prompt, sp)
        params = await_params(p)
        t0 = time.monotonic()
        start_d(d, prompt, sp, params, steps=2)
        assert time.monotonic() - t0 < 0.7
        run_p(p, prompt, sp, params["await_kv"]["key"])
        assert drain(d)["d"].outputs[0].token_ids == want.outputs[0].token_ids
        finish_p(p)
        assert_whole(p, d)
    finally:
        d.engine.shutdown()


def test_an_idle_engine_is_woken_when_a_transfer_ends(pd):
    """D with only transfers in flight waits between polls (1 ms in the engine), but a transfer that ends wakes it."""
    p, d = pd
    consumer = d.engine.connector.consumer
    consumer.take_finished(FinishedTransfers())  # nothing is in flight here: this only clears the wake
    t0 = time.monotonic()
    consumer.wait_for_transfers(0.2)
    assert time.monotonic() - t0 >= 0.2  # no transfer ended: the wait runs out
    params = {"do_remote_prefill": True, "transfer_id": "none", "remote_host": "127.0.0.1",
              "remote_port": p.engine.connector.port}
    t0 = time.monotonic()
    assert consumer.release_remote(params, "wake")  # a bare `done` on a worker: it ends within milliseconds
    consumer.wait_for_transfers(5.0)
    assert time.monotonic() - t0 < 2.0


def test_an_await_never_makes_a_running_request_preempt(pd, col, qwen3_tiny):
    """D's pool (5 usable blocks): a request running here (2 blocks, its next token needs a third) and an await that
    would take the other 3. The await holds its blocks for P's whole prefill, so it waits for the free blocks to
    cover the running row's next slots too: no preemption, and both equal collocated."""
    p, _ = pd
    d = LLM(qwen3_tiny, kv_transfer_config=_kv("kv_consumer", kv_transfer_timeout=2.0), num_gpu_blocks_override=6,
            **{**ENGINE, "max_model_len": 4 * B})
    try:
        local, remote = prompt_of(col, 2 * B - 1), prompt_of(col, 2 * B + 1)[::-1]
        sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        wants = [run_col(col, pr, sp)[0].outputs[0].token_ids for pr in (local, remote)]
        d.engine.add_request(local, sp, request_id="local")
        d.engine.step()  # its prefill: 2 blocks, the next token's block still to come
        params = await_params(p)
        d.engine.add_request(remote, sp, request_id="await", kv_transfer_params=params)
        for _ in range(3):
            d.engine.step()
            assert not d.engine.scheduler.transfers.loading  # waits: the running row's next block comes first
        run_p(p, remote, sp, params["await_kv"]["key"])
        got = drain(d)
        assert [got[r].outputs[0].token_ids for r in ("local", "await")] == wants
        assert got["local"].num_preemptions == 0 and got["await"].num_external_tokens > 0
        finish_p(p)
        assert_whole(p, d)
    finally:
        d.engine.shutdown()


def test_awaits_and_running_rows_share_max_num_seqs(pd, col, qwen3_tiny):
    """A P that queues must not make D hold more requests' blocks than it runs: with max_num_seqs 2, a third await
    waits (its await not asked) until one of the first two ends, then all three equal collocated."""
    p, _ = pd
    d = LLM(qwen3_tiny, kv_transfer_config=_kv("kv_consumer", kv_transfer_timeout=2.0), max_num_seqs=2, **ENGINE)
    try:
        prompts = [prompt_of(col, B + 1 + i) for i in range(3)]
        sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
        wants = [run_col(col, pr, sp)[0].outputs[0].token_ids for pr in prompts]
        params = [await_params(p) for _ in prompts]
        for i, (pr, par) in enumerate(zip(prompts, params)):
            d.engine.add_request(pr, sp, request_id=f"a{i}", kv_transfer_params=par)
        for _ in range(3):
            d.engine.step()
        assert sorted(d.engine.scheduler.transfers.loading) == ["a0", "a1"]  # the third waits for a seat
        for pr, par in zip(prompts, params):
            run_p(p, pr, sp, par["await_kv"]["key"])
        got = drain(d)
        assert [got[f"a{i}"].outputs[0].token_ids for i in range(3)] == wants
        assert all(got[f"a{i}"].num_external_tokens + got[f"a{i}"].num_cached_tokens == len(prompts[i])
                   for i in range(3))
        finish_p(p)
        assert_whole(p, d)
    finally:
        d.engine.shutdown()


@pytest.mark.parametrize("n", [B, 3 * B + 1])
def test_awaited_hand_off_with_spec_decode_on_d(pd_spec, n):  # noqa: F811  (the imported fixture)
    """D drafting K = 2 and 4 (n-gram) from its first step, the await's blocks with their lookahead slots: greedy and
    seeded output equal the same speculating engine collocated."""
    p, d, c = pd_spec
    prompt = prompt_of(c, n)
    for sp in (SamplingParams(temperature=0, max_tokens=14), SamplingParams(temperature=0.8, seed=9, max_tokens=14)):
        want, _ = run_col(c, prompt, sp)
        _, got = hand_off(p, d, prompt, sp)
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        assert got.num_external_tokens + got.num_cached_tokens == n
        finish_p(p)
        assert_whole(p, d)


def test_an_await_broken_after_ps_params_releases_ps_lease(pd, col, monkeypatch):
    """P's KV server fails after sending the params, before the blocks (here: its payload raises, which closes the
    session with the lease not yet ended): D recomputes the prompt (the failure policy) and sends P a bare `done` on
    a fresh session, so P's lease ends now rather than at its expiry (30 s)."""
    p, d = pd

    def broken(block_ids):
        raise OSError("the cache could not be read")

    monkeypatch.setattr(p.engine.connector.blocks, "payload", broken)
    prompt, sp = prompt_of(col, 2 * B + 3), SamplingParams(temperature=0, max_tokens=4)
    want, _ = run_col(col, prompt, sp)
    _, got = hand_off(p, d, prompt, sp)
    assert got.outputs[0].token_ids == want.outputs[0].token_ids and got.num_external_tokens == 0
    finish_p(p, timeout=5.0)
    assert_whole(p, d)


def test_a_refused_await_is_prefilled_whatever_the_policy(pd, col, qwen3_tiny):
    """With kv_load_failure_policy fail, an await whose endpoint refuses the connection (a stale endpoint: P
    restarted on another port) still prefills on D rather than failing the client's request."""
    d = LLM(qwen3_tiny, kv_transfer_config=_kv("kv_consumer", kv_transfer_timeout=2.0, kv_load_failure_policy="fail"),
            **ENGINE)
    try:
        prompt, sp = prompt_of(col, B + 3), SamplingParams(temperature=0, max_tokens=4)
        want, _ = run_col(col, prompt, sp)
        d.engine.add_request(prompt, sp, request_id="stale", kv_transfer_params={
            "await_kv": {"host": "127.0.0.1", "port": free_port(), "key": uuid.uuid4().hex}})
        got = drain(d, deadline=10)["stale"]
        assert got.outputs[0].finish_reason != "error", got.error
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        assert_whole(d)
    finally:
        d.engine.shutdown()
