"""P/D at the engine level (no HTTP): a producer and a consumer engine in one process over the tcp connector.

Each scenario checks the outcome and that both block pools are whole afterwards."""
from __future__ import annotations

import json
import socket
import threading
import time
from typing import Optional

import pytest

from pdserve import LLM, SamplingParams
from pdserve.transfer.channel.proof import sign_params
from tests.server_harness import free_port

ENGINE = dict(max_model_len=512, kv_cache_memory_gb=0.05)
PROMPTS = ["def fibonacci(n):\n" * k for k in (1, 3, 9, 20)] + ["x", "import os\nimport sys\n"]


def producer(model, port, llm: Optional[dict] = None, **kv):
    """P over tcp; `llm`: engine arguments over ENGINE, `kv`: KV config entries over the defaults."""
    return LLM(model, kv_transfer_config={"kv_connector": "TcpConnector", "kv_role": "kv_producer", "kv_port": port,
                                          "engine_id": "P0", "kv_auth_token": "secret", **kv},
               **{**ENGINE, **(llm or {})})


def consumer(model, llm: Optional[dict] = None, **kv):
    return LLM(model, kv_transfer_config={"kv_connector": "TcpConnector", "kv_role": "kv_consumer",
                                          "kv_auth_token": "secret", "kv_transfer_timeout": 1.0, **kv},
               **{**ENGINE, **(llm or {})})


def drain(llm, deadline=20.0) -> dict:
    done, t0 = {}, time.monotonic()
    while llm.engine.has_unfinished_requests():
        assert time.monotonic() - t0 < deadline, "engine did not finish"
        for o in llm.engine.step():
            if o.finished:
                done[o.request_id] = o
    return done


def prefill_on(p, prompts) -> list[dict]:
    sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        p.engine.add_request(prompt, sp, request_id=f"p{i}", kv_transfer_params={"do_remote_decode": True})
    fin = {}
    while p.engine.scheduler.has_unfinished():
        fin.update({o.request_id: o for o in p.engine.step() if o.finished})
    return [fin[f"p{i}"].kv_transfer_params for i in range(len(prompts))]  # signed by P, relayed as they are


def decode_on(d, prompts, params, max_tokens=16) -> dict:
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i, (prompt, kp) in enumerate(zip(prompts, params)):
        d.engine.add_request(prompt, sp, request_id=f"d{i}", kv_transfer_params=kp)
    return {int(k[1:]): v for k, v in drain(d).items()}


def params_for_peer(d, prompt, port) -> dict:
    """Signed remote-prefill params that send D to a local peer of the test's making."""
    from pdserve.transfer.channel.proof import prompt_hash
    ids = d.get_tokenizer()(prompt).input_ids
    return sign_params({"do_remote_prefill": True, "transfer_id": "t", "remote_engine_id": "p",
                        "remote_host": "127.0.0.1", "remote_port": port, "num_prompt_tokens": len(ids),
                        "prompt_hash": prompt_hash(ids), "lease_seconds": 30.0}, "secret")


def expire_leases(p):
    for lease in p.engine.connector.leases.values():
        lease.expiry = 0.0


def assert_whole(*llms):
    for llm in llms:
        e = llm.engine
        e.check_invariants()
        assert e.kv.num_free_blocks() == e.num_blocks - 1, "blocks leaked"
        assert not e.scheduler.transfers.leased and not e.scheduler.transfers.deferred_free
        assert e.scheduler.transfers.orphaned_blocks() == 0  # the reclamation gauge at rest


@pytest.fixture(scope="module")
def collocated(qwen3_tiny):
    llm = LLM(qwen3_tiny, **ENGINE)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture()
def pd(qwen3_tiny):
    p, d = producer(qwen3_tiny, free_port()), consumer(qwen3_tiny)
    yield p, d
    p.engine.shutdown()
    d.engine.shutdown()


def test_pd_equals_collocated_and_rides_full(pd, collocated):
    p, d = pd
    params = prefill_on(p, PROMPTS)
    assert p.engine.scheduler.transfers.num_leased_blocks() > 0
    assert params[4] is None  # "x": one token, nothing to hand over; D prefills it itself
    assert all(kp["do_remote_prefill"] and kp["remote_port"] == p.engine.connector.port
               for kp in params[:4] + params[5:])
    out = decode_on(d, PROMPTS, params)
    assert [out[i].outputs[0].token_ids for i in range(len(PROMPTS))] == collocated
    assert d.engine.connector.stats.bytes_received > 0 and not d.engine.connector.stats.failures
    stats = d.engine.graph_stats()
    # Replays ride FULL under decode-shaped; the one prefill step is the one-token prompt "x", which has no
    # KV to import and is prefilled on D (its fresh row blocks FULL under every rule).
    assert stats["non_full_by_reason"] == {"prefill": 1}, stats
    drain(p)  # P releases the leases D confirmed
    assert_whole(p, d)


def test_staged_path_equals_collocated(pd, collocated):
    """The path for caches off the CPU (gather into host memory on P, scatter from it on D), run on CPU tensors."""
    p, d = pd
    p.engine.connector._flat = d.engine.connector._flat = None
    params = prefill_on(p, PROMPTS[:4])
    out = decode_on(d, PROMPTS[:4], params)
    assert [out[i].outputs[0].token_ids for i in range(4)] == collocated[:4]
    assert d.engine.connector.stats.bytes_received > 0 and not d.engine.connector.stats.failures
    drain(p)
    assert_whole(p, d)


def test_producer_gone_before_pull_recomputes(pd, collocated):
    p, d = pd
    params = prefill_on(p, PROMPTS[:3])
    p.engine.connector.shutdown()  # the KV server stops listening
    out = decode_on(d, PROMPTS[:3], params)
    assert [out[i].outputs[0].token_ids for i in range(3)] == collocated[:3]
    assert d.engine.connector.stats.failures
    expire_leases(p)
    drain(p)
    assert_whole(p, d)


def test_transfer_timeout_recomputes(qwen3_tiny, collocated):
    """A peer that accepts and never answers: the load times out (1 s) and D prefills locally."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)
    held = []
    threading.Thread(target=lambda: held.append(srv.accept()), daemon=True).start()
    d = consumer(qwen3_tiny)
    fake = params_for_peer(d, PROMPTS[2], srv.getsockname()[1])
    t0 = time.monotonic()
    out = decode_on(d, [PROMPTS[2]], [fake])
    assert time.monotonic() - t0 < 5
    assert out[0].outputs[0].token_ids == collocated[2]
    assert d.engine.connector.stats.failures["timeout"] == 1
    assert_whole(d)
    srv.close()
    d.engine.shutdown()


def test_trickling_producer_hits_overall_deadline(qwen3_tiny, collocated):
    """A peer that sends a frame length and then one byte every 0.2 s never trips a socket timeout (each wait gets
    a byte): the overall kv_transfer_timeout (1.5 s) shuts the connection and D prefills locally."""
    srv = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def trickle():
        conn, _ = srv.accept()
        try:
            conn.sendall((1000).to_bytes(8, "big"))
            while not stop.wait(0.2):
                conn.sendall(b" ")
        except OSError:
            pass
        conn.close()

    threading.Thread(target=trickle, daemon=True).start()
    d = consumer(qwen3_tiny, kv_transfer_timeout=1.5)
    fake = params_for_peer(d, PROMPTS[2], srv.getsockname()[1])
    t0 = time.monotonic()
    out = decode_on(d, [PROMPTS[2]], [fake])
    # the trickle never ends on its own: without the deadline this waits for the test's timeout. The bound leaves
    # room for a loaded 2-core machine (4.1 s seen with a suite and two servers beside it)
    assert time.monotonic() - t0 < 8.0
    assert out[0].outputs[0].token_ids == collocated[2]
    assert d.engine.connector.stats.failures == {"timeout": 1}
    assert_whole(d)
    stop.set()
    srv.close()
    d.engine.shutdown()


def step_both(p, d, deadline=30.0, each=None) -> dict:
    """Steps P (it serves renewals, and frees leases in its own steps) and D until D is idle: D's finished outputs.
    `each(seconds so far, outputs so far)` runs before every D step."""
    done, t0 = {}, time.monotonic()
    while d.engine.has_unfinished_requests():
        assert time.monotonic() - t0 < deadline, "D did not finish"
        p.engine.step()
        if each is not None:
            each(time.monotonic() - t0, done)
        done.update({o.request_id: o for o in d.engine.step() if o.finished})
    return done


def assert_pulled(p, d, out, want) -> None:
    """`out` has the collocated tokens from KV D pulled (not prefilled), no lease expired, both pools whole."""
    assert out.outputs[0].token_ids == want
    assert d.engine.connector.stats.bytes_received > 0
    drain(p, deadline=5)
    assert p.engine.connector.stats.failures["lease_expired"] == 0
    assert_whole(p, d)


def short_of_blocks(d, monkeypatch, until):
    """D's pool refuses every allocation while `until()` holds (a momentary shortage)."""
    kv = d.engine.scheduler.kv
    real = kv.allocate_slots
    monkeypatch.setattr(kv, "allocate_slots", lambda *a: not until() and real(*a))


@pytest.mark.parametrize("why", ["lease_ran_out", "hash_mismatch"])
def test_local_fallback_releases_producer_lease_at_once(pd, collocated, why, monkeypatch):
    """D does not load P's KV (blocks short until the lease it was told of ran out, or params for another prompt,
    refused): P still hears `done` and frees the lease at once, not at expiry (30 s); a bare `done` is no failed
    load."""
    p, d = pd
    params = prefill_on(p, PROMPTS[2:3])
    if why == "hash_mismatch":  # refused at admission (the server's 400); the engine loop then releases the lease
        params[0] = sign_params({**params[0], "prompt_hash": "0" * 64}, "secret")
        with pytest.raises(ValueError, match="another prompt"):
            decode_on(d, PROMPTS[2:3], params)
        assert d.engine.gateway.release_remote_kv("d0", params[0])
        drain(d, deadline=5)
    else:
        params[0] = sign_params({**params[0], "lease_seconds": 0.2}, "secret")  # P's own lease is 30 s...
        monkeypatch.setattr(p.engine.connector, "_renew", lambda tid: 0.0)  # ...but it will not renew it
        t_end = time.monotonic() + 0.5
        short_of_blocks(d, monkeypatch, lambda: time.monotonic() < t_end)
        out = decode_on(d, PROMPTS[2:3], params)
        assert out[0].outputs[0].token_ids == collocated[2]
    assert d.engine.connector.stats.bytes_received == 0
    assert d.engine.connector.stats.failures == {}
    drain(p, deadline=5)
    assert p.engine.connector.stats.failures["lease_expired"] == 0
    assert_whole(p, d)


def test_momentary_shortage_waits_for_remote_kv(pd, collocated, monkeypatch):
    """No blocks for the load on D's first tries: the request waits and loads P's KV once blocks free up, instead of
    giving the lease up and prefilling off the FULL graph."""
    p, d = pd
    params = prefill_on(p, PROMPTS[1:4])
    tries = []
    short_of_blocks(d, monkeypatch, lambda: len(tries) < 5 and not tries.append(1))
    out = decode_on(d, PROMPTS[1:4], params)
    assert [out[i].outputs[0].token_ids for i in range(3)] == collocated[1:4]
    assert d.engine.connector.stats.bytes_received > 0 and not d.engine.connector.stats.failures
    assert d.engine.graph_stats()["non_full_by_reason"] == {}  # no local prefill
    drain(p, deadline=5)
    assert_whole(p, d)


def test_waiting_consumer_renews_the_lease(qwen3_tiny, collocated, monkeypatch):
    """P leases for 0.6 s; D is short of blocks for 1.5 s. D renews the lease while it waits, then loads it."""
    p, d = producer(qwen3_tiny, free_port(), kv_lease_seconds=0.6), consumer(qwen3_tiny)
    try:
        params = prefill_on(p, PROMPTS[3:4])
        assert params[0]["lease_seconds"] == 0.6
        t_end = time.monotonic() + 1.5
        short_of_blocks(d, monkeypatch, lambda: time.monotonic() < t_end)
        sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        d.engine.add_request(PROMPTS[3], sp, request_id="d0", kv_transfer_params=params[0])
        assert_pulled(p, d, step_both(p, d)["d0"], collocated[3])
    finally:
        p.engine.shutdown()
        d.engine.shutdown()


def test_abort_while_short_of_blocks_releases_lease(pd, monkeypatch):
    p, d = pd
    params = prefill_on(p, PROMPTS[3:4])
    short_of_blocks(d, monkeypatch, lambda: True)
    d.engine.add_request(PROMPTS[3], SamplingParams(max_tokens=8), request_id="gone", kv_transfer_params=params[0])
    for _ in range(3):
        d.engine.step()
    assert d.engine.abort_request("gone").outputs[0].finish_reason == "abort"
    drain(d)
    drain(p, deadline=5)
    assert p.engine.connector.stats.failures["lease_expired"] == 0
    assert_whole(p, d)


def test_consumer_hands_nothing_on(pd):
    """`do_remote_decode` reaching a consumer-only engine (it has no KV server): the request finishes as usual,
    with no lease and no params (it used to crash the engine loop on the missing port)."""
    p, d = pd
    req = d.engine.add_request(PROMPTS[1], SamplingParams(temperature=0, max_tokens=2), request_id="r")
    req.kv_transfer_params = {"do_remote_decode": True}  # past add_request's own checks
    out = drain(d)["r"]
    assert out.finished and out.kv_transfer_params is None
    assert_whole(d)


def test_slow_reader_loses_its_connection(qwen3_tiny):
    """A consumer that asks for reads and never takes them: P's send blocks with the lease pinned; after
    kv_lease_seconds (1 s) P shuts the connection, the pin goes and the lease expires as usual."""
    from pdserve.transfer.channel.handshake import client_handshake
    p = producer(qwen3_tiny, free_port(), kv_lease_seconds=1.0)
    params = prefill_on(p, PROMPTS[3:4])
    c = p.engine.connector
    sock = socket.create_connection(("127.0.0.1", c.port))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    session = client_handshake(sock, b"secret", c.compat)
    n = len(params[0]["remote_block_ids"])
    reads = (64 << 20) // (n * c.bytes_per_block) + 1  # far more than the socket buffers hold
    for _ in range(reads):
        session.send({"op": "read", "transfer_id": params[0]["transfer_id"], "start": 0, "count": n})
    t0 = time.monotonic()
    while not c.stats.failures["slow_reader"]:
        assert time.monotonic() - t0 < 5, "P kept serving a reader that does not read"
        time.sleep(0.05)
    assert all(lease.pins == 0 for lease in c.leases.values())
    drain(p, deadline=5)
    assert_whole(p)
    sock.close()
    p.engine.shutdown()


def test_wrong_token_refused_at_handshake(qwen3_tiny, collocated, caplog):
    port = free_port()
    p = producer(qwen3_tiny, port)
    d = consumer(qwen3_tiny, kv_auth_token="not-the-secret")
    # the router and D share a token that P does not have: D accepts the params, P's handshake refuses D
    params = [sign_params(kp, "not-the-secret") for kp in prefill_on(p, PROMPTS[:2])]
    with caplog.at_level("WARNING", logger="pdserve.transfer"):
        out = decode_on(d, PROMPTS[:2], params)
    assert [out[i].outputs[0].token_ids for i in range(2)] == collocated[:2]
    assert "authentication" in caplog.text
    expire_leases(p)  # D never read them
    drain(p)
    assert_whole(p, d)
    p.engine.shutdown()
    d.engine.shutdown()


def test_incompatible_model_refused_naming_field(qwen3_tiny, collocated, caplog):
    port = free_port()
    p = producer(qwen3_tiny, port)
    d = LLM(qwen3_tiny, kv_transfer_config={"kv_connector": "TcpConnector", "kv_role": "kv_consumer",
                                            "kv_auth_token": "secret", "kv_transfer_timeout": 1.0},
            block_size=32, **ENGINE)
    params = prefill_on(p, PROMPTS[:1])
    with caplog.at_level("WARNING", logger="pdserve.transfer"):
        out = decode_on(d, PROMPTS[:1], params)
    assert out[0].outputs[0].token_ids == collocated[0]
    assert "block_size differs" in caplog.text
    p.engine.shutdown()
    d.engine.shutdown()


def test_unsigned_or_tampered_params_rejected(pd):
    p, d = pd
    params = prefill_on(p, PROMPTS[2:3])
    sp = SamplingParams(max_tokens=2)
    unsigned = {k: v for k, v in params[0].items() if k != "kv_proof"}
    with pytest.raises(ValueError, match="proof does not verify"):
        d.engine.add_request(PROMPTS[2], sp, kv_transfer_params=unsigned)
    with pytest.raises(ValueError, match="proof does not verify"):  # pointed elsewhere after signing
        d.engine.add_request(PROMPTS[2], sp, kv_transfer_params={**params[0], "remote_port": 1})
    expire_leases(p)
    drain(p)
    assert_whole(p, d)


def test_params_for_another_prompt_refused(pd):
    """P's own params sent with another prompt, or re-signed with a forged hash, are refused before any read."""
    p, d = pd
    params = prefill_on(p, PROMPTS[2:3])
    sp = SamplingParams(max_tokens=2)
    for kp in (params[0], sign_params({**params[0], "prompt_hash": "0" * 64}, "secret")):
        prompt = PROMPTS[3] if kp is params[0] else PROMPTS[2]
        with pytest.raises(ValueError, match="another prompt"):
            d.engine.add_request(prompt, sp, kv_transfer_params=kp)
    assert d.engine.connector.stats.bytes_received == 0
    expire_leases(p)
    drain(p)
    assert_whole(p, d)


def flipping_proxy(port: int, at: int) -> socket.socket:
    """A loopback relay to `port` that flips one bit of the byte at offset `at` of the P -> D stream."""
    srv = socket.create_server(("127.0.0.1", 0))

    def pump(src, dst, flip):
        seen = 0
        try:
            while data := src.recv(1 << 16):
                if flip and seen <= at < seen + len(data):
                    data = bytearray(data)
                    data[at - seen] ^= 1
                seen += len(data)
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            s.close()

    def run():
        down, _ = srv.accept()
        up = socket.create_connection(("127.0.0.1", port))
        threading.Thread(target=pump, args=(down, up, False), daemon=True).start()
        pump(up, down, True)

    threading.Thread(target=run, daemon=True).start()
    return srv


def test_frame_failing_authentication_recomputes(pd, collocated, caplog):
    """A bit flipped on the wire inside the KV payload: the frame fails authentication, the blocks it was received
    into are dropped unpublished, and D prefills the prompt itself."""
    p, d = pd
    params = prefill_on(p, PROMPTS[3:4])
    assert len(params[0]["remote_block_ids"]) * p.engine.connector.bytes_per_block > 20000
    proxy = flipping_proxy(p.engine.connector.port, at=12000)  # past the handshake, inside the first payload
    params = [sign_params({**params[0], "remote_port": proxy.getsockname()[1]}, "secret")]
    with caplog.at_level("WARNING", logger="pdserve.transfer"):
        out = decode_on(d, PROMPTS[3:4], params)
    assert out[0].outputs[0].token_ids == collocated[3]
    assert "frame failed authentication" in caplog.text and d.engine.connector.stats.failures["ProtocolError"] == 1
    proxy.close()
    expire_leases(p)
    drain(p)
    assert_whole(p, d)


def test_a_failed_load_releases_the_producer_lease_at_once(pd, collocated, monkeypatch):
    """A load that fails with P still there (here every read answers a protocol error): D prefills the prompt
    itself and sends P a bare `done` on a fresh session, so P frees the blocks now rather than at the lease's end
    (30 s)."""
    from pdserve.transfer.channel.protocol import ProtocolError
    from pdserve.transfer.tcp.consumer import TcpConsumer
    real = TcpConsumer._transfer

    def failing(self, session, job):
        if job.dst_blocks:
            raise ProtocolError("producer answered 'error' (injected)")
        return real(self, session, job)
    monkeypatch.setattr(TcpConsumer, "_transfer", failing)
    p, d = pd
    params = prefill_on(p, PROMPTS[:2])
    assert len(p.engine.scheduler.transfers.leased) == 2
    out = decode_on(d, PROMPTS[:2], params)
    assert [out[i].outputs[0].token_ids for i in range(2)] == collocated[:2]
    assert d.engine.connector.stats.failures["ProtocolError"] == 2
    deadline = time.monotonic() + 5  # well inside the 30 s lease
    while p.engine.scheduler.transfers.leased:
        assert time.monotonic() < deadline, "P kept the leases of the failed loads"
        p.engine.step()
        time.sleep(0.01)
    assert_whole(p, d)


def test_a_hung_producer_holds_up_only_its_own_loads(qwen3_tiny, collocated):
    """Eight loads from a P that accepts and never answers (kv_transfer_timeout 2 s each), queued before one from a
    healthy P: the healthy one is pulled, not timed out in the queue (a load's deadline counts its wait for a worker:
    with four shared workers it waited two timeouts), and the hung ones fail and are recomputed here."""
    p, d = producer(qwen3_tiny, free_port()), consumer(qwen3_tiny, kv_transfer_timeout=2.0)
    hung = socket.create_server(("127.0.0.1", 0))  # connections complete in the kernel; nothing ever answers
    try:
        prompts = [PROMPTS[i % 2] for i in range(8)] + [PROMPTS[2]]
        params = [params_for_peer(d, pr, hung.getsockname()[1]) for pr in prompts[:8]] + prefill_on(p, PROMPTS[2:3])
        params = [sign_params({**kp, "transfer_id": f"t{i}"}, "secret") if i < 8 else kp
                  for i, kp in enumerate(params)]
        out = decode_on(d, prompts, params)
        want = [collocated[i % 2] for i in range(8)] + collocated[2:3]
        assert [out[i].outputs[0].token_ids for i in range(9)] == want
        failures = d.engine.connector.stats.failures
        assert sum(failures.values()) == 8, failures  # the hung P's, and only those
        assert d.engine.connector.stats.bytes_received > 0
        deadline = time.monotonic() + 5
        while p.engine.scheduler.transfers.leased:
            assert time.monotonic() < deadline
            p.engine.step()
        assert_whole(p, d)
    finally:
        hung.close()
        p.engine.shutdown()
        d.engine.shutdown()


def test_lease_expires_when_decode_never_comes(qwen3_tiny):
    p = producer(qwen3_tiny, free_port(), kv_lease_seconds=0.3)
    prefill_on(p, PROMPTS[:3])
    assert p.engine.scheduler.transfers.num_leased_blocks() > 0
    t0 = time.monotonic()
    drain(p, deadline=5)
    assert time.monotonic() - t0 >= 0.2
    assert p.engine.connector.stats.failures["lease_expired"] == 3
    assert_whole(p)
    p.engine.shutdown()


def test_abort_while_waiting_for_kv(pd):
    p, d = pd
    params = prefill_on(p, PROMPTS[3:4])
    d.engine.add_request(PROMPTS[3], SamplingParams(max_tokens=8), request_id="gone", kv_transfer_params=params[0])
    d.engine.step()  # allocates blocks, starts the load
    out = d.engine.abort_request("gone")
    assert out.finished and out.outputs[0].finish_reason == "abort"
    drain(d)
    drain(p)
    assert_whole(p, d)


def test_kv_params_without_connector_rejected(qwen3_tiny):
    llm = LLM(qwen3_tiny, **ENGINE)
    with pytest.raises(ValueError, match="no KV connector"):
        llm.engine.add_request("x", SamplingParams(max_tokens=2), kv_transfer_params={"do_remote_prefill": True})


def test_config_errors_name_the_field(qwen3_tiny):
    with pytest.raises(ValueError, match="kv_connector 'Nope' is unknown"):
        LLM(qwen3_tiny, kv_transfer_config={"kv_connector": "Nope", "kv_role": "kv_consumer"}, **ENGINE)
    with pytest.raises(ValueError, match="kv_role"):
        LLM(qwen3_tiny, kv_transfer_config={"kv_connector": "TcpConnector", "kv_role": "boss"}, **ENGINE)
    with pytest.raises(ValueError, match="missing field 'kv_role'"):
        LLM(qwen3_tiny, kv_transfer_config={"kv_connector": "TcpConnector"}, **ENGINE)
    with pytest.raises(ValueError, match="without kv_auth_token"):
        LLM(qwen3_tiny, kv_transfer_config={"kv_connector": "TcpConnector", "kv_role": "kv_producer",
                                            "kv_host": "0.0.0.0"}, **ENGINE)
    from pdserve.kv_transfer_config import KVTransferConfig
    base = {"kv_connector": "TcpConnector", "kv_role": "kv_consumer"}
    for bad in (-0.001, 1000.5, True, "2"):
        with pytest.raises(ValueError, match="kv_load_wait_ms must be a number of milliseconds"):
            KVTransferConfig.from_dict({**base, "kv_load_wait_ms": bad})
    assert KVTransferConfig.from_dict({**base, "kv_load_wait_ms": 0}).kv_load_wait_ms == 0


# ---- TLS -----------------------------------------------------------------------------------------------------
def self_signed(directory, name: str) -> tuple[str, str]:
    """A self-signed cert (its own CA) for 127.0.0.1/localhost and its key, as PEM files."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = directory / f"{name}.crt", directory / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(cert_path), str(key_path)


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    d = tmp_path_factory.mktemp("tls")
    return self_signed(d, "p"), self_signed(d, "other")


@pytest.fixture()
def tls_p(qwen3_tiny, certs):
    (cert, key), _ = certs
    p = producer(qwen3_tiny, free_port(), kv_tls_cert=cert, kv_tls_key=key)
    yield p
    p.engine.shutdown()


def test_pd_over_tls_equals_collocated(tls_p, certs, qwen3_tiny, collocated):
    p, d = tls_p, consumer(qwen3_tiny, kv_tls_ca=certs[0][0])
    params = prefill_on(p, PROMPTS)
    out = decode_on(d, PROMPTS, params)
    assert [out[i].outputs[0].token_ids for i in range(len(PROMPTS))] == collocated
    assert d.engine.connector.stats.bytes_received > 0 and not d.engine.connector.stats.failures
    drain(p)
    assert_whole(p, d)
    d.engine.shutdown()


@pytest.mark.parametrize("d_tls", ["none", "wrong_ca"])
def test_tls_mismatch_fails_cleanly_and_recomputes(tls_p, certs, qwen3_tiny, collocated, caplog, d_tls, monkeypatch):
    """D without TLS, or trusting another CA, against a TLS P: refused at once, D prefills locally. The refusal is
    held (tcp_pool.REFUSED_HOLD): the requests' later loads, renewals and `done`s fail without dialing again
    (before: three handshakes per request, each with its log line)."""
    import ssl

    from pdserve.transfer.channel import pool as tcp_pool
    from pdserve.transfer.channel.protocol import ProtocolError
    p = tls_p
    d = consumer(qwen3_tiny, **({"kv_tls_ca": certs[1][0]} if d_tls == "wrong_ca" else {}))
    params = prefill_on(p, PROMPTS[:4])
    monkeypatch.setattr(tcp_pool, "REFUSED_HOLD", 60.0)  # the run below may take longer than the real hold
    dials, dial = [], tcp_pool.dial
    monkeypatch.setattr(tcp_pool, "dial", lambda *a, **kw: dials.append(a[:2]) or dial(*a, **kw))
    t0 = time.monotonic()
    with caplog.at_level("WARNING", logger="pdserve.transfer"):
        out = decode_on(d, PROMPTS[:4], params)
    assert time.monotonic() - t0 < 5
    assert [out[i].outputs[0].token_ids for i in range(4)] == collocated[:4]
    assert d.engine.connector.stats.bytes_received == 0 and sum(d.engine.connector.stats.failures.values()) == 4
    assert ("require TLS" if d_tls == "none" else "CERTIFICATE_VERIFY_FAILED") in caplog.text
    assert 1 <= len(dials) <= 4, dials  # 4 loads (at once, on 4 workers), then 4 dones held
    n = len(dials)
    with pytest.raises(ProtocolError if d_tls == "none" else ssl.SSLError, match="not redialed"):
        d.engine.connector.check_remote(params[0])
    monkeypatch.setattr(tcp_pool, "REFUSED_HOLD", 0.0)  # the hold is over: P may be fixed by now
    with pytest.raises(ProtocolError if d_tls == "none" else ssl.SSLError):
        d.engine.connector.check_remote(params[0])
    assert len(dials) == n + 1
    expire_leases(p)
    drain(p)
    assert_whole(p, d)
    d.engine.shutdown()


def test_tls_config_errors_name_the_field(qwen3_tiny, certs, tmp_path):
    (cert, key), _ = certs
    kv = {"kv_connector": "TcpConnector", "kv_role": "kv_producer", "kv_port": free_port()}
    cases = [({"kv_tls_cert": cert}, "kv_tls_key is required with kv_tls_cert"),
             ({"kv_tls_key": key}, "kv_tls_cert is required with kv_tls_key"),
             ({"kv_tls_cert": cert, "kv_tls_key": str(tmp_path / "nope.key")}, "kv_tls_key: no such file"),
             ({"kv_tls_ca": str(tmp_path / "nope.crt"), "kv_role": "kv_consumer"}, "kv_tls_ca: no such file"),
             ({"kv_tls_cert": key, "kv_tls_key": key}, "kv_tls_cert/kv_tls_key: cannot load")]
    for extra, msg in cases:
        with pytest.raises(ValueError, match=msg):
            LLM(qwen3_tiny, kv_transfer_config={**kv, **extra}, **ENGINE)


def test_kv_cli_flags_fold_into_kv_transfer_config(qwen3_tiny):
    import argparse

    from pdserve.cli import _kv_transfer_config
    from pdserve.config import EngineConfig
    base = json.dumps({"kv_connector": "TcpConnector", "kv_role": "kv_producer", "kv_auth_token": "a"})
    ns = argparse.Namespace(kv_transfer_config=base, kv_auth_token="b", kv_tls_cert=None, kv_tls_key=None,
                            kv_tls_ca=None)
    assert _kv_transfer_config(ns)["kv_auth_token"] == "b"  # the flag wins over the JSON
    with pytest.raises(ValueError, match="--kv-tls-cert only apply with --kv-transfer-config"):
        _kv_transfer_config(argparse.Namespace(kv_transfer_config=None, kv_auth_token=None, kv_tls_cert="/c",
                                               kv_tls_key=None, kv_tls_ca=None))
    ns.kv_tls_cert, ns.kv_tls_key = "/nonexistent.pem", "/nonexistent.key"
    with pytest.raises(ValueError, match="kv_tls_cert"):
        EngineConfig.from_kwargs(qwen3_tiny, kv_transfer_config=_kv_transfer_config(ns))


def test_imports_filling_the_pool_make_progress(qwen3_tiny):
    """D's pool (8 usable blocks of 16) fits exactly four 32-token imports; each replay of a 33-token prompt then
    needs a third block. Loads used to take all 8 and wait for a block forever; now every request finishes."""
    prompts = [[7 + 11 * i + j for j in range(33)] for i in range(4)]
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    small = dict(max_model_len=128, num_gpu_blocks_override=9)
    ref = [o.outputs[0].token_ids for o in LLM(qwen3_tiny, **small).generate(prompts, sp, use_tqdm=False)]
    p = producer(qwen3_tiny, free_port())
    d = LLM(qwen3_tiny, kv_transfer_config={"kv_connector": "TcpConnector", "kv_role": "kv_consumer",
                                            "kv_auth_token": "secret"}, **small)
    try:
        params = prefill_on(p, prompts)
        for i, (prompt, kp) in enumerate(zip(prompts, params)):
            d.engine.add_request(prompt, sp, request_id=f"d{i}", kv_transfer_params=kp)
        done, steps = {}, 0
        while d.engine.has_unfinished_requests():
            steps += 1
            assert steps < 2000, f"no progress: {d.engine.scheduler.waiting}"
            done.update({o.request_id: o for o in d.engine.step() if o.finished})
        assert [done[f"d{i}"].outputs[0].token_ids for i in range(4)] == ref
        assert d.engine.connector.stats.bytes_received > 0
        drain(p, deadline=5)
        assert_whole(p, d)
    finally:
        p.engine.shutdown()
        d.engine.shutdown()


def test_lease_renewed_for_requests_queued_behind_others(qwen3_tiny, collocated):
    """D has one seat, busy for ~1.5 s; an import queued behind it (P leases for 0.6 s) keeps its lease alive by
    renewals while it queues, and is then pulled, not prefilled."""
    p = producer(qwen3_tiny, free_port(), kv_lease_seconds=0.6)
    d = LLM(qwen3_tiny, kv_transfer_config={"kv_connector": "TcpConnector", "kv_role": "kv_consumer",
                                            "kv_auth_token": "secret"}, max_num_seqs=1, **ENGINE)
    try:
        params = prefill_on(p, PROMPTS[3:4])
        d.engine.add_request("import os\n", SamplingParams(temperature=0, max_tokens=400, ignore_eos=True),
                             request_id="busy")
        d.engine.step()
        d.engine.add_request(PROMPTS[3], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                             request_id="d0", kv_transfer_params=params[0])
        def free_the_seat(elapsed, done):
            if elapsed > 1.5 and "busy" not in done:
                d.engine.abort_request("busy")

        assert_pulled(p, d, step_both(p, d, each=free_the_seat)["d0"], collocated[3])
    finally:
        p.engine.shutdown()
        d.engine.shutdown()


def test_tcp_consumer_leaves_params_another_connector_made(qwen3_tiny):
    """Params that name NixlConnector are not the tcp consumer's, whatever a MultiConnector's child order: it
    neither loads them, nor keeps their lease alive, nor dials their peer to release it."""
    from pdserve.request import Request
    from pdserve.transfer.channel.proof import prompt_hash
    d = consumer(qwen3_tiny)
    try:
        ids = d.get_tokenizer()("def f(x):\n    return x\n" * 4).input_ids
        params = {"do_remote_prefill": True, "transfer_id": "t", "remote_engine_id": "p", "kv_connector":
                  "NixlConnector", "remote_host": "127.0.0.1", "remote_port": 9, "num_prompt_tokens": len(ids),
                  "prompt_hash": prompt_hash(ids),
                  "lease_seconds": 30.0}
        conn = d.engine.connector
        for name, want in (("NixlConnector", 0), ("TcpConnector", len(ids) - 1)):
            req = Request("r", ids, SamplingParams(max_tokens=1), kv_transfer_params={**params, "kv_connector": name})
            conn.watch_lease(req)
            conn.request_abandoned(req)
            assert conn.get_num_new_matched_tokens(req, 0) == want, name
            if not want:
                assert not conn.consumer._queued and not conn.has_pending()
    finally:
        d.engine.shutdown()


def test_a_stopping_decode_node_still_tells_p_done_for_what_it_aborted(pd):
    """D stops with P/D requests queued (the engine loop's stop aborts them): each abort queues a bare `done`,
    more of them than D's four workers for that P, and shutdown gives them time to reach P (before, those not yet
    started were dropped and P held their blocks until the lease expired)."""
    p, d = pd
    prompts = PROMPTS[:4] * 3
    params = prefill_on(p, prompts)
    assert len(p.engine.connector.leases) == len(prompts)
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for i, (prompt, kp) in enumerate(zip(prompts, params)):
        d.engine.add_request(prompt, sp, request_id=f"d{i}", kv_transfer_params=kp)
    for i in range(len(prompts)):
        d.engine.abort_request(f"d{i}")
    d.engine.shutdown()
    end = time.monotonic() + 5
    while p.engine.connector.leases and time.monotonic() < end:
        p.engine.step() if p.engine.has_unfinished_requests() else time.sleep(0.01)
    assert not p.engine.connector.leases
    drain(p)
    assert_whole(p)


@pytest.mark.parametrize("wait_ms", [0, 1000])
def test_a_load_started_before_the_step_joins_it(qwen3_tiny, collocated, wait_ms):
    """kv_load_wait_ms: D starts the queue head's load before it schedules the step and waits for it, so the
    request's replay runs in the very step that started its load (its first token comes out of D's first step);
    with 0 the step never waits, so the token comes a step later. Tokens equal collocated either way."""
    p, d = producer(qwen3_tiny, free_port()), consumer(qwen3_tiny, kv_load_wait_ms=wait_ms)
    try:
        prompts = PROMPTS[1:3]  # 3 and 9 lines: 2 and k blocks of KV to pull
        params = prefill_on(p, prompts)
        sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        for i, (prompt, kp) in enumerate(zip(prompts, params)):
            d.engine.add_request(prompt, sp, request_id=f"d{i}", kv_transfer_params=kp)
        first = {o.request_id: o.outputs[0].token_ids for o in d.engine.step()}
        if wait_ms:
            assert {rid: len(t) for rid, t in first.items()} == {"d0": 1, "d1": 1}, first
        else:
            assert not any(first.values()), first
        done = drain(d)
        assert [done[f"d{i}"].outputs[0].token_ids for i in range(2)] == collocated[1:3]
        drain(p)
        assert_whole(p, d)
    finally:
        p.engine.shutdown()
        d.engine.shutdown()


def test_a_load_waits_for_no_block_a_running_request_needs(qwen3_tiny, monkeypatch):
    """Early loads never take the blocks the running rows need next (they would be preempted for it): with the
    pool short, the load is left to schedule(), which allocates after the running rows."""
    p, d = producer(qwen3_tiny, free_port()), consumer(qwen3_tiny, kv_load_wait_ms=1000)
    try:
        sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        d.engine.add_request("import os\n", sp, request_id="running")
        d.engine.step()
        assert d.engine.scheduler.running
        params = prefill_on(p, [PROMPTS[2]])
        d.engine.add_request(PROMPTS[2], sp, request_id="remote", kv_transfer_params=params[0])
        bs, req = d.engine.kv.block_size, d.engine.scheduler.waiting[0]
        need = -(-(req.num_tokens + 1) // bs)  # the prompt's blocks and the replay's slot
        reserve = 2  # the running row's next slot, a block boundary apart
        monkeypatch.setattr(d.engine.kv, "num_free_blocks", lambda: need + reserve - 1)
        assert not d.engine.scheduler.start_loads()
        assert "remote" not in d.engine.scheduler.transfers.loading
        monkeypatch.setattr(d.engine.kv, "num_free_blocks", lambda: need + reserve)
        assert d.engine.scheduler.start_loads() and "remote" in d.engine.scheduler.transfers.loading
        monkeypatch.undo()
        drain(d)
        drain(p)
        assert_whole(p, d)
    finally:
        p.engine.shutdown()
        d.engine.shutdown()


@pytest.mark.parametrize("blocks, extra", [(1, 0), (2, 1), (3, 0)], ids=["1 block", "2 blocks + 1", "3 blocks"])
def test_an_early_load_of_k_blocks_or_k_plus_one_joins_its_step(qwen3_tiny, blocks, extra):
    """Prompts of exactly k blocks (the replay's slot then needs block k + 1) and of k blocks + 1 token: the early
    load allocates the replay's slot with the prompt's blocks, the request runs in D's first step, its tokens equal a
    collocated engine's, and both pools are whole."""
    p, d = producer(qwen3_tiny, free_port()), consumer(qwen3_tiny, kv_load_wait_ms=1000)
    try:
        prompt = [(7 * i) % 900 + 3 for i in range(blocks * d.engine.kv.block_size + extra)]
        params = prefill_on(p, [prompt])
        sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        d.engine.add_request(prompt, sp, request_id="d0", kv_transfer_params=params[0])
        assert [len(o.outputs[0].token_ids) for o in d.engine.step()] == [1]
        got = drain(d)["d0"].outputs[0].token_ids
        want = LLM(qwen3_tiny, **ENGINE).generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0]
        assert got == want.outputs[0].token_ids
        drain(p)
        assert_whole(p, d)
    finally:
        p.engine.shutdown()
        d.engine.shutdown()
