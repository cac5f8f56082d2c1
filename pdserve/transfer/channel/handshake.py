"""The `tcp` KV transport's handshake: both ends prove they hold the KV token, and agree they mean the same KV.

Nothing else is accepted before it completes:
1. D -> P  hello  {role, nonce_d, compat}
2. P -> D  hello  {role, nonce_p, compat, proof_p}, proof_p = HMAC(token, "P" | nonce_d | nonce_p | roles | compat)
3. D -> P  proof  {proof_d}, proof_d = HMAC(token, "D" | ...same...)
4. P -> D  {ok: true}, or {ok: false, error} naming why P refused
Each side checks the other's proof in constant time and compares the compatibility fields itself, refusing with the
name of the first field that differs. Session key = HMAC(token, "session" | nonce_d | nonce_p): the frames after it
are tagged under that key (protocol.py).
"""
from __future__ import annotations

import hmac
import json
import os
import socket
import ssl
from typing import Optional

from pdserve.transfer.channel.protocol import ProtocolError, Session, recv_frame, send_frame


def _canon(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def _transcript(nonce_d: bytes, nonce_p: bytes, compat_d: dict, compat_p: dict) -> bytes:
    return nonce_d + nonce_p + b"kv_consumer|kv_producer" + _canon(compat_d) + _canon(compat_p)


def compat_mismatch(mine: dict, theirs: dict) -> Optional[str]:
    for key in sorted(set(mine) | set(theirs)):
        if mine.get(key) != theirs.get(key):
            return f"incompatible peer: {key} differs (ours {mine.get(key)!r}, theirs {theirs.get(key)!r})"
    return None


def _recv_msg(sock: socket.socket) -> dict:
    """A handshake message. It comes before authentication: anything but a JSON object is a ProtocolError."""
    try:
        msg = json.loads(bytes(recv_frame(sock, 1 << 16)))
    except ValueError as e:
        raise ProtocolError(f"malformed handshake message: {e}") from None
    if not isinstance(msg, dict):
        raise ProtocolError("malformed handshake message: not a JSON object")
    return msg


def _hello(msg: dict) -> tuple[bytes, dict]:
    """(nonce, compat) of a hello. The nonce must be exactly 16 bytes: the transcript joins the two nonces with no
    lengths, so only fixed sizes keep it unambiguous (and a short one would add no freshness)."""
    nonce, compat = msg.get("nonce"), msg.get("compat")
    try:
        nonce = bytes.fromhex(nonce) if isinstance(nonce, str) else b""
    except ValueError:
        nonce = b""
    if len(nonce) != 16 or not isinstance(compat, dict):
        raise ProtocolError("malformed hello: nonce must be 16 bytes in hex and compat an object")
    return nonce, compat


def _proof_ok(msg: dict, token: bytes, label: bytes, transcript: bytes) -> bool:
    proof = msg.get("proof")
    return isinstance(proof, str) and hmac.compare_digest(
        proof.encode(), hmac.new(token, label + transcript, "sha256").hexdigest().encode())


def client_handshake(sock: socket.socket, token: bytes, compat: dict) -> Session:
    nonce_d = os.urandom(16)
    send_frame(sock, _canon({"role": "kv_consumer", "nonce": nonce_d.hex(), "compat": compat}))
    try:
        hello = _recv_msg(sock)
    except ConnectionError:
        if isinstance(sock, ssl.SSLSocket):
            raise
        raise ProtocolError("the producer closed the connection at the handshake (does it require TLS? then set "
                            "kv_tls_ca on this consumer; or was it at its connection cap? its log says)") from None
    if "error" in hello:
        raise ProtocolError(f"refused by producer: {hello['error']}")
    nonce_p, compat_p = _hello(hello)
    transcript = _transcript(nonce_d, nonce_p, compat, compat_p)
    if not _proof_ok(hello, token, b"P", transcript):
        raise ProtocolError("producer failed authentication (wrong KV token?)")
    mismatch = compat_mismatch(compat, compat_p)
    if mismatch:
        raise ProtocolError(mismatch)
    send_frame(sock, _canon({"proof": hmac.new(token, b"D" + transcript, "sha256").hexdigest()}))
    ok = _recv_msg(sock)
    if not ok.get("ok"):
        raise ProtocolError(f"refused by producer: {ok.get('error', 'unknown reason')}")
    return Session(sock, hmac.new(token, b"session" + nonce_d + nonce_p, "sha256").digest(), is_consumer=True)


def server_handshake(sock: socket.socket, token: bytes, compat: dict) -> Session:
    hello = _recv_msg(sock)
    if hello.get("role") != "kv_consumer":
        raise ProtocolError("expected a kv_consumer hello")
    (nonce_d, compat_d), nonce_p = _hello(hello), os.urandom(16)
    transcript = _transcript(nonce_d, nonce_p, compat_d, compat)
    send_frame(sock, _canon({"role": "kv_producer", "nonce": nonce_p.hex(), "compat": compat,
                             "proof": hmac.new(token, b"P" + transcript, "sha256").hexdigest()}))
    if not _proof_ok(_recv_msg(sock), token, b"D", transcript):
        send_frame(sock, _canon({"ok": False, "error": "consumer failed authentication (wrong KV token?)"}))
        raise ProtocolError("consumer failed authentication")
    mismatch = compat_mismatch(compat, compat_d)
    if mismatch:
        send_frame(sock, _canon({"ok": False, "error": mismatch}))
        raise ProtocolError(mismatch)
    send_frame(sock, _canon({"ok": True}))
    return Session(sock, hmac.new(token, b"session" + nonce_d + nonce_p, "sha256").digest(), is_consumer=False)
