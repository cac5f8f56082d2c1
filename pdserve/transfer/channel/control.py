"""The authenticated control channel between D and P: one handshake per session, many operations per session.

P: a `ControlServer` handshakes each connection (handshake.py: the KV token proves both sides, compat fields are
compared, nothing else is read before) within `handshake_timeout`, then serves ops (`{"op": name, ...}` frames,
one at a time, each answered before the next is read) from a table of handlers until the peer closes, the session
sits idle `idle_seconds`, or an op fails. D: `dial` opens a session; a `SessionPool` (tcp_pool.py) keeps a few
per producer endpoint and runs each operation alone on one of them, under a Deadline.

Why a long-lived session stays as safe as one per transfer: every frame's tag covers its direction and sequence
number under a key fresh from both sides' nonces, so within a session no frame can be replayed, reordered or
reflected, and none from another session verifies; the 64-bit counter never repeats a GCM nonce under a key. Any
failure (a tag, a socket error, a timeout, an unexpected answer) drops the session, so a forger gets one try per
handshake and a half-read answer is never mistaken for the next one's. Sessions are retired by age (D at
`MAX_AGE`, P at twice that), so a rotated KV token stops being honored within minutes. The idle timeout is for P's
resources (a thread and a socket per session, authenticated peers only), not for security: a minute outlives the
gaps between a busy D's transfers, and a D that returns later pays one handshake.
"""
from __future__ import annotations

import heapq
import ipaddress
import itertools
import logging
import os
import select
import socket
import ssl
import threading
import time
from typing import Callable, Optional

from pdserve.kv_transfer_config import LOOPBACK
from pdserve.transfer.channel.handshake import client_handshake, server_handshake
from pdserve.transfer.channel.protocol import TIMEOUTS, Session, tune

logger = logging.getLogger("pdserve.transfer")
IDLE_SECONDS = 60.0  # P closes a session idle this long; D reuses one idle for at most half of it
MAX_AGE = 600.0  # D retires a session this old; P closes one at twice it
# P's caps: each connection is a thread, and before its handshake anyone may open one. A D keeps at most 4 sessions
# per P (channel/pool.py) and dials at most 8 at once (its loaders and lease renewals), so these leave room for
# dozens of Ds while a flood of connections costs P bounded threads; past a cap a connection is closed at once.
MAX_CONNECTIONS = 256  # in all (kv_connector_extra_config.max_connections)
MAX_HANDSHAKES = 64  # not yet authenticated, in all
MAX_HANDSHAKES_PER_HOST = 16  # not yet authenticated, from one peer address: one host cannot take every slot
HANDSHAKE_SECONDS = 3.0  # most an unauthenticated connection is kept (a real handshake takes milliseconds)


class _Watchdog:
    """One thread fires every Deadline: arming one is a heap push, where a timer thread each cost ~60 us here (a
    fifth of a one-block pull)."""

    def __init__(self):
        self._cv, self._heap, self._seq = threading.Condition(), [], itertools.count()
        self._thread, self._stale = None, 0

    def arm(self, d: "Deadline") -> None:
        with self._cv:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kv-deadlines", daemon=True)
                self._thread.start()
            heapq.heappush(self._heap, (d.when, next(self._seq), d))
            if self._heap[0][2] is d:
                self._cv.notify()

    def cancel(self, d: "Deadline") -> None:
        with self._cv:  # fires run under this lock: once cancel returns, a fire is over or never happens
            if d.hit or d.cancelled:
                return
            d.cancelled, self._stale = True, self._stale + 1
            if self._stale > 256 and 2 * self._stale > len(self._heap):  # cancelled entries wait for their time
                self._heap = [e for e in self._heap if not e[2].cancelled]
                heapq.heapify(self._heap)
                self._stale = 0

    def _run(self) -> None:
        with self._cv:
            while True:
                while self._heap and self._heap[0][2].cancelled:
                    heapq.heappop(self._heap)
                    self._stale -= 1
                wait = self._heap[0][0] - time.monotonic() if self._heap else None
                if wait is None or wait > 0:  # a little late: one wake-up takes every deadline due by then
                    self._cv.wait(None if wait is None else wait + 0.005)
                    continue
                heapq.heappop(self._heap)[2]._fire()

    def _after_fork(self) -> None:
        self.__init__()


_WATCHDOG = _Watchdog()
os.register_at_fork(after_in_child=_WATCHDOG._after_fork)


class Deadline:
    """Shuts `sock` down (both ways) `seconds` from now unless cancelled first. Kernel socket timeouts bound each
    wait only: a peer that trickles a byte now and then would otherwise hold an operation, or a pinned lease,
    forever. Shutting down makes the blocked call fail at once; `sock` may be swapped for its TLS wrapper (`hit`
    tells whether it fired). It costs only the socket it shuts: one operation owns a session at a time."""

    def __init__(self, seconds: float, sock: socket.socket):
        self.sock, self.hit, self.cancelled = sock, False, False
        self.when = time.monotonic() + max(seconds, 0.0)
        _WATCHDOG.arm(self)

    def _fire(self) -> None:
        self.hit = True
        try:  # the plain socket's shutdown, not SSLSocket's (which would also unhook the TLS object under its user)
            socket.socket.shutdown(self.sock, socket.SHUT_RDWR)
        except OSError:  # closed, or detached by the TLS wrapper (the caller checks `hit`)
            pass

    def cancel(self) -> None:
        _WATCHDOG.cancel(self)


def dial(host: str, port: int, token: bytes, compat: dict, until: float, tls: Optional[ssl.SSLContext] = None,
         wait_timeout: Optional[float] = None) -> Session:
    """D: connect, TLS if `tls`, and handshake, all by `until` (time.monotonic()); each socket wait has
    `wait_timeout` (default: the time left)."""
    left = until - time.monotonic()
    if left <= 0:
        raise TimeoutError("the deadline passed before connecting (queued behind other transfers)")
    sock = socket.create_connection((host, int(port)), timeout=left)
    deadline = Deadline(until - time.monotonic(), sock)
    try:
        tune(sock, wait_timeout or left)
        if tls is not None:
            sock = deadline.sock = tls.wrap_socket(sock, server_hostname=host)
        if deadline.hit:  # it fired on the plain socket the wrapper had just detached
            raise TimeoutError("the deadline passed during the handshake")
        session = client_handshake(sock, token, compat)
    except BaseException as e:
        deadline.cancel()  # before the close: a fire must never reach a reused descriptor
        sock.close()
        # a socket wait that ran out (EAGAIN from SO_RCVTIMEO) races the deadline's own shutdown: both are the
        # deadline passing, whichever came first
        if not isinstance(e, TimeoutError) and (deadline.hit or isinstance(e, TIMEOUTS)):
            raise TimeoutError("the deadline passed during the handshake") from e
        raise
    deadline.cancel()
    if deadline.hit:  # fired just as the handshake ended: the socket is shut
        session.close()
        raise TimeoutError("the deadline passed during the handshake")
    return session


def is_loopback(host: str) -> bool:
    """Whether `host` (a bind address) listens on loopback only; a wildcard (0.0.0.0, ::) or any name but
    localhost is taken as reachable from the network."""
    if host in LOOPBACK:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class ControlServer:
    """P's end: listens on (host, port) and serves `ops` ({name: handler(session, header)}, each sending its
    answer) over authenticated sessions. `count(cause)` hears each refused or broken connection."""

    def __init__(self, host: str, port: int, token: bytes, compat: dict, ops: dict, *, handshake_timeout: float,
                 wait_timeout: float, tls: Optional[ssl.SSLContext] = None, idle_seconds: float = IDLE_SECONDS,
                 max_age: float = 2 * MAX_AGE, nice: int = 0, count: Callable[[str], None] = lambda cause: None,
                 max_connections: Optional[int] = None):
        self.token, self.compat, self.ops, self.tls, self.count = token, compat, ops, tls, count
        self.handshake_timeout, self.wait_timeout, self.idle_seconds, self.max_age = \
            handshake_timeout, wait_timeout, idle_seconds, max_age
        self.nice, self.handshakes, self._live, self._lock = nice, 0, set(), threading.Lock()
        self.max_connections = MAX_CONNECTIONS if max_connections is None else max_connections
        self.connections, self._pending, self._warned = 0, {}, {}  # open; in their handshake, by peer address
        self._srv = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self._srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._srv.bind((host, port))
        except OSError as e:  # the deployment's mistake: name the setting, not just the errno
            self._srv.close()
            raise OSError(e.errno, f"the KV server cannot listen on {host}:{port} ({e.strerror}): set kv_port (or "
                                   f"kv_host) in --kv-transfer-config") from None
        self._srv.listen(64)
        self.port, self._closing = self._srv.getsockname()[1], threading.Event()
        if tls is None and not is_loopback(host):
            # the token authenticates every frame but encrypts none: on a shared network that is the prompts' KV
            logger.warning("the KV server listens on %s:%d, beyond loopback, without TLS: what crosses it (with "
                           "TcpConnector, the KV itself) is authenticated by the KV token but not encrypted; set "
                           "kv_tls_cert/kv_tls_key (--kv-tls-cert/--kv-tls-key) here and kv_tls_ca on the decode "
                           "nodes, unless this network is private to the deployment", host, self.port)
        threading.Thread(target=self._accept_loop, name="kv-server", daemon=True).start()

    def _accept_loop(self) -> None:
        while not self._closing.is_set():
            try:
                conn, addr = self._srv.accept()
            except OSError:
                return
            host = addr[0]
            with self._lock:
                refused = "connection_limit" if self.connections >= self.max_connections else \
                    "handshake_limit" if sum(self._pending.values()) >= MAX_HANDSHAKES or \
                    self._pending.get(host, 0) >= MAX_HANDSHAKES_PER_HOST else None
                if refused is None:
                    self.connections += 1
                    self._pending[host] = self._pending.get(host, 0) + 1
            if refused is not None:  # counted before the close: whoever sees the close sees the count
                self._refused(refused, host)
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn, host), name="kv-conn", daemon=True).start()

    def _refused(self, cause: str, host: str) -> None:
        self.count(cause)
        now = time.monotonic()
        if now - self._warned.get(cause, -60.0) >= 60.0:  # once a minute: a flood must not flood the log too
            self._warned[cause] = now
            what = f"{self.max_connections} connections in all (kv_connector_extra_config.max_connections)" \
                if cause == "connection_limit" else \
                f"{MAX_HANDSHAKES} handshakes in all or {MAX_HANDSHAKES_PER_HOST} from one address"
            logger.warning("KV server: a connection from %s refused: already %s (further refusals are counted in "
                           "pdserve_kv_transfer_failures_total{reason=%r})", host, what, cause)

    def _handshake_over(self, host: str) -> None:
        with self._lock:
            self._pending[host] -= 1
            if not self._pending[host]:
                del self._pending[host]

    def _handshake(self, socks: list) -> Session:
        """`socks`: the connection, and its TLS wrapper once made (closing both is the caller's)."""
        conn = socks[0]
        # before authentication anyone may connect: it holds a thread for seconds at most
        deadline = Deadline(min(self.handshake_timeout, HANDSHAKE_SECONDS), conn)
        try:
            if self.tls is not None:
                conn = deadline.sock = self.tls.wrap_socket(conn, server_side=True)
                with self._lock:
                    socks.append(conn)
                    self._live.add(conn)
            if deadline.hit:  # it fired between the wrap and the line above, on the detached plain socket
                raise TimeoutError("handshake deadline")
            session = server_handshake(conn, self.token, self.compat)
        finally:
            deadline.cancel()
        if deadline.hit:
            raise TimeoutError("handshake deadline")
        return session

    def _serve(self, conn: socket.socket, host: str) -> None:
        try:  # Linux: this thread only. When it competes with P's engine for a core, the engine keeps its share.
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.nice)
        except (OSError, AttributeError):
            pass
        socks, pending = [conn], True
        with self._lock:
            self._live.add(conn)
        try:
            tune(conn, self.wait_timeout)  # each wait inside an operation
            try:
                session = self._handshake(socks)
            finally:
                pending = False
                self._handshake_over(host)
            with self._lock:
                self.handshakes += 1
            idle = select.poll()
            idle.register(session.sock, select.POLLIN)
            while not self._closing.is_set() and time.monotonic() - session.opened < self.max_age:
                pending = isinstance(session.sock, ssl.SSLSocket) and session.sock.pending()
                if not pending and not idle.poll(self.idle_seconds * 1000):
                    break  # idle: D finds it closed and dials anew
                header, _ = session.recv(into=[])
                op = self.ops.get(header.get("op"))
                if op is None:
                    session.send({"status": "error", "error": f"unknown op {header.get('op')!r}"})
                else:
                    op(session, header)
        except TIMEOUTS:  # an idle or stalled peer: nothing to answer
            pass
        except ssl.SSLError as e:  # e.g. a consumer without TLS
            self.count("tls")
            logger.warning("KV connection refused: TLS handshake failed (consumer without TLS?): %s", e)
        except OSError:  # the peer went away, or a deadline shut the connection: nothing to answer
            pass
        except Exception as e:  # a broken or malformed frame (ProtocolError, ValueError, ...): this connection only
            self.count(type(e).__name__)
            logger.warning("KV connection refused or broken: %s: %s", type(e).__name__, e)
        finally:
            if pending:  # tune() failed before the handshake began
                self._handshake_over(host)
            for sock in reversed(socks):  # the TLS wrapper owns the descriptor; the plain socket is then detached
                sock.close()
            with self._lock:
                self._live.difference_update(socks)
                self.connections -= 1

    def close(self) -> None:
        """Stop listening and end every session (the ones mid-operation fail on their peer's side)."""
        self._closing.set()
        self._srv.close()
        with self._lock:
            live = list(self._live)
        for conn in live:
            try:
                socket.socket.shutdown(conn, socket.SHUT_RDWR)
            except OSError:
                pass
