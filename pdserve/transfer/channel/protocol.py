"""Wire protocol of the `tcp` KV transport: length-prefixed frames and, after the handshake (handshake.py),
authenticated frames. Every frame after the handshake is
    length (8) | header length (4) | JSON header | payload | tag (16)
with the tag an AES-256-GMAC (GCM with no plaintext) over everything between length and tag, under the session key
with the nonce direction | sequence number: a replayed, reordered, cut or altered frame fails, and the tag is also
the checksum of the KV bytes. (GMAC runs at ~22 GB/s here, Poly1305 at ~12 and HMAC-SHA256 at ~1.7: the tag is
read over every byte on both ends, so its speed is a large part of the transport's.)
The tag trails the payload so that both ends stream: the payload moves in groups of up to 512 KiB (the first and
the last short, so each end's tagging overlaps the other end's work all but briefly), each tagged right after it is
sent or received, straight from or into the KV cache (sendmsg/recvmsg_into over views, no copy); the last group is
tagged before it is sent, so the tag leaves with it. The receiver sleeps until a whole group is in (SO_RCVLOWAT),
not at each 64 KiB segment: on loopback every wake-up also costs the sender's core. A frame without payload
(every request, most answers) is tagged in one AES-GCM call and received in one read after its length.

With TLS (kv_tls_cert/kv_tls_key on P, kv_tls_ca on D) the same bytes run inside the TLS stream.
One session carries many operations (tcp_channel.py): the counters run on across them.
"""
from __future__ import annotations

import hmac
import json
import socket
import ssl
import struct
import time
from typing import Optional

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

MAX_FRAME = 1 << 31
TAG = 16  # GMAC
IOV_MAX = 1024  # buffers per sendmsg/recvmsg_into (Linux's limit)
GROUP = 512 << 10  # bytes moved, then tagged, at a time: the two ends overlap at this grain; small enough that
#                  each end's tag reads the bytes its copy has just brought into cache
TAIL = 128 << 10  # the first and last group of a payload: what neither end overlaps with the other's work
UNBUFFERED = 1 << 20  # the most payload a frame may bring without receive buffers (it sizes an allocation)
SOCK_BUF = 4 << 20  # SO_SNDBUF/SO_RCVBUF: a few groups in flight


class ProtocolError(Exception):
    """A peer broke the protocol: bad frame, failed authentication, incompatible model."""


class LeaseGone(ProtocolError):
    """P answered `expired`: it no longer holds the KV the params name (the lease ended, was released or used, or P
    restarted). Nothing failed that the client could cause, so D prefills the request itself whatever its
    kv_load_failure_policy."""


# What a socket wait that ran out raises: kernel-side timeouts (see tune) surface as EAGAIN.
TIMEOUTS = (socket.timeout, BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError)


def tune(sock: socket.socket, timeout: Optional[float] = None) -> None:
    """No Nagle, bigger buffers, and a blocking socket with kernel-side timeouts (SO_RCVTIMEO/SO_SNDTIMEO): each
    wait is one syscall (Python's own timeouts poll before every call), and MSG_WAITALL fills a group in one."""
    if timeout is not None:
        sock.settimeout(None)
        tv = struct.pack("ll", int(timeout), int(timeout % 1 * 1e6))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCK_BUF)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCK_BUF)


def _move(sock: socket.socket, views: list, send: bool) -> None:
    """Send every byte of `views` (1-D byte buffers: memoryviews, uint8 arrays), or fill them, with no copy in
    user space."""
    views = [v for v in views if v.nbytes]
    plain, i = not isinstance(sock, ssl.SSLSocket), 0  # TLS sockets have no sendmsg/recvmsg_into
    while i < len(views):
        if plain:
            n = sock.sendmsg(views[i:i + IOV_MAX]) if send else \
                sock.recvmsg_into(views[i:i + IOV_MAX], 0, socket.MSG_WAITALL)[0]
        else:
            n = sock.send(views[i]) if send else sock.recv_into(views[i])
        if n == 0 and not send:
            raise ConnectionError("peer closed the connection")
        while i < len(views) and n >= views[i].nbytes:
            n -= views[i].nbytes
            i += 1
        if n:
            views[i] = views[i][n:]


def _groups(views: list):
    """`views` in lists of at most GROUP bytes (big views split), the first and the last of at most TAIL bytes: each
    end tags a group right after moving it, so the receiver starts tagging soon, and at the end only the last
    group's tagging, on each end, is left with nothing to overlap."""
    total = sum(v.nbytes for v in views)
    cuts = sorted({min(TAIL, total), max(total - TAIL, 0), total} - {0})  # where a group must end
    pos, group, size, edge = 0, [], 0, 0
    for v in views:
        if v.nbytes < GROUP - size and pos + v.nbytes < cuts[edge] and len(group) < IOV_MAX - 1:
            group.append(v)  # the common case, a block's view inside a group: thousands a frame when scattered
            pos, size = pos + v.nbytes, size + v.nbytes
            continue
        start = 0
        while start < v.nbytes:
            n = min(GROUP - size, cuts[edge] - pos, v.nbytes - start)
            part = v if n == v.nbytes else v[start:start + n]
            group.append(part)
            start, pos, size = start + part.nbytes, pos + part.nbytes, size + part.nbytes
            if pos == cuts[edge] or size >= GROUP or len(group) == IOV_MAX:
                yield group
                group, size = [], 0
                edge += pos == cuts[edge]
    if group:
        yield group


def _recv_exact(sock: socket.socket, n: int) -> memoryview:
    view = memoryview(bytearray(n))
    _move(sock, [view], send=False)
    return view


def _looks_like_tls(head: bytes) -> bool:
    return head[:1] in (b"\x15", b"\x16") and head[1:2] == b"\x03"  # a TLS alert or handshake record


def send_frame(sock: socket.socket, body: bytes) -> None:
    sock.sendall(struct.pack("!Q", len(body)) + body)


def recv_frame(sock: socket.socket, limit: int = MAX_FRAME) -> memoryview:
    head = _recv_exact(sock, 8)
    (n,) = struct.unpack("!Q", head)
    if n > limit:
        if _looks_like_tls(head.tobytes()):
            raise ProtocolError("the peer speaks TLS and this side does not (kv_tls_cert/kv_tls_key on P, "
                                "kv_tls_ca on D)")
        raise ProtocolError(f"frame of {n} bytes exceeds the limit of {limit}")
    return _recv_exact(sock, n)


def _tag(mac) -> bytes:
    mac.finalize()
    return mac.tag


def _byte_views(payload) -> list:
    """1-D byte buffers. 1-D uint8 numpy arrays pass as they are: unlike memoryviews the GC does not track them, and
    thousands of block views a frame would otherwise bring on full collections of the engine's heap."""
    return [p if getattr(p, "ndim", 0) == 1 and p.itemsize == 1 else memoryview(p).cast("B")
            for p in (payload if isinstance(payload, list) else [payload])]


class Session:
    """An authenticated connection after the handshake, for as many frames as its users send (tcp_channel.py pools
    them). Not thread-safe: one user at a time. The tag's nonce is direction | 64-bit frame counter: it never
    repeats under the session's key, and a frame that fails its tag must end the session (the counter has moved on
    only for verified frames, so the next frame's position is unknown)."""

    def __init__(self, sock: socket.socket, key: bytes, is_consumer: bool):
        self.sock = sock
        self.key = key
        self.send_dir, self.recv_dir = (b"D>P", b"P>D") if is_consumer else (b"P>D", b"D>P")
        self.send_seq = self.recv_seq = 0
        self.opened = time.monotonic()
        self._aes, self._aead = algorithms.AES(key), AESGCM(key)  # the same GMAC, streamed or in one call
        # Plain TCP only: TLS reads records ahead of what its caller asked (the kernel's count would mislead), and
        # other families need not treat the mark as a wake-up threshold.
        tcp = not isinstance(sock, ssl.SSLSocket) and sock.family in (socket.AF_INET, socket.AF_INET6)
        self._lowat = 1 if tcp else None  # the socket's SO_RCVLOWAT (1, the kernel's default, between frames)

    @staticmethod
    def _nonce(direction: bytes, seq: int) -> bytes:
        return direction + b"\0" + struct.pack("!Q", seq)  # 12 bytes

    def send(self, header: dict, payload=b"") -> None:
        """`payload`: a buffer or a list of contiguous buffers (views of KV blocks), sent and tagged uncopied."""
        views, h = _byte_views(payload), json.dumps(header, separators=(",", ":")).encode()
        size = sum(v.nbytes for v in views)
        head = struct.pack("!QI", 4 + len(h) + size + TAG, len(h)) + h
        nonce, self.send_seq = self._nonce(self.send_dir, self.send_seq), self.send_seq + 1
        if not size:  # no payload: a control frame, tagged in one call
            _move(self.sock, [memoryview(head + self._aead.encrypt(nonce, b"", head[8:]))], send=True)
            return
        mac = Cipher(self._aes, modes.GCM(nonce)).encryptor()
        mac.authenticate_additional_data(head[8:])
        groups = _groups(views)  # lazy: the first group leaves before a scattered frame's thousands of views are cut
        group, pending = next(groups), [memoryview(head)]
        for following in groups:  # tagged once sent: the kernel's copy has just brought the bytes into cache
            _move(self.sock, pending + group, send=True)
            pending = []
            for v in group:
                mac.authenticate_additional_data(v)
            group = following
        for v in group:  # the last (TAIL) group is tagged before it leaves so that the tag leaves with it: the
            mac.authenticate_additional_data(v)  # frame ends one send, and one wake-up of the receiver, sooner
        _move(self.sock, pending + group + [memoryview(_tag(mac))], send=True)

    def recv(self, into: Optional[list] = None) -> tuple[dict, list]:
        """(header, payload views). With `into` (writable byte views), a payload must fill them exactly or be
        empty, and is received straight into them; without, it lands in a fresh buffer of at most UNBUFFERED bytes.
        A frame that fails authentication raises, possibly after writing into `into`: its bytes must not be used
        then."""
        n, hlen = struct.unpack("!QI", _recv_exact(self.sock, 12))
        if n > MAX_FRAME or hlen > min(n - 4 - TAG, 1 << 16):
            raise ProtocolError(f"malformed frame (length {n}, header {hlen})")
        size = n - 4 - hlen - TAG
        if into is None:
            if size > UNBUFFERED:  # the length is not authenticated before the tag: it must not size a big allocation
                raise ProtocolError(f"payload of {size} bytes, over the {UNBUFFERED} allowed without receive buffers")
            views = [memoryview(bytearray(size))]
        else:
            views = _byte_views(into) if size else []
            if size != sum(v.nbytes for v in views):
                raise ProtocolError(f"payload of {size} bytes, expected {sum(v.nbytes for v in views)}")
        nonce = self._nonce(self.recv_dir, self.recv_seq)
        # The header rides with the first group and the tag with the last: a small frame is one more receive.
        hbytes, tag = memoryview(bytearray(hlen)), memoryview(bytearray(TAG))
        if not size:
            _move(self.sock, [hbytes, tag], send=False)
            try:
                self._aead.decrypt(nonce, bytes(tag), struct.pack("!I", hlen) + bytes(hbytes))
            except InvalidTag:
                raise ProtocolError("frame failed authentication") from None
            self.recv_seq += 1
            return json.loads(bytes(hbytes)), views
        mac = Cipher(self._aes, modes.GCM(nonce)).encryptor()
        mac.authenticate_additional_data(struct.pack("!I", hlen))
        groups = list(_groups(views))
        groups[0] = [hbytes] + groups[0]
        groups[-1] = groups[-1] + [tag]
        after = hlen + size + TAG  # what of the frame follows the current group
        for group in groups:
            nbytes = sum(v.nbytes for v in group)
            after -= nbytes
            # Woken once the group is in, from an empty queue. A wait ends only when the kernel holds the mark's
            # bytes, whichever groups they belong to, so the mark must never pass what is still to come: at most
            # what follows this group, plus one (part of the group may be in, and copied, before the wait begins).
            # Past that the last wait would never end.
            self._wake_at(min(nbytes, after + 1))
            _move(self.sock, group, send=False)
            for v in group:
                if v is not tag:
                    mac.authenticate_additional_data(v)
        self._wake_at(1)
        if not hmac.compare_digest(tag, _tag(mac)):
            raise ProtocolError("frame failed authentication")
        self.recv_seq += 1
        return json.loads(bytes(hbytes)), views

    def _wake_at(self, nbytes: int) -> None:
        if self._lowat is not None and self._lowat != nbytes:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, nbytes)
            self._lowat = nbytes

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass
