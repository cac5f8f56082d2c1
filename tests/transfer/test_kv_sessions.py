"""The tcp KV transport's reused sessions: one handshake per producer for many transfers, a failure that costs only
its own session, P's idle timeout, and D's `check_remote`. Every scenario ends with both block pools whole. Also a
session's receiver on TCP, which sleeps until a group is in, woken for every frame however its bytes trickle in."""
from __future__ import annotations

import os
import random
import socket
import threading
import time

import numpy as np
import pytest

from pdserve import LLM, SamplingParams
from pdserve.kv_transfer_config import KVTransferConfig
from pdserve.transfer.channel.handshake import client_handshake
from pdserve.transfer.channel.protocol import GROUP, TAIL, ProtocolError, Session, tune
from pdserve.transfer.base import ConnectorContext
from pdserve.transfer.tcp.connector import TcpConnector
from tests.server_harness import free_port
from tests.transfer.test_pd_engine import ENGINE, PROMPTS, assert_whole, consumer, drain, prefill_on, producer

SP = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def local(qwen3_tiny):
    """What D computes for PROMPTS when it prefills them itself."""
    outs = LLM(qwen3_tiny, **ENGINE).generate(PROMPTS, SP, use_tqdm=False)
    return {p: o.outputs[0].token_ids for p, o in zip(PROMPTS, outs)}


@pytest.fixture(scope="module")
def pd(qwen3_tiny):
    p, d = producer(qwen3_tiny, free_port()), consumer(qwen3_tiny)
    yield p, d
    p.engine.shutdown()
    d.engine.shutdown()


@pytest.fixture()
def fresh(pd):
    """P and D with no session open between them (whatever earlier tests left), and their handshake counters."""
    p, d = pd
    pool = d.engine.connector.pool
    pool.drop()
    pool.handshakes = pool.redials = 0
    for llm in (p, d):
        llm.engine.connector.stats.failures.clear()
    yield p, d, pool, p.engine.connector.producer.server
    drain(d)
    drain(p, deadline=5)
    assert_whole(p, d)


def decode(d, prompts, params) -> dict:
    """Adds them all at once (their loads run side by side), steps D until idle: {prompt: output}."""
    rids = {}
    for prompt, kp in zip(prompts, params):
        rids[d.engine.add_request(prompt, SP, kv_transfer_params=kp).request_id] = prompt
    return {rids[rid]: out for rid, out in drain(d).items()}


def hook_reads(p, monkeypatch, hook) -> None:
    """`hook(session, header)` runs on P's KV server before each read it serves."""
    ops = p.engine.connector.producer.server.ops
    real = ops["read"]
    monkeypatch.setitem(ops, "read", lambda session, header: (hook(session, header), real(session, header))[1])


def test_transfers_to_one_producer_share_one_handshake(fresh, local):
    p, d, pool, server = fresh
    before = server.handshakes
    for prompt, kp in zip(PROMPTS[1:4], prefill_on(p, PROMPTS[1:4])):  # one after another: each finds the
        assert decode(d, [prompt], [kp])[prompt].outputs[0].token_ids == local[prompt]  # session the last left
        assert d.engine.connector.check_remote(kp) == 0.0  # its `done` reached P on that session too
    assert pool.handshakes == 1 and server.handshakes - before == 1 and pool.redials == 0
    assert d.engine.connector.stats.bytes_received > 0 and not d.engine.connector.stats.failures


def test_broken_session_fails_its_load_and_the_next_reconnects(fresh, local, monkeypatch):
    """P cuts the session in the middle of the first load (reads asked, none answered): that load fails by the
    failure policy (recomputed here) and its blocks go back, and D sends P a bare `done` on a new session, which P
    frees the lease for; the next load finds that session idle and pulls on it."""
    p, d, pool, server = fresh
    cut = []

    def cut_once(session, header):
        if not cut:
            cut.append(header["transfer_id"])
            socket.socket.shutdown(session.sock, socket.SHUT_RDWR)

    hook_reads(p, monkeypatch, cut_once)
    kp = prefill_on(p, PROMPTS[2:4])
    out = decode(d, PROMPTS[2:3], kp[:1])
    assert out[PROMPTS[2]].outputs[0].token_ids == local[PROMPTS[2]]
    assert d.engine.connector.stats.failures == {"ConnectionError": 1} and pool.redials == 0
    deadline = time.monotonic() + 5
    while pool.num_idle() == 0:  # the `done`'s session: the cut one was dropped, not pooled
        assert time.monotonic() < deadline, "no `done` after the failed load"
        time.sleep(0.01)
    assert pool.num_idle() == 1 and pool.handshakes == 2
    assert d.engine.connector.check_remote(kp[0]) == 0.0  # P heard it: the lease is gone, not left to run out
    received = d.engine.connector.stats.bytes_received
    out = decode(d, PROMPTS[3:4], kp[1:])
    assert out[PROMPTS[3]].outputs[0].token_ids == local[PROMPTS[3]]
    assert d.engine.connector.stats.bytes_received > received and pool.handshakes == 2 and pool.redials == 0
    assert d.engine.connector.stats.failures == {"ConnectionError": 1}


def test_deadline_on_one_load_spares_the_other(fresh, local, monkeypatch):
    """Two loads at once, one session in the pool: P stalls one load's reads past kv_transfer_timeout (1 s), whose
    deadline shuts that load's session only; the other load, on its own session, completes."""
    p, d, pool, server = fresh
    kp = prefill_on(p, PROMPTS[1:4])
    decode(d, PROMPTS[1:2], kp[:1])  # leaves one idle session for the two loads below to contend for
    slow = kp[1]["transfer_id"]
    hook_reads(p, monkeypatch, lambda session, header: header["transfer_id"] == slow and time.sleep(1.5))
    out = decode(d, PROMPTS[2:4], kp[1:])
    assert [out[q].outputs[0].token_ids for q in PROMPTS[2:4]] == [local[q] for q in PROMPTS[2:4]]
    assert d.engine.connector.stats.failures == {"timeout": 1}  # the slow one, recomputed
    deadline = time.monotonic() + 5
    while pool.num_idle() == 0:  # a `done` may hold it a moment (it failed once so in a loaded full suite)
        assert time.monotonic() < deadline, "the spared session never went back to the pool"
        time.sleep(0.01)
    assert pool.handshakes == 2 and pool.num_idle() == 1  # the spared session went back to the pool
    time.sleep(0.3)  # P's stalled read wakes, finds its session shut, drops its pin
    for lease in p.engine.connector.leases.values():
        lease.expiry = 0.0


def test_session_p_closed_is_replaced(fresh, local, monkeypatch):
    """P closes a session just as D sends its reads (it looked fine, then failed before any answer): D redoes the
    load once on a fresh session. P closes sessions idle for 0.2 s: D sees that one closed before using it, and
    dials anew. Neither fails a load."""
    p, d, pool, server = fresh
    kp = prefill_on(p, PROMPTS[1:4])
    decode(d, PROMPTS[1:2], kp[:1])
    hook_reads(p, monkeypatch, lambda session, header: socket.socket.shutdown(session.sock, socket.SHUT_RDWR)
               if pool.redials == 0 else None)
    out = decode(d, PROMPTS[2:3], kp[1:2])
    assert out[PROMPTS[2]].outputs[0].token_ids == local[PROMPTS[2]]
    assert pool.handshakes == 2 and pool.redials == 1
    monkeypatch.setattr(server, "idle_seconds", 0.2)
    assert d.engine.connector.check_remote(kp[2]) == 30.0  # on that session, which P now lets idle 0.2 s
    time.sleep(0.5)
    assert pool.num_idle() == 1
    out = decode(d, PROMPTS[3:4], kp[2:])
    assert out[PROMPTS[3]].outputs[0].token_ids == local[PROMPTS[3]]
    assert pool.handshakes == 3 and pool.redials == 1  # caught before use
    assert d.engine.connector.stats.bytes_received > 0 and not d.engine.connector.stats.failures


def test_check_remote(fresh):
    p, d, pool, server = fresh
    c = d.engine.connector
    kp = prefill_on(p, PROMPTS[3:4])[0]
    lease = p.engine.connector.leases[kp["transfer_id"]]
    lease.expiry = time.monotonic() + 1.0
    answers = []
    threads = [threading.Thread(target=lambda: answers.append(c.check_remote(kp))) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert answers == [30.0] * 6 and lease.expiry > time.monotonic() + 20  # seconds left; asking extended it
    dialed = pool.handshakes
    assert [c.check_remote(kp) for _ in range(4)] == [30.0] * 4 and pool.handshakes == dialed  # sessions reused
    assert c.check_remote({**kp, "transfer_id": "never-made"}) == 0.0
    assert p.engine.connector.release_lease(kp["transfer_id"], kp["remote_request_id"])
    assert c.check_remote(kp) == 0.0
    with pytest.raises(ValueError, match="not in kv_peers"):  # never dialed
        c.check_remote({**kp, "remote_host": "10.255.0.1"})
    assert pool.handshakes == dialed
    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts, never answers: kv_transfer_timeout (1 s)
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            c.check_remote({**kp, "remote_port": silent.getsockname()[1]})
        assert time.monotonic() - t0 < 2.0
    with pytest.raises(ConnectionError):  # nothing listens there
        c.check_remote({**kp, "remote_port": free_port()})
    cfg = KVTransferConfig.from_dict({"kv_connector": "TcpConnector", "kv_role": "kv_consumer",
                                      "kv_auth_token": "not-the-secret", "kv_transfer_timeout": 1.0})
    wrong = TcpConnector(cfg, ConnectorContext(d.engine.config.cache.block_size, c.compat))
    with pytest.raises(ProtocolError, match="authentication"):
        wrong.check_remote(kp)
    wrong.shutdown()


def test_frame_replayed_later_in_a_session_is_refused(fresh):
    """A long session's counters run on across operations: D's first frame, sent again after later ones, fails
    authentication, and P ends the session."""
    p, d, pool, server = fresh
    c = p.engine.connector
    sock = socket.create_connection(("127.0.0.1", c.port))
    session = client_handshake(sock, b"secret", c.compat)
    for _ in range(3):
        session.send({"op": "renew", "transfer_id": "none"})
        assert session.recv(into=[])[0] == {"status": "expired"}
    Session(sock, session.key, is_consumer=True).send({"op": "renew", "transfer_id": "none"})  # frame number 0
    sock.settimeout(3)
    assert sock.recv(100) == b""  # closed, nothing answered
    assert c.stats.failures == {"ProtocolError": 1}
    sock.close()


def test_producer_gone_fails_the_load_on_a_pooled_session(qwen3_tiny, local):
    """P's KV server stops (every session of it ends): D's next load finds its pooled session dead, cannot dial,
    and recomputes; both pools end whole."""
    p, d = producer(qwen3_tiny, free_port()), consumer(qwen3_tiny)
    try:
        kp = prefill_on(p, PROMPTS[2:4])
        decode(d, PROMPTS[2:3], kp[:1])
        assert d.engine.connector.pool.num_idle() == 1
        p.engine.connector.shutdown()
        out = decode(d, PROMPTS[3:4], kp[1:])
        assert out[PROMPTS[3]].outputs[0].token_ids == local[PROMPTS[3]]
        assert sum(d.engine.connector.stats.failures.values()) == 1 and d.engine.connector.pool.num_idle() == 0
        for lease in p.engine.connector.leases.values():
            lease.expiry = 0.0
        drain(p, deadline=5)
        assert_whole(p, d)
    finally:
        p.engine.shutdown()
        d.engine.shutdown()


class _Wire:
    """Stands in for a producer's socket: keeps what its session sends."""
    family = socket.AF_UNIX

    def __init__(self):
        self.data = bytearray()

    def sendmsg(self, views) -> int:
        for v in views:
            self.data += memoryview(v).cast("B")
        return sum(memoryview(v).nbytes for v in views)


def test_trickled_frames_wake_the_receiver_in_time():
    """A receiver on TCP sleeps until a whole group is in (SO_RCVLOWAT), a mark that must never pass what is
    still to come: frames of sizes around the group boundaries, arriving in uneven pieces with pauses (so waits
    begin with part of a group already copied), are each received whole and verified well within the socket's
    timeout, and the mark is back to 1 between frames."""
    key, rng = os.urandom(32), np.random.default_rng(1)
    sizes = [1, TAIL - 1, TAIL + 1, GROUP - 1, GROUP + TAIL + 7, 3 * GROUP + 5, 2 * GROUP + 2 * TAIL]
    payloads = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    wire = _Wire()
    sender = Session(wire, key, is_consumer=False)
    for i, payload in enumerate(payloads):
        sender.send({"i": i}, payload)
    pieces, pos, chop = [], 0, random.Random(2)
    while pos < len(wire.data):
        n = chop.choice([1, 100, 5000, 60_000, TAIL, GROUP // 2 + 3])
        pieces.append(bytes(wire.data[pos:pos + n]))
        pos += n

    with socket.create_server(("127.0.0.1", 0)) as srv:
        def trickle():
            conn, _ = srv.accept()
            with conn:
                for k, piece in enumerate(pieces):
                    conn.sendall(piece)
                    if k % 3 == 0:
                        time.sleep(0.002)
                conn.recv(1)  # until the receiver is done
        t = threading.Thread(target=trickle, daemon=True)
        t.start()
        sock = socket.create_connection(srv.getsockname())
        try:
            tune(sock, timeout=5.0)  # a wait that never ended would raise after 5 s
            receiver = Session(sock, key, is_consumer=True)
            for i, payload in enumerate(payloads):
                t0, into = time.monotonic(), [memoryview(bytearray(payload.nbytes))]
                header, got = receiver.recv(into=into)
                assert header == {"i": i} and bytes(got[0]) == payload.tobytes()
                assert time.monotonic() - t0 < 2.0
                assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT) == 1
        finally:
            sock.close()
        t.join(5)


def test_a_kv_port_in_use_names_the_setting():
    from pdserve.transfer.channel.control import ControlServer
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{port} .*set kv_port"):
            ControlServer("127.0.0.1", port, b"t" * 32, {}, {}, handshake_timeout=1, wait_timeout=1)
    finally:
        taken.close()
