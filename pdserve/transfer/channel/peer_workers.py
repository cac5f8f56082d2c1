"""Worker threads per KV peer, for what D asks of a P over the network (loads, lease renewals, `done`s).

A P that accepts connections and never answers (stopped, wedged) holds each worker it is given until
kv_transfer_timeout. With one shared pool of four, N requests for such a P stalled every other P's requests behind
them for about ceil(N / 4) x kv_transfer_timeout, and since a load's deadline counts its wait for a worker, loads
from healthy Ps timed out too. Here each peer has workers of its own: a hung P delays only its own requests. Peers
are the `host:port`s that params name once their proof holds. A deployment has few, but a P restarting on new
ports (loopback) makes new ones, so past MAX_PEERS the rest share one pool, and a pool idle for IDLE_SECONDS is
shut (its threads end; the next request for that peer starts a new one).
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

MAX_PEERS = 32
IDLE_SECONDS = 300.0
SHARED = "*"  # the peers past MAX_PEERS


def peer_of(params) -> str:
    """The peer a request's params name ("host:port"; malformed params get one shared key, and fail on their own)."""
    p = params if isinstance(params, dict) else {}
    return f"{p.get('remote_host')}:{p.get('remote_port')}"


class PeerWorkers:
    def __init__(self, per_peer: int, name: str):
        self.per_peer, self.name = per_peer, name
        self._pools: dict[str, ThreadPoolExecutor] = {}
        self._busy: dict[str, int] = {}  # tasks submitted and not yet done, per peer
        self._last: dict[str, float] = {}  # when each peer's pool was last used
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, peer: str, fn: Callable, *args) -> Future:
        """Runs fn(*args) on `peer`'s workers; RuntimeError once shut down (as ThreadPoolExecutor)."""
        now = time.monotonic()
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self.name}: shut down")
            self._reap(now)
            if peer not in self._pools and len(self._pools) >= MAX_PEERS:
                peer = SHARED
            if peer not in self._pools:
                self._pools[peer] = ThreadPoolExecutor(self.per_peer, thread_name_prefix=self.name)
                self._busy[peer] = 0
            self._busy[peer] += 1
            self._last[peer] = now
            future = self._pools[peer].submit(fn, *args)
        future.add_done_callback(lambda _: self._done(peer))
        return future

    def _done(self, peer: str) -> None:
        with self._lock:
            if peer in self._busy:
                self._busy[peer] -= 1
                self._last[peer] = time.monotonic()

    def _reap(self, now: float) -> None:
        for peer in [p for p, n in self._busy.items() if n == 0 and now - self._last[p] > IDLE_SECONDS]:
            self._pools.pop(peer).shutdown(wait=False)
            del self._busy[peer], self._last[peer]

    def shutdown(self, grace: float = 0.0) -> None:
        """No new work; what was submitted gets up to `grace` s to finish (a `done` queued by the aborts of a
        stopping engine, which would otherwise leave P's lease to expire), then what has not started is dropped."""
        with self._lock:
            self._closed = True
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            with self._lock:
                if not any(self._busy.values()):
                    break
            time.sleep(0.005)
        with self._lock:
            pools, self._pools = list(self._pools.values()), {}
            self._busy.clear()
        for pool in pools:
            pool.shutdown(wait=False, cancel_futures=True)
