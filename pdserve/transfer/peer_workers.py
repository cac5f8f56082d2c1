"""Worker threads per KV peer, for what D asks of a P over the network (lease checks, loads, renewals, `done`s).

A P that accepts connections and never answers (stopped, wedged) holds each worker it is given until
kv_transfer_timeout. With one shared pool of four, N requests for such a P stalled every other P's requests behind
them for about ceil(N / 4) x kv_transfer_timeout, and since a load's deadline counts its wait for a worker, loads
from healthy Ps timed out too. Here each peer has workers of its own: a hung P delays only its own requests. Peers
are the `host:port`s params name after their proof holds, so their number is bounded by the deployment (kv_peers,
or loopback ports when that is empty); a pool's threads start on demand and idle ones cost only memory.
"""
from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable


def peer_of(params) -> str:
    """The peer a request's params name ("host:port"; malformed params get one shared key, and fail on their own)."""
    p = params if isinstance(params, dict) else {}
    return f"{p.get('remote_host')}:{p.get('remote_port')}"


class PeerWorkers:
    def __init__(self, per_peer: int, name: str):
        self.per_peer, self.name = per_peer, name
        self._pools: dict[str, ThreadPoolExecutor] = {}
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, peer: str, fn: Callable, *args) -> Future:
        """Runs fn(*args) on `peer`'s workers; RuntimeError once shut down (as ThreadPoolExecutor)."""
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self.name}: shut down")
            pool = self._pools.get(peer)
            if pool is None:
                pool = self._pools[peer] = ThreadPoolExecutor(self.per_peer, thread_name_prefix=self.name)
        return pool.submit(fn, *args)

    def shutdown(self) -> None:
        with self._lock:
            self._closed = True
            pools, self._pools = list(self._pools.values()), {}
        for pool in pools:
            pool.shutdown(wait=False, cancel_futures=True)
