"""The tcp KV transport's frames on their own: payloads sent from and received into views, and every frame
authenticated (an altered, replayed or reflected frame fails)."""
from __future__ import annotations

import os
import socket
import threading

import numpy as np
import pytest

from pdserve.transfer.channel.protocol import GROUP, ProtocolError, Session

KEY = os.urandom(32)


def frame_bytes(header: dict, payload=b"", seq: int = 0) -> bytes:
    """What a producer session puts on the wire for its frame number `seq`."""
    a, b = socket.socketpair()
    p = Session(a, KEY, is_consumer=False)
    p.send_seq = seq
    p.send(header, payload)
    a.close()
    return b.makefile("rb").read()


def consumer_reading(*frames: bytes) -> Session:
    a, b = socket.socketpair()
    a.sendall(b"".join(frames))
    a.close()
    return Session(b, KEY, is_consumer=True)


def test_payload_views_round_trip():
    """Views of odd sizes on both ends, larger than a group: the bytes land in the receiver's views in order."""
    src = np.random.default_rng(0).integers(0, 256, 3 * GROUP + 7, dtype=np.uint8)
    m = memoryview(src)
    dst = np.zeros_like(src)
    into = [memoryview(dst)[:100], memoryview(dst)[100:]]
    a, b = socket.socketpair()
    sender = threading.Thread(target=Session(a, KEY, is_consumer=False).send,
                              args=({"status": "ok"}, [m[:5], m[5:GROUP + 1], m[GROUP + 1:]]))
    sender.start()
    header, got = Session(b, KEY, is_consumer=True).recv(into=into)
    sender.join()
    assert header == {"status": "ok"} and got == into and (dst == src).all()


@pytest.mark.parametrize("payload", [bytes(range(256)) * 4, b""], ids=["payload", "control"])
@pytest.mark.parametrize("where", [9, 14, 30, -1])  # header length, header, payload (or tag), tag
def test_altered_frame_fails(where, payload):
    raw = bytearray(frame_bytes({"status": "ok"}, payload))
    raw[where] ^= 1
    with pytest.raises(ProtocolError):
        consumer_reading(bytes(raw)).recv()


def test_groups_cover_the_payload_in_order_with_short_ends():
    """Both ends tag group by group: every byte once, in order, no group over GROUP bytes, the first and the last of
    TAIL bytes."""
    from pdserve.transfer.channel.protocol import TAIL, _groups
    buf = np.arange(5 * GROUP + 12345, dtype=np.uint64).view(np.uint8)
    cuts = [0, 7, GROUP - 3, 2 * GROUP, 4 * GROUP + 1, buf.nbytes - TAIL // 2, buf.nbytes]
    views = [buf[a:b] for a, b in zip(cuts, cuts[1:])]
    groups = list(_groups(views))
    assert np.array_equal(np.concatenate([p for g in groups for p in g]), buf)
    sizes = [sum(p.nbytes for p in g) for g in groups]
    assert sizes[0] == sizes[-1] == TAIL and max(sizes) == GROUP
    assert [sum(p.nbytes for p in g) for g in _groups([buf[:100]])] == [100]


def test_control_and_payload_frames_share_one_counter():
    """A session's frames, with and without payload (tagged in one call or streamed), follow one sequence: read in
    order they verify; the same frames out of order do not."""
    frames = [frame_bytes({"n": 0}, seq=0), frame_bytes({"n": 1}, bytes(3000), seq=1),
              frame_bytes({"n": 2}, seq=2)]
    d = consumer_reading(*frames)
    assert [d.recv(into=[memoryview(bytearray(3000))] if i == 1 else [])[0] for i in range(3)] == \
        [{"n": 0}, {"n": 1}, {"n": 2}]
    d = consumer_reading(frames[0], frames[2])
    assert d.recv()[0] == {"n": 0}
    with pytest.raises(ProtocolError, match="authentication"):
        d.recv()  # frame 2 where frame 1 belongs


LENGTH_TAMPERS = {"bigger": lambda n: n + 1, "much-bigger": lambda n: n + 4096, "smaller": lambda n: n - 1,
                  "no-payload": lambda n: n - 1024, "below-header": lambda n: 10, "zero": lambda n: 0,
                  "max-frame": lambda n: 1 << 31, "huge": lambda n: (1 << 64) - 1}


@pytest.mark.parametrize("into", ["views", "empty", "none"])
@pytest.mark.parametrize("tamper", LENGTH_TAMPERS)
def test_altered_length_prefix_is_refused(tamper, into):
    """The length prefix is outside the tag: a wrong one must still be refused at once, never read past the frame
    (the writer stays open, so that would wait) nor make the reader allocate what it claims."""
    raw = bytearray(frame_bytes({"status": "ok"}, bytes(range(256)) * 4))
    n = int.from_bytes(raw[:8], "big")
    if into == "none" and tamper.endswith("bigger"):
        pytest.skip("without views the reader cannot tell a longer frame from a slow one: it waits for the bytes")
    raw[:8] = LENGTH_TAMPERS[tamper](n).to_bytes(8, "big")
    a, b = socket.socketpair()
    a.sendall(bytes(raw))
    b.settimeout(2)  # a read past the frame times out instead of hanging the test
    views = {"views": [memoryview(bytearray(1024))], "empty": [], "none": None}[into]
    with pytest.raises(ProtocolError):
        Session(b, KEY, is_consumer=True).recv(into=views)
    a.close()
    b.close()


def test_replayed_or_reflected_frame_fails():
    f0 = frame_bytes({"n": 0}, b"kv")
    d = consumer_reading(f0, f0)
    assert d.recv()[0] == {"n": 0}
    with pytest.raises(ProtocolError, match="authentication"):
        d.recv()  # the same frame again: sequence number 1 expected
    a, b = socket.socketpair()
    Session(a, KEY, is_consumer=True).send({"n": 0})  # a consumer's own frame sent back to it
    with pytest.raises(ProtocolError, match="authentication"):
        Session(b, KEY, is_consumer=True).recv()


def test_payload_of_the_wrong_size_is_refused_before_reading():
    with pytest.raises(ProtocolError, match="payload of 8 bytes, expected 4"):
        consumer_reading(frame_bytes({}, b"12345678")).recv(into=[memoryview(bytearray(4))])
    header, got = consumer_reading(frame_bytes({"status": "expired"})).recv(into=[memoryview(bytearray(4))])
    assert header == {"status": "expired"} and got == []  # an answer without payload is always fine


@pytest.fixture()
def kv_server():
    """A producer's KV server alone (no engine, no KV cache): only handshakes and reads of unknown leases."""
    from pdserve.kv_transfer_config import KVTransferConfig
    from pdserve.transfer.base import ConnectorContext
    from pdserve.transfer.tcp.connector import TcpConnector
    cfg = KVTransferConfig.from_dict({"kv_connector": "TcpConnector", "kv_role": "kv_producer", "kv_port": 0,
                                      "kv_auth_token": "secret", "kv_transfer_timeout": 1.0})
    c = TcpConnector(cfg, ConnectorContext(16, {"model": "m"}))
    yield c
    c.shutdown()


@pytest.mark.parametrize("hello", [b"not json", b"[1]", b'{"role": "kv_consumer", "nonce": 5, "compat": {}}',
                                   b'{"role": "kv_consumer", "nonce": "0011", "compat": {}}',
                                   b'{"role": "kv_consumer", "nonce": "' + b"zz" * 16 + b'", "compat": {}}',
                                   b'{"role": "kv_consumer", "nonce": "' + b"00" * 16 + b'", "compat": "x"}',
                                   None])  # None: says nothing at all
def test_malformed_hello_refused_and_server_lives_on(kv_server, hello, monkeypatch, caplog):
    from pdserve.transfer.channel.handshake import client_handshake
    from pdserve.transfer.channel.protocol import send_frame
    crashed = []
    monkeypatch.setattr(threading, "excepthook", crashed.append)
    bad = socket.create_connection(("127.0.0.1", kv_server.port))
    bad.settimeout(3)  # the handshake has kv_transfer_timeout (1 s) in all
    with caplog.at_level("WARNING", logger="pdserve.transfer"):
        if hello is not None:
            send_frame(bad, hello)
        assert bad.recv(100) == b""  # closed, nothing answered
    bad.close()
    if hello is not None:
        assert "malformed" in caplog.text or "expected a kv_consumer hello" in caplog.text
    good = socket.create_connection(("127.0.0.1", kv_server.port))
    session = client_handshake(good, b"secret", {"model": "m"})
    session.send({"op": "read", "transfer_id": "unknown", "start": 0, "count": 1})
    assert session.recv(into=[])[0] == {"status": "expired"}
    good.close()
    assert not crashed


HELLO = b'{"role": "kv_consumer", "nonce": "' + b"00" * 16 + b'", "compat": {"model": "m"}}'


@pytest.mark.parametrize("raw", [(0).to_bytes(8, "big") + HELLO, (5).to_bytes(8, "big") + HELLO,
                                 (len(HELLO) + 100).to_bytes(8, "big") + HELLO,  # waits: cut by the deadline
                                 ((1 << 16) + 1).to_bytes(8, "big") + HELLO, ((1 << 64) - 1).to_bytes(8, "big")],
                         ids=["zero", "smaller", "bigger", "over-limit", "huge"])
def test_hello_with_a_wrong_length_prefix_refused(kv_server, raw):
    from pdserve.transfer.channel.handshake import client_handshake
    bad = socket.create_connection(("127.0.0.1", kv_server.port))
    bad.settimeout(3)  # kv_transfer_timeout (1 s) bounds the whole handshake
    bad.sendall(raw)
    try:
        assert bad.recv(100) == b""  # closed, nothing answered
    except ConnectionResetError:
        pass  # closed with some of our bytes unread: the kernel answers with a reset
    bad.close()
    good = socket.create_connection(("127.0.0.1", kv_server.port))
    session = client_handshake(good, b"secret", {"model": "m"})
    session.send({"op": "read", "transfer_id": "unknown", "start": 0, "count": 1})
    assert session.recv(into=[])[0] == {"status": "expired"}
    good.close()


def test_client_refuses_a_short_producer_nonce():
    from pdserve.transfer.channel.handshake import _canon, client_handshake
    from pdserve.transfer.channel.protocol import send_frame
    a, b = socket.socketpair()
    send_frame(b, _canon({"role": "kv_producer", "nonce": "00" * 8, "compat": {}, "proof": "00" * 32}))
    with pytest.raises(ProtocolError, match="nonce must be 16 bytes"):
        client_handshake(a, b"secret", {})
