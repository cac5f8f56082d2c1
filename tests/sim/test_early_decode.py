"""The router's early decode in the simulator (`--pd-first-token prefill`, `--pd-early-decode`: the router's default;
docs/pd.md "Early decode"): D takes the request when P is asked, its scheduler allocates the blocks of all n prompt
tokens and holds them while P prefills (`await_kv`, the engine's own await rules), P's KV comes from P's step end,
and D's first own step is a plain decode of P's token. A token that ends the request at P drops D's request (its
await cancelled); a failed load is prefilled on D and the client still gets each token once."""
from __future__ import annotations

import pytest

from pdserve.config import EngineConfig
from pdserve.sim.connector import TransferModel
from pdserve.sim.run import build_nodes, parse_deployment, simulate
from pdserve.sim.simulator import Simulator
from pdserve.sim.trace import TraceRequest, prompt_token_ids, random_trace
from tests.sim.test_first_token import assert_done_and_whole


def cfg(**kw) -> EngineConfig:
    return EngineConfig.from_kwargs("sim", **{"max_num_seqs": 16, "max_model_len": 1024, **kw})


def run(profile, trace, early: bool, transfer: TransferModel, on_step=None, **kw):
    prefill, decode, fabric = build_nodes(parse_deployment("1p1d"), cfg(**kw), profile, transfer, 0.0, 0)
    sim = Simulator(prefill, decode, "round-robin", fabric, on_step, "prefill", early_decode=early)
    results, _ = sim.run(trace, [prompt_token_ids(t, 32000) for t in trace])
    assert_done_and_whole(results, trace, prefill, decode)
    assert prefill[0].connector.open_leases == 0 and not fabric.awaits and not fabric.board
    return results, prefill, decode, fabric


@pytest.mark.parametrize("n", [1 + 16, 3 * 16, 3 * 16 + 1])
def test_d_holds_the_prompts_blocks_while_p_prefills_and_decodes_ps_token_first(linear_profile, n):
    """n = B + 1, 3B, 3B + 1 (B = 16): when P's params come, D already holds ceil((n + 1) / B) blocks (the n prompt
    tokens and P's token's slot) for an await posted while P prefilled; D's first step starts when the load ends
    (P's step end + the link's time) and is a decode row of P's token over all n prompt tokens; the KV of all n
    moved."""
    link = TransferModel(1e9, 0.002)
    prefill, decode, fabric = build_nodes(parse_deployment("1p1d"), cfg(), linear_profile, link, 0.0, 0)
    at_post, d_rows, p_end = [], [], []
    post = fabric.post

    def spy_post(key, params, now):
        at_post.append((key in fabric.awaits, decode[0].kv.pool.num_blocks - 1 - decode[0].kv.num_free_blocks()))
        return post(key, params, now)
    fabric.post = spy_post

    def on_step(node, rec):
        (p_end.append(rec.end) if node.name == "prefill0" else d_rows.append((rec.start, rec.rows)))
    sim = Simulator(prefill, decode, "round-robin", fabric, on_step, "prefill", early_decode=True)
    trace = [TraceRequest("a", 0.0, n, 4)]
    results, _ = sim.run(trace, [prompt_token_ids(trace[0], 32000)])
    assert results[0].success and results[0].output_tokens == 4
    assert at_post == [(True, -(-(n + 1) // 16))]
    assert fabric.bytes_moved == -(-n // 16) * 16 * linear_profile.model.kv_bytes_per_token
    start, rows = d_rows[0]
    assert rows == [("a", n, 1)] and len(d_rows) == 3  # P's token, then D's three own tokens' steps
    assert start == pytest.approx(p_end[0] + link.seconds(fabric.bytes_moved), abs=1e-12)
    for node in prefill + decode:
        node.scheduler.check_invariants()
        assert node.kv.num_free_blocks() == node.kv.pool.num_blocks - 1


def test_the_first_gap_holds_the_link_but_not_ds_own_latency(linear_profile):
    """A request latency of 5 ms on every node: asked after P answered, D's first own token comes its latency after
    P's token plus the link; asked early, only the link (D's latency passed while P prefilled)."""
    from pdserve.sim.profile import profile_from_dict
    from tests.sim.conftest import LINEAR
    profile = profile_from_dict({**LINEAR, "served": {"request_latency_s": 0.005}})
    trace = [TraceRequest("a", 0.0, 200, 6)]
    link = TransferModel(1e9, 0.001)
    late, early = (simulate(trace, parse_deployment("1p1d"), cfg(), profile, transfer=link, pd_first_token="prefill",
                            early_decode=e) for e in (False, True))
    assert early["ttfts"] == late["ttfts"]  # P's answer either way
    assert late["itls"][0][0] - early["itls"][0][0] == pytest.approx(0.005, abs=1e-9)
    assert late["itls"][0][1:] == pytest.approx(early["itls"][0][1:])
    assert early["sim"]["pd_early_decode"] and not late["sim"]["pd_early_decode"]


def test_a_first_token_that_ends_the_request_drops_ds_await(linear_profile):
    """Output length 1: P's token is the answer; D took the request early and the router drops it: D aborts it,
    its await is cancelled and its blocks come back; the other request runs to its length on D."""
    trace = [TraceRequest("one", 0.0, 100, 1), TraceRequest("two", 0.0, 100, 5)]
    results, prefill, decode, fabric = run(linear_profile, trace, True, TransferModel(1e9, 0.001))
    assert [r.output_tokens for r in results] == [1, 5]
    assert set(decode[0].connector.load_times) == {"two"}  # `one` awaited, never loaded


def test_awaits_share_ds_seats_with_its_running_rows(linear_profile):
    """max_num_seqs 2 on D and six requests at once: D never holds more than two requests between its awaits and
    its running rows (Scheduler._await_waits); the rest wait in its queue with no blocks."""
    seen = []

    def on_step(node, rec):
        if node.name == "prefill0":
            s = decode[0].scheduler
            seen.append(len(s.running) + len(s.transfers.loading))
    trace = [TraceRequest(f"r{i}", 0.0, 60, 8) for i in range(6)]
    prefill, decode, fabric = build_nodes(parse_deployment("1p1d"), cfg(max_num_seqs=2), linear_profile,
                                          TransferModel(1e9, 0.001), 0.0, 0)
    sim = Simulator(prefill, decode, "round-robin", fabric, on_step, "prefill", early_decode=True)
    results, _ = sim.run(trace, [prompt_token_ids(t, 32000) for t in trace])
    assert_done_and_whole(results, trace, prefill, decode)
    assert max(seen) == 2 and 2 in seen


@pytest.mark.parametrize("rate", [0.3, 1.0])
def test_failed_loads_are_prefilled_on_d_and_each_token_reaches_the_client_once(linear_profile, rate):
    """A failed await's load is recomputed on D (the failure policy): D samples the first token itself, which the
    router cuts (the client has P's), so every request has exactly its length; P's leases all end."""
    trace = random_trace(30, 120, 8, request_rate=20.0, range_ratio=0.5, seed=5)
    results, prefill, decode, fabric = run(linear_profile, trace, True,
                                           TransferModel(1e9, 0.001, load_failure_rate=rate))
    assert fabric.failed_loads == (len(trace) if rate == 1.0 else fabric.failed_loads) > 0
    assert [r.output_tokens for r in results] == [t.output_len for t in trace]


def test_an_await_that_begins_after_ps_lease_ended_is_prefilled_on_d(linear_profile):
    """D holds one request at a time (max_num_seqs 1) and P's leases last 50 ms: awaits that only begin once a seat
    frees find P's lease over (a real P's KV server answers LeaseGone) and D prefills those prompts itself; every
    lease that expired is one request prefilled on D, and each still reaches the client whole."""
    d_prefills = set()

    def on_step(node, rec):
        if node.name == "decode0":
            d_prefills.update(r[0] for r in rec.rows if r[1] == 0)
    trace = random_trace(12, 200, 30, request_rate=200.0, seed=6)
    results, prefill, decode, fabric = run(linear_profile, trace, True, TransferModel(1e9, 0.001, lease_seconds=0.05),
                                           on_step, max_num_seqs=1)
    assert fabric.expired_leases > 0 and len(d_prefills) == fabric.expired_leases
    assert set(decode[0].connector.load_times) == {t.request_id for t in trace} - d_prefills


@pytest.mark.parametrize("blocks", [9, 10])
def test_awaits_into_a_dry_pool_wait_and_preempted_imports_finish_whole(linear_profile, blocks):
    """D's pool holds little more than one request (9 or 10 blocks of 16, max_model_len 127: the null block, then 8
    or 9 usable; a request of 60 + 8 tokens needs 4 blocks at its await and 5 by its end) and six requests come
    together: an await that finds too few free blocks waits at D's queue head with none allocated
    (Scheduler._await_waits) while the pool is short of its 4; once two imported requests run, their growth runs the
    pool dry and D preempts one, as vLLM's scheduler does (an await takes blocks only while the running rows' next
    slots stay covered, not their whole growth); the preempted request recomputes its prompt and P's token on D, and
    every request completes with its length, both pools whole after (assert_done_and_whole)."""
    dry = []

    def on_step(node, rec):
        if node.name == "decode0":
            s, kv = decode[0].scheduler, decode[0].kv
            if s.waiting and s.running and kv.num_free_blocks() < 4:
                dry.append(kv.num_free_blocks())
    trace = [TraceRequest(f"r{i}", 0.001 * i, 60, 8) for i in range(6)]
    prefill, decode, fabric = build_nodes(parse_deployment("1p1d"), cfg(num_gpu_blocks_override=blocks,
                                                                         max_model_len=127),
                                          linear_profile, TransferModel(1e9, 0.001), 0.0, 0)
    sim = Simulator(prefill, decode, "round-robin", fabric, on_step, "prefill", early_decode=True)
    results, _ = sim.run(trace, [prompt_token_ids(t, 32000) for t in trace])
    assert_done_and_whole(results, trace, prefill, decode)
    assert [r.output_tokens for r in results] == [8] * 6
    assert dry and decode[0].scheduler.num_preemptions > 0
    assert prefill[0].connector.open_leases == 0 and not fabric.awaits and not fabric.board
