"""D's end of the control channel (tcp_channel.py): a few authenticated sessions per producer endpoint, reused.

A transfer checks one session out, alone: its Deadline may shut that socket and costs no other transfer. After any
failure the session is dropped and the next transfer dials anew. P closes sessions idle `idle_seconds` (60 s by
default); this side reuses only those idle for less than `max_idle` (half of that), retires them at `max_age`, and
catches one P closed anyway (restarted, or idled out early) before use, by its readable socket, or, racing, redoes
the operation once on a fresh session when the reused one failed before any answer. A handshake refused outright
(P's certificate does not verify, TLS on one side only, another KV token or layout: a deployment error) is not
redialed for REFUSED_HOLD: until then each call fails at once with the same error, rather than every request
paying its load's, renewals' and `done`'s handshakes (and log lines) to learn it again. The hold is short
because a plain D cannot tell a TLS P closing at the handshake from a P dying mid-accept (SIGKILLed while stopped:
the connections in its backlog are reset), and a P restarted on the same address must not wait long to be used.
"""
from __future__ import annotations

import logging
import select
import socket
import ssl
import threading
import time
from typing import Callable, Optional

from pdserve.transfer.channel.protocol import ProtocolError, Session
from pdserve.transfer.channel.control import IDLE_SECONDS, MAX_AGE, Deadline, dial

logger = logging.getLogger("pdserve.transfer")
PER_PEER = 4  # idle sessions kept per producer endpoint (one per loader thread)
# A reused session that fails this way before any answer was most likely closed by P while idle: redo on a fresh one.
STALE = (ConnectionError, ssl.SSLEOFError, ssl.SSLZeroReturnError)
REFUSED_HOLD = 1.0  # seconds: a misconfigured peer costs D at most one handshake a second


class SessionPool:
    """D's end: authenticated sessions per producer endpoint, each used by one caller at a time. Thread-safe."""

    def __init__(self, token: bytes, compat: dict, tls: Optional[ssl.SSLContext] = None,
                 wait_timeout: Optional[float] = None, per_peer: int = PER_PEER,
                 max_idle: float = IDLE_SECONDS / 2, max_age: float = MAX_AGE):
        self.token, self.compat, self.tls, self.wait_timeout = token, compat, tls, wait_timeout
        self.per_peer, self.max_idle, self.max_age = per_peer, max_idle, max_age
        self.handshakes = self.redials = 0  # sessions dialed; of them, redials of an operation a stale session failed
        self._idle: dict[tuple, list[tuple[Session, float]]] = {}
        self._refused: dict[tuple, tuple[BaseException, float]] = {}  # peer -> (its handshake's refusal, when)
        self._lock = threading.Lock()
        self._closed = False

    def call(self, host: str, port: int, until: float, fn: Callable[[Session], object]):
        """`fn(session)`'s result, run on an idle session to (host, port) or a new one, all by `until`
        (time.monotonic()): past it the session is shut and TimeoutError raised. Any failure drops the session;
        `fn` runs a second time, on a fresh session, only when a reused one failed before any answer (P had closed
        it), so `fn` must be safe to redo from the start."""
        peer = (host, int(port))
        if until <= time.monotonic():
            raise TimeoutError("the deadline passed while queued behind other transfers")
        session = self._checkout(peer)
        reused = session is not None
        if not reused:
            session = self._dial(peer, until)
        while True:
            seq, deadline = session.recv_seq, Deadline(until - time.monotonic(), session.sock)
            try:
                out = fn(session)
            except BaseException as e:
                deadline.cancel()
                session.close()
                if reused and not deadline.hit and session.recv_seq == seq and isinstance(e, STALE):
                    logger.debug("KV session to %s:%s was closed while idle (%s): dialing anew", host, port, e)
                    self.drop(peer)  # its idle siblings are likely as dead (P restarted)
                    session, reused = self._dial(peer, until), False
                    with self._lock:
                        self.redials += 1
                    continue
                if deadline.hit and not isinstance(e, TimeoutError):
                    raise TimeoutError(f"deadline passed: {e}") from e
                raise
            deadline.cancel()
            if deadline.hit:  # fired just as `fn` ended: the socket is shut
                session.close()
            else:
                self._checkin(peer, session)
            return out

    def _dial(self, peer: tuple, until: float) -> Session:
        with self._lock:
            refused, when = self._refused.get(peer, (None, 0.0))
        ago = time.monotonic() - when
        if refused is not None and ago < REFUSED_HOLD:
            raise type(refused)(f"{refused} (handshake refused {ago:.1f} s ago: not redialed for {REFUSED_HOLD:g} s)")
        try:
            session = dial(*peer, self.token, self.compat, until, self.tls, self.wait_timeout)
        except (ProtocolError, ssl.SSLError) as e:
            if not isinstance(e, STALE):  # an EOF may be P going away: only an outright refusal is held
                with self._lock:
                    self._refused[peer] = (e, time.monotonic())
            raise
        with self._lock:
            self.handshakes += 1
            self._refused.pop(peer, None)
        return session

    def _checkout(self, peer: tuple) -> Optional[Session]:
        now = time.monotonic()
        while True:
            with self._lock:
                idle = self._idle.get(peer)
                if not idle:
                    return None
                session, since = idle.pop()  # the most recently used: the least likely to have idled out
            if now - since < self.max_idle and now - session.opened < self.max_age and not _readable(session.sock):
                return session
            session.close()  # idle too long, too old, or P spoke unasked: it closed the session

    def _checkin(self, peer: tuple, session: Session) -> None:
        with self._lock:
            idle = self._idle.setdefault(peer, [])
            if len(idle) < self.per_peer and not self._closed:
                idle.append((session, time.monotonic()))
                return
        session.close()

    def drop(self, peer: Optional[tuple] = None) -> None:
        """Close the idle sessions to `peer` (host, port), or to every peer."""
        with self._lock:
            gone = [s for p in ([peer] if peer else list(self._idle)) for s, _ in self._idle.pop(p, [])]
        for session in gone:
            session.close()

    def close(self) -> None:
        """Close every idle session, and each one in use as its operation ends."""
        with self._lock:
            self._closed = True
        self.drop()

    def num_idle(self, peer: Optional[tuple] = None) -> int:
        with self._lock:
            return sum(len(v) for p, v in self._idle.items() if peer is None or p == peer)


def _readable(sock: socket.socket) -> bool:
    """P never speaks unasked: an idle session with something to read has been closed (or broken) by P."""
    if isinstance(sock, ssl.SSLSocket) and sock.pending():
        return True
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(0))
