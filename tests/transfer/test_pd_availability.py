"""Availability of P/D (issue 37): a lease gone before D loads the request is served by a local prefill, not a
client error; a MultiConnector producer holds one lease per request, not one per child.

P is an in-process engine over the tcp connector; D is the engine loop (serve/engine_core.py) on a thread, as the
server's thread backend runs it. Oracle: a collocated engine on the same
weights; both block pools whole and no block orphaned at the end of every case."""
from __future__ import annotations

import time

import pytest

from pdserve import LLM, SamplingParams
from pdserve.config import EngineConfig
from pdserve.serve.engine_commands import AddRequest, GetKVInfo
from pdserve.transfer.channel.proof import sign_params
from tests.serve.test_failure_paths_engine_core import Loop
from tests.server_harness import free_port
from tests.transfer.test_pd_engine import ENGINE, PROMPTS, assert_whole, drain, expire_leases, prefill_on, producer

SP = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def collocated(qwen3_tiny):
    return [o.outputs[0].token_ids for o in LLM(qwen3_tiny, **ENGINE).generate(PROMPTS[:4], SP, use_tqdm=False)]


def d_loop(model, **kv) -> Loop:
    """D's engine loop on a thread (the thread backend's), with a tcp consumer."""
    return Loop(EngineConfig.from_kwargs(model, **ENGINE, kv_transfer_config={
        "kv_connector": "TcpConnector", "kv_role": "kv_consumer", "kv_auth_token": "secret",
        "kv_transfer_timeout": 1.0, **kv}))


def send(loop: Loop, d_ids: list, params: list, sp=SP) -> None:
    for i, (ids, kp) in enumerate(zip(d_ids, params)):
        loop.inbox.put(AddRequest(f"d{i}", ids, sp, time.monotonic(), kp))


def tokens_of(loop: Loop, rid: str) -> list[int]:
    return [t for r in loop.records[rid] for t in r.new_token_ids]


def assert_loop_whole(loop: Loop) -> None:
    loop.pool_whole()
    loop.qid += 1
    assert loop.ask(GetKVInfo(loop.qid)).get("orphaned_blocks", 0) == 0


@pytest.mark.parametrize("first_token", [False, True], ids=["replay", "first-token"])
@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_lease_gone_before_the_load_is_prefilled_here(qwen3_tiny, collocated, first_token, policy):
    """D's load asks P for the KV and P no longer holds it (its lease expired while D stalled past
    kv_lease_seconds; the same answer as a lease released, used, or lost with a restarted P): P answers `expired`
    (LeaseGone) and D prefills the prompt itself, whatever kv_load_failure_policy, and says it took none of P's KV
    (the router's X-PD-KV-Unused).
    Before, a 400 that the router turned into a 502. A proof that does not verify is still refused (a 400 on
    kv_transfer_params: a deployment error, never a local prefill)."""
    p = producer(qwen3_tiny, free_port(), **({"pd_first_token": "prefill"} if first_token else {}))
    loop = d_loop(qwen3_tiny, kv_load_failure_policy=policy)
    try:
        tok = p.get_tokenizer()
        ids = [tok(prompt).input_ids for prompt in PROMPTS[:4]]
        params = prefill_on(p, PROMPTS[:4])
        assert all(("first_token" in kp) == first_token for kp in params)
        expire_leases(p)  # D stalled past kv_lease_seconds
        forged = sign_params({k: v for k, v in params[0].items() if k != "kv_proof"}, "another token")
        send(loop, ids + [ids[0]], params + [forged])
        for i in range(4):
            rec = loop.finished(f"d{i}")
            assert rec.finish_reason == "length" and not rec.rejected and rec.error is None, rec
            assert tokens_of(loop, f"d{i}") == collocated[i]
            if not first_token:  # (P's first token goes out at admission, before D knows whether it will load)
                assert any(r.kv_unused for r in loop.records[f"d{i}"])  # D took none of P's KV
        bad = loop.finished("d4")
        assert bad.rejected and "kv_transfer_params" in bad.error, bad
        assert loop.core.engine.connector.stats.bytes_received == 0  # P had nothing to send
        drain(p, deadline=5)
        assert_whole(p)
        assert_loop_whole(loop)
    finally:
        loop.stop()
        p.engine.shutdown()


def test_a_multi_connector_producer_holds_one_lease_per_request(qwen3_tiny, collocated):
    """P's MultiConnector of two transports ("tcp beside nixl"; here two tcp servers): the response names one
    child's lease, so the other child's lease on the same blocks could never be read. It ends at once: once D has
    pulled through the first child, P's pool is whole right away, not after kv_lease_seconds (before, every
    request's blocks stayed pinned for the lease: P's usable cache shrank by rate x 30 s)."""
    from tests.transfer.test_pd_engine import consumer, decode_on
    children = [{"kv_connector": "TcpConnector", "kv_role": "kv_producer", "kv_port": free_port()} for _ in range(2)]
    p = LLM(qwen3_tiny, kv_transfer_config={"kv_connector": "MultiConnector", "kv_role": "kv_producer",
                                            "engine_id": "P0", "kv_auth_token": "secret", "connectors": children},
            **ENGINE)
    d = consumer(qwen3_tiny)
    try:
        first, second = p.engine.connector.children
        params = prefill_on(p, PROMPTS[:4])
        assert {kp["remote_port"] for kp in params} == {first.port}
        assert len(first.leases) == 4 and not any(lease.done for lease in first.leases.values())
        assert all(lease.done for lease in second.leases.values())  # ended already: one lease per request
        out = decode_on(d, PROMPTS[:4], params)
        assert [out[i].outputs[0].token_ids for i in range(4)] == collocated
        assert d.engine.connector.stats.bytes_received > 0 and not d.engine.connector.stats.failures
        drain(p, deadline=5)  # the leases' lives are 30 s: a lease still held would time this out
        assert first.stats.failures["lease_expired"] == second.stats.failures["lease_expired"] == 0
        assert_whole(p, d)
    finally:
        p.engine.shutdown()
        d.engine.shutdown()


def reclaim_series(llm) -> dict:
    """The reclamation series of `llm`'s /metrics, as the server's collector renders them."""
    from pdserve.serve.metrics import EngineCollector
    e = llm.engine
    stats = e.gateway.transfer_stats(e.scheduler.transfers.num_leased_blocks())
    stats.update(e.scheduler.transfers.reclaim_stats())
    series = {m.name: m for m in EngineCollector("m")._transfer(stats)}
    gauge = series["pdserve_kv_orphaned_blocks"].samples[0].value
    count = next(s.value for s in series["pdserve_kv_reclaim_seconds"].samples if s.name.endswith("_count"))
    return {"orphaned": gauge, "reclaimed": count}


def test_orphaned_blocks_show_until_reclaimed_on_p(qwen3_tiny):
    """P: leases no D took expire (a D that never came): until P reaps them their blocks are held for no one, and
    the gauge says how many; once reaped it is 0 and the histogram has one reclaim per lease. A lease a reader
    still pins past its end stays orphaned until the read ends."""
    p = producer(qwen3_tiny, free_port())
    try:
        params = prefill_on(p, PROMPTS[1:3])
        held = p.engine.scheduler.transfers.num_leased_blocks()
        assert reclaim_series(p) == {"orphaned": 0, "reclaimed": 0}  # live leases are no orphans
        tid = params[0]["transfer_id"]
        assert p.engine.connector.lease_table.pin(tid) is not None  # a read in flight
        expire_leases(p)
        assert reclaim_series(p)["orphaned"] == held
        p.engine.step()  # reaps the unpinned one
        pinned = len(p.engine.connector.leases[tid].block_ids)
        assert reclaim_series(p) == {"orphaned": pinned, "reclaimed": 1}
        p.engine.connector.lease_table.unpin(tid)
        drain(p, deadline=5)
        assert reclaim_series(p) == {"orphaned": 0, "reclaimed": 2}
        assert_whole(p)
    finally:
        p.engine.shutdown()


def test_orphaned_blocks_show_until_reclaimed_on_d(qwen3_tiny):
    """D: a request aborted while its load is in flight (a P that accepts and never answers) leaves blocks the
    loader may still write: orphaned until the load reports (its 1 s timeout), then freed, reclaimed and counted."""
    import socket
    import threading

    from tests.transfer.test_pd_engine import consumer, params_for_peer
    srv = socket.create_server(("127.0.0.1", 0))
    held = []
    threading.Thread(target=lambda: held.append(srv.accept()), daemon=True).start()
    d = consumer(qwen3_tiny)
    try:
        d.engine.add_request(PROMPTS[2], SP, request_id="gone",
                             kv_transfer_params=params_for_peer(d, PROMPTS[2], srv.getsockname()[1]))
        while "gone" not in d.engine.scheduler.transfers.loading:
            d.engine.step()
        d.engine.abort_request("gone")
        assert reclaim_series(d)["orphaned"] > 0 and reclaim_series(d)["reclaimed"] == 0
        drain(d, deadline=10)
        assert reclaim_series(d) == {"orphaned": 0, "reclaimed": 1}
        assert_whole(d)
    finally:
        d.engine.shutdown()
        srv.close()
