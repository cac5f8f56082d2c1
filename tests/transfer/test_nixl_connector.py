"""NixlConnector at the engine level: NIXL over UCX tcp on CPU memory; skipped when nixl is not importable.

P and D engines run in this process, except where P must die mid-read: there P is a spawned child, SIGSTOPped as D
posts (so the read stays in flight) and then SIGKILLed. Every scenario ends with both block pools whole."""
from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import threading
import time

import pytest

from pdserve import LLM, SamplingParams
from pdserve.serve.metrics import EngineCollector
from pdserve.transfer.nixl import agent as nixl_agent
from pdserve.transfer.nixl import notif
from pdserve.transfer.channel import pool as tcp_pool
from pdserve.transfer.nixl.agent import Transfer
from pdserve.transfer.channel.proof import sign_params
from tests.server_harness import free_port
from tests.transfer.test_pd_engine import ENGINE, PROMPTS, assert_whole, decode_on, drain, prefill_on

needs_nixl = pytest.mark.skipif(not nixl_agent.available(), reason="nixl is not installed")
SP = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
NIXL = {"kv_connector": "NixlConnector", "kv_auth_token": "secret"}


def producer(model, port=0, connector="NixlConnector", **kv):
    return LLM(model, kv_transfer_config={**NIXL, "kv_connector": connector, "kv_role": "kv_producer",
                                          "kv_port": port, "engine_id": "P0", **kv}, **ENGINE)


def consumer(model, connector="NixlConnector", **kv):
    return LLM(model, kv_transfer_config={**NIXL, "kv_connector": connector, "kv_role": "kv_consumer",
                                          "kv_transfer_timeout": 1.0, **kv}, **ENGINE)


def finish(llm, prompts, params, deadline=10.0) -> dict:
    """decode_on, stepping only until every request has finished (reads of a hung P keep the engine busy after)."""
    for i, (prompt, kp) in enumerate(zip(prompts, params)):
        llm.engine.add_request(prompt, SP, request_id=f"d{i}", kv_transfer_params=kp)
    done, end = {}, time.monotonic() + deadline
    while len(done) < len(prompts):
        assert time.monotonic() < end, "requests did not finish"
        done.update({int(o.request_id[1:]): o for o in llm.engine.step() if o.finished})
    return done


def tokens(out: dict) -> list:
    return [out[i].outputs[0].token_ids for i in range(len(out))]


@pytest.fixture(scope="module")
def collocated(qwen3_tiny):
    return [o.outputs[0].token_ids for o in LLM(qwen3_tiny, **ENGINE).generate(PROMPTS, SP, use_tqdm=False)]


@pytest.fixture(scope="module")
def nixl_pd(qwen3_tiny):
    if not nixl_agent.available():
        pytest.skip("nixl is not installed")
    p, d = producer(qwen3_tiny), consumer(qwen3_tiny)
    yield p, d
    p.engine.shutdown()
    d.engine.shutdown()


@pytest.fixture()
def pd(nixl_pd):
    p, d = nixl_pd
    yield p, d
    drain(d)
    drain(p, deadline=5)
    assert_whole(p, d)


@needs_nixl
def test_nixl_equals_tcp_and_collocated(pd, qwen3_tiny, collocated):
    p, d = pd
    pc, dc = p.engine.connector, d.engine.connector
    sent0, got0, steps0 = pc.stats.bytes_sent, dc.stats.bytes_received, d.engine.graph_stats()["non_full_by_reason"]
    params = prefill_on(p, PROMPTS)
    assert params[4] is None and all(kp["kv_connector"] == "NixlConnector" for kp in params[:4] + params[5:])
    assert tokens(decode_on(d, PROMPTS, params)) == collocated
    tp, td = producer(qwen3_tiny, free_port(), "TcpConnector"), consumer(qwen3_tiny, "TcpConnector")
    try:
        assert tokens(decode_on(td, PROMPTS, prefill_on(tp, PROMPTS))) == collocated
        drain(tp)
        assert_whole(tp, td)
    finally:
        tp.engine.shutdown()
        td.engine.shutdown()
    assert dc.stats.bytes_received > got0 and not dc.stats.failures
    steps = d.engine.graph_stats()["non_full_by_reason"]
    assert steps.get("prefill", 0) - steps0.get("prefill", 0) == 1  # only "x", prefilled on D
    drain(p)  # P frees each lease on its read's notification
    assert not pc.leases and pc.stats.bytes_sent - sent0 == dc.stats.bytes_received - got0
    stats = d.engine.gateway.transfer_stats(d.engine.scheduler.transfers.num_leased_blocks())
    series = {m.name: m for m in EngineCollector("m")._transfer(stats)}
    reads = len(PROMPTS) - 1
    for name in ("xfer_time_seconds", "post_time_seconds", "bytes_transferred", "num_descriptors"):
        assert sum(s.value for s in series[f"vllm:nixl_{name}"].samples if s.name.endswith("_count")) >= reads
    assert {n for n in series if n.startswith("vllm:nixl_") and series[n].type == "counter"} == {
        "vllm:nixl_num_failed_transfers", "vllm:nixl_num_failed_notifications", "vllm:nixl_num_kv_expired_reqs"}


@needs_nixl
def test_an_ended_read_is_pending_until_the_engine_takes_its_event(pd, collocated, monkeypatch):
    """Between a read leaving the poller's list and its event reaching the engine, has_pending() must not read
    false: the engine loop would stop polling with the event unread (it did: a killed P's read, ended in ERR, left
    its blocks held in a loaded full suite). Peer release ran in that gap, so it looks there."""
    p, d = pd
    c = d.engine.connector.consumer
    seen, release = [], c.peers.release

    def looked(*a, **kw):
        with c._cv:  # the read itself, or its event: one of them is always there (the tcp side aside)
            seen.append(bool(c._reads or c._events))
        return release(*a, **kw)
    monkeypatch.setattr(c.peers, "release", looked)
    assert tokens(decode_on(d, PROMPTS[:1], prefill_on(p, PROMPTS[:1]))) == collocated[:1]
    assert seen == [True], seen


@needs_nixl
def test_multi_connector_takes_nixl(pd, qwen3_tiny, collocated):
    p, _ = pd
    tp = producer(qwen3_tiny, free_port(), "TcpConnector")
    children = [{"kv_connector": "NixlConnector", "kv_role": "kv_consumer"},
                {"kv_connector": "TcpConnector", "kv_role": "kv_consumer"}]
    md = consumer(qwen3_tiny, "MultiConnector", connectors=children)
    try:
        params = prefill_on(p, PROMPTS[:2]) + prefill_on(tp, PROMPTS[2:4])
        assert tokens(decode_on(md, PROMPTS[:4], params)) == collocated[:4]
        nixl, tcp = md.engine.connector.children
        assert nixl.stats.bytes_received > 0 and tcp.stats.bytes_received > 0  # each read only its own params
        assert not nixl.stats.failures and not tcp.stats.failures
        drain(tp)
        assert_whole(tp, md)
    finally:
        tp.engine.shutdown()
        md.engine.shutdown()


@needs_nixl
@pytest.mark.parametrize("how", ["token", "compat"])
def test_unauthenticated_consumer_never_gets_descriptors(pd, qwen3_tiny, collocated, how):
    """A D with another KV token (params it would accept, as a proxy could sign them) or other compat fields: the
    handshake refuses it before any op, so P's metadata never leaves P, and the load falls back to recompute."""
    p, _ = pd
    d = consumer(qwen3_tiny, kv_auth_token="wrong" if how == "token" else "secret")
    pc, dc = p.engine.connector, d.engine.connector
    if how == "compat":
        dc.pool.compat = {**dc.pool.compat, "block_size": 32}
    try:
        params = prefill_on(p, PROMPTS[:2])
        if how == "token":
            params = [sign_params({k: v for k, v in kp.items() if k != "kv_proof"}, "wrong") for kp in params]
        served, handshakes = pc.producer.meta_served, pc.producer.server.handshakes
        assert tokens(decode_on(d, PROMPTS[:2], params)) == collocated[:2]
        assert dc.stats.failures["ProtocolError"] == 2 and dc.nstats.counters["num_failed_transfers"] == 2
        assert pc.producer.meta_served == served and pc.producer.server.handshakes == handshakes
        assert dc.agent.peers == [] and dc.stats.bytes_received == 0
        for lease in pc.leases.values():  # never claimed: D's done cannot reach P either
            lease.expiry = 0.0
        drain(p)
        assert_whole(d)
    finally:
        d.engine.shutdown()


@needs_nixl
def test_claimed_lease_is_held_past_expiry_and_reader_blocks_until_read_ends(pd, collocated, monkeypatch):
    """P: a lease D claimed (a read may be in flight) outlives its plain expiry and is freed by the claimant's
    notification, or at the claim's hold. D: a read still in flight at the deadline fails the load (recompute), and
    its blocks stay out of use until the read ends."""
    p, d = pd
    pc, dc = p.engine.connector, d.engine.connector
    stuck = []

    def read(peer, remote, local, notif=b""):  # posted, never progressed: the read of a hung P
        stuck.append(Transfer(peer, bytes(notif), 0, None))
        return stuck[-1]

    monkeypatch.setattr(dc.agent, "read", read)
    try:
        params = prefill_on(p, PROMPTS[1:3])
        free0, timeouts = d.engine.kv.num_free_blocks(), dc.stats.failures["timeout"]
        out = finish(d, PROMPTS[1:3], params)  # the deadline (1 s) passes: recomputed, blocks kept from reuse
        assert tokens(out) == collocated[1:3] and dc.stats.failures["timeout"] - timeouts == 2
        held = d.engine.scheduler.transfers.deferred_free
        kept = {b for r in held for b in d.engine.kv.blocks_of(r)}  # the prompts share a cached block
        assert len(held) == 2 and d.engine.kv.num_free_blocks() == free0 - len(kept) < free0
        tids = [kp["transfer_id"] for kp in params]
        assert set(pc.producer.claims) == set(tids)
        for lease in pc.leases.values():
            lease.expiry = 0.0
        p.engine.step()
        # pinned: not freed at expiry
        assert set(pc.leases) == set(tids) and p.engine.scheduler.transfers.num_leased_blocks() > 0
        # notifications that do not prove the claim free nothing, even from the claimant's agent name (issue 37
        # item 5: anyone reaching P's NIXL listener can send one): the bare transfer id, the other read's MAC, one
        # made for another nonce, one with a digit changed
        read = {notif.transfer_id(t.notif): t for t in stuck}  # the reads were posted in any order
        assert set(read) == set(tids)
        good = read[tids[0]].notif
        other_mac = read[tids[1]].notif.rpartition(b".")[2]
        forged = [tids[0].encode(), tids[0].encode() + b"." + other_mac,
                  notif.make(b"secret", tids[0], dc.agent.name, notif.new_nonce()),
                  good[:-1] + (b"0" if good[-1:] != b"0" else b"1")]
        unexpected = pc.stats.failures["nixl_unexpected_notification"]
        for msg in forged:
            dc.agent.notify(stuck[0].peer, msg)
        end = time.monotonic() + 5
        while pc.stats.failures["nixl_unexpected_notification"] < unexpected + len(forged):
            assert time.monotonic() < end, "P did not see the forged notifications"
            p.engine.step()
        assert set(pc.leases) == set(tids), "a notification that does not verify freed a lease"
        dc.agent.notify(stuck[0].peer, good)  # the read's notification: P frees that lease now
        end = time.monotonic() + 5
        while tids[0] in pc.leases and time.monotonic() < end:
            p.engine.step()
        assert tids[0] not in pc.leases and tids[1] in pc.leases
        expired = pc.nstats.counters["num_kv_expired_reqs"]
        pc.producer.claims[tids[1]] = {w: (0.0, n, k) for w, (_, n, k) in pc.producer.claims[tids[1]].items()}
        p.engine.step()  # the claim's hold is over: D has given up on that read
        assert not pc.leases and pc.nstats.counters["num_kv_expired_reqs"] == expired + 1
        assert len(d.engine.scheduler.transfers.deferred_free) == 2  # D: the reads have not ended
        for t in stuck:
            t.state = "ERR"
        drain(d)  # they ended: the blocks go back to D's pool
    finally:  # whatever failed: the reads end, so the pools can be checked
        for t in stuck:
            t.state = "ERR"


# ---- P in a child process, stopped and killed mid-read ----------------------------------------------------------
def _producer_main(model: str, port: int, conn) -> None:
    p = producer(model, port)
    conn.send(("ready", os.getpid()))
    while True:
        if conn.poll():
            cmd = conn.recv()
            if cmd == "stop":
                break
            conn.send(prefill_on(p, cmd))
        if p.engine.has_unfinished_requests():
            p.engine.step()  # notifications and lease expiry
        else:
            time.sleep(0.001)
    p.engine.shutdown()


@pytest.fixture()
def spawn_p(qwen3_tiny):
    """start(port) -> (process, pipe); every child is killed in teardown."""
    ctx, procs = mp.get_context("spawn"), []

    def start(port):
        here, there = ctx.Pipe()
        proc = ctx.Process(target=_producer_main, args=(qwen3_tiny, port, there), daemon=True)
        proc.start()
        procs.append(proc)
        assert here.poll(60), "P did not start"
        assert here.recv()[0] == "ready"
        return proc, here
    yield start
    for proc in procs:
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)


def stop_on_post(monkeypatch, agent, proc, kill_after=None):
    """P stops as D posts its first read (so it stays in flight); killed `kill_after` seconds later."""
    real = agent.read

    def read(*args, **kw):
        os.kill(proc.pid, signal.SIGSTOP)
        while open(f"/proc/{proc.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "T":  # stopped before the post
            time.sleep(1e-4)
        if kill_after is not None and not getattr(read, "armed", False):
            read.armed = True
            threading.Timer(kill_after, os.kill, (proc.pid, signal.SIGKILL)).start()
        return real(*args, **kw)
    monkeypatch.setattr(agent, "read", read)


@needs_nixl
def test_p_killed_mid_read_recomputes_and_a_restarted_p_is_added(qwen3_tiny, collocated, spawn_p, monkeypatch):
    """Three Ps in turn on one address: one that stops cleanly, one SIGKILLed mid-read, one that works. Each new
    one answers D's claim with a new agent, which D adds; the old agent goes once none of its reads is in flight."""
    port = free_port()
    d = consumer(qwen3_tiny, kv_transfer_timeout=5.0)
    dc = d.engine.connector
    try:
        proc, conn = spawn_p(port)
        conn.send(PROMPTS[:1])
        assert tokens(decode_on(d, PROMPTS[:1], conn.recv())) == collocated[:1]
        conn.send("stop")
        proc.join(10)
        proc, conn = spawn_p(port)
        conn.send(PROMPTS[:3])
        params = conn.recv()
        stop_on_post(monkeypatch, dc.agent, proc, kill_after=0.3)
        received, t0 = dc.stats.bytes_received, time.monotonic()
        assert tokens(decode_on(d, PROMPTS[:3], params)) == collocated[:3]  # recomputed on D
        assert time.monotonic() - t0 < 4.0  # the reads ended in ERR (P's sockets reset), not at the 5 s deadline
        assert dc.stats.failures["nixl_read_error"] >= 1 and dc.stats.bytes_received == received
        assert dc.agent.peers == []  # the stopped P's agent went at the new claim, the killed one's after its reads
        assert_whole(d)
        monkeypatch.undo()
        proc.join(5)
        proc, conn = spawn_p(port)
        # The killed P reset the `done`s it had accepted while stopped, which reads as a refused handshake: D holds
        # the address for tcp_pool.REFUSED_HOLD before it dials the new P (with 5 s, the new P's loads failed)
        time.sleep(tcp_pool.REFUSED_HOLD)
        conn.send(PROMPTS[:3])
        assert tokens(decode_on(d, PROMPTS[:3], conn.recv())) == collocated[:3]
        assert dc.stats.bytes_received > received and len(dc.agent.peers) == 1
        assert_whole(d)
    finally:
        d.engine.shutdown()


@needs_nixl
def test_hung_then_killed_p_fails_by_policy_and_blocks_wait_for_the_read(qwen3_tiny, spawn_p, monkeypatch):
    proc, conn = spawn_p(free_port())
    d = consumer(qwen3_tiny, kv_load_failure_policy="fail")
    e = d.engine
    try:
        conn.send(PROMPTS[2:3])
        params = conn.recv()
        stop_on_post(monkeypatch, e.connector.agent, proc)
        t0 = time.monotonic()
        out = finish(d, PROMPTS[2:3], params)[0]
        assert out.outputs[0].finish_reason == "error" and "timeout" in out.error
        assert 1.0 <= time.monotonic() - t0 < 3.0
        assert len(e.scheduler.transfers.deferred_free) == 1 and e.kv.num_free_blocks() < e.num_blocks - 1
        time.sleep(0.3)
        for _ in range(50):
            e.step()
        assert len(e.scheduler.transfers.deferred_free) == 1  # P is stopped: its read may still write those blocks
        os.kill(proc.pid, signal.SIGKILL)
        drain(d, deadline=5)  # the read ends in ERR: its blocks are freed
        assert_whole(d)
    finally:
        e.shutdown()


def test_missing_nixl_is_a_clear_start_error(qwen3_tiny, monkeypatch):
    monkeypatch.setattr(nixl_agent, "available", lambda: False)
    with pytest.raises(RuntimeError, match=r"kv_connector NixlConnector.*pip install --no-deps nixl-cu12==1\.5\.1 "
                                           r"nixl==1\.5\.1"):
        consumer(qwen3_tiny)


@needs_nixl
def test_a_load_failing_before_its_claim_releases_the_lease_at_once(pd, collocated, monkeypatch):
    """D's claim fails (here P's answer is refused): the load fails by policy (recompute) and D sends P a bare
    `done`, so the lease ends now; before, nothing was sent and P held the blocks until the lease expired."""
    from pdserve.transfer.channel.protocol import ProtocolError
    p, d = pd
    pc, nc = p.engine.connector, d.engine.connector.consumer

    def refused(session, endpoint, job, until):
        raise ProtocolError(f"producer answered 'busy' to the claim of transfer {job.params['transfer_id']}")
    monkeypatch.setattr(nc, "_claim", refused)
    failed0 = nc.stats.failures.get("ProtocolError", 0)
    params = prefill_on(p, PROMPTS[:2])
    assert len(pc.leases) == 2
    assert tokens(finish(d, PROMPTS[:2], params)) == collocated[:2]  # recomputed on D
    assert nc.stats.failures["ProtocolError"] - failed0 == 2
    end = time.monotonic() + 5
    while pc.leases and time.monotonic() < end:
        p.engine.step() if p.engine.has_unfinished_requests() else time.sleep(0.01)
    assert not pc.leases  # released by D's done, long before their expiry


@needs_nixl
def test_a_nixl_producer_beyond_loopback_warns_that_reads_are_unencrypted(qwen3_tiny, monkeypatch, caplog):
    """Issue 37 item 5: UCX does not encrypt, and kv_tls_* covers only the control channel: a NIXL P beyond loopback
    says so at start-up (bound on loopback here, told it is not)."""
    from pdserve.transfer.nixl import producer as nixl_producer
    monkeypatch.setattr(nixl_producer, "is_loopback", lambda host: False)
    caplog.set_level(logging.WARNING, logger="pdserve.transfer")
    p = producer(qwen3_tiny)
    p.engine.shutdown()
    warned = [m for m in (r.getMessage() for r in caplog.records if r.levelno == logging.WARNING) if "unencrypted" in m]
    assert len(warned) == 1 and "UCX" in warned[0], warned
