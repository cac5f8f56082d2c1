"""The default `tcp` KV transport: D pulls, P is passive (NIXL-shaped, so another transport can sit behind it).

Producer (P) lifecycle of a request:
1. a request with `kv_transfer_params.do_remote_decode` prefills and samples its one token as usual;
2. `request_finished` keeps its blocks under a lease (transfer id, expiry `kv_lease_seconds`) and returns the
   `kv_transfer_params` that tell D where and what to read (engine, endpoint, transfer id, prompt length and hash)
   and for how long (`lease_seconds` left, never an absolute time: hosts' clocks are not compared);
3. the KV server answers authenticated reads of (transfer id, block index, count) from that lease only, pinning it
   while it reads and extending it (a read renews it, and so does a `renew`, which answers the seconds now left);
   an unknown, released or expired lease answers `expired`;
   the handshake has `kv_transfer_timeout` and each read `kv_lease_seconds`, then the connection is shut;
4. D's `done`, a `release_lease` (the router's `POST /v1/kv/release` on P, with the signed params, when no D took
   the request), or the lease running out with no read in flight, releases it: `get_finished` hands the request
   id to the scheduler, which frees the blocks.

Consumer (D) lifecycle of a request:
1. `get_num_new_matched_tokens` checks the params (peer in `kv_peers`, prompt length, prompt hash against D's own
   token ids) and offers the n - 1 prompt tokens beyond D's own prefix-cache hit;
2. the scheduler allocates blocks (for the replay's token too), parks the request in WAITING_FOR_REMOTE_KV (no
   token budget spent) and `update_state_after_alloc` queues the load; short of blocks, it keeps its place in the
   queue while `lease_time_left` lasts (P's `lease_seconds` from the request's arrival here, x0.9 for the hop),
   renewed in the background (`renew`) once less than half of that is left, for every request queued on a lease
   (`watch_lease`), then prefills locally; a request that reaches the head after its lease ended is not pulled;
3. `start_load_kv` pulls on a worker thread: handshake, reads of up to 64 blocks per frame received straight into
   D's own blocks, then `done`; the whole pull, counted from when it was queued, has `kv_transfer_timeout`;
4. `get_finished` reports the load done (the request is scheduled as the one-token replay) or failed (the
   scheduler's failure policy: recompute locally, or fail the request). A request that D prefills itself instead
   (params rejected, the lease ran out while blocks were short, all cached here) still sends P a bare `done` for
   its lease, and so does a request D refuses or drops before asking for its load (a 400 or 503 answer, an abort
   while queued): `release_remote`, only for params with a valid router proof and only to a peer in `kv_peers`.
"""
from __future__ import annotations

import hashlib
import heapq
import json
import logging
import os
import socket
import ssl
import threading
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from pdserve.config import LOOPBACK
from pdserve.core.kv_cache_manager import cdiv
from pdserve.request import Request, RequestStatus
from pdserve.transfer.base import ConnectorMeta, FinishedTransfers, KVConnector, LoadJob, load_job, register_connector
from pdserve.transfer.protocol import TIMEOUTS, ProtocolError, client_handshake, server_handshake, tune

logger = logging.getLogger("pdserve.transfer")
BLOCKS_PER_READ = 64


def prompt_hash(token_ids: list[int]) -> str:
    return hashlib.sha256(json.dumps(list(token_ids)).encode()).hexdigest()


@dataclass
class Lease:
    request_id: str
    block_ids: list[int]
    expiry: float
    pins: int = 0
    done: bool = False


@dataclass
class TransferStats:
    """Counters for the Prometheus series of both sides."""
    bytes_sent: int = 0
    bytes_received: int = 0
    seconds_receiving: float = 0.0
    failures: Counter = field(default_factory=Counter)


class Deadline:
    """Shuts `sock` down (both ways) `seconds` from now unless cancelled first. Kernel socket timeouts bound each
    wait only: a peer that trickles a byte now and then would otherwise hold a load, or a pinned lease, forever.
    Shutting down makes the blocked call fail at once; `sock` may be swapped for its TLS wrapper (`hit` tells
    whether it fired)."""

    def __init__(self, seconds: float, sock: socket.socket):
        self.sock, self.hit = sock, False
        self._timer = threading.Timer(max(seconds, 0.0), self._fire)
        self._timer.daemon = True
        self._timer.start()

    def _fire(self) -> None:
        self.hit = True
        try:  # the plain socket's shutdown, not SSLSocket's (which would also unhook the TLS object under its user)
            socket.socket.shutdown(self.sock, socket.SHUT_RDWR)
        except OSError:  # closed, or detached by the TLS wrapper (the caller checks `hit`)
            pass

    def cancel(self) -> None:
        self._timer.cancel()
        self._timer.join()  # a firing timer ends before the caller closes the socket (its fd could be reused)


@register_connector("TcpConnector")
class TcpConnector(KVConnector):
    def __init__(self, config, engine):
        super().__init__(config, engine)
        self.block_size = engine.config.cache.block_size
        self.token = config.auth_token().encode()
        self.compat = engine.compat_fields()
        self.stats = TransferStats()
        self._lock = threading.Lock()
        self.leases: dict[str, Lease] = {}
        self._queued: list[LoadJob] = []
        self._inflight: set[str] = set()
        self._renewing: set[str] = set()  # D: requests whose lease renewal is in flight
        self._watched: list = []  # D: heap of (when to look again, seq, request) for requests queued on a lease
        self._seq = 0
        self._done: set[str] = set()
        self._failed: dict[str, str] = {}
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kv-load")
        self._server: Optional[socket.socket] = None
        self._closing = threading.Event()
        self._tls_server = config.tls_server_context() if config.kv_role != "kv_consumer" else None
        self._tls_client = config.tls_client_context() if config.kv_role != "kv_producer" else None
        if config.kv_role in ("kv_producer", "kv_both"):
            self._start_server()

    # ---- producer ------------------------------------------------------------------------------------------
    def _start_server(self) -> None:
        srv = socket.socket(socket.AF_INET6 if ":" in self.config.kv_host else socket.AF_INET, socket.SOCK_STREAM)
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind((self.config.kv_host, self.config.kv_port))
        srv.listen(64)
        self._server = srv
        self.port = srv.getsockname()[1]
        threading.Thread(target=self._accept_loop, name="kv-server", daemon=True).start()
        logger.info("KV server listening on %s:%d", self.config.kv_host, self.port)

    def _accept_loop(self) -> None:
        while not self._closing.is_set():
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), name="kv-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:  # Linux: this thread only. When it competes with P's engine for a core, the engine keeps its share.
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.config.kv_server_nice)
        except (OSError, AttributeError):
            pass
        try:
            tune(conn, max(5.0, self.config.kv_lease_seconds))  # an idle wait between a consumer's frames
            # Before authentication anyone may connect: the whole handshake gets kv_transfer_timeout.
            deadline = Deadline(self.config.kv_transfer_timeout, conn)
            try:
                if self._tls_server is not None:
                    conn = deadline.sock = self._tls_server.wrap_socket(conn, server_side=True)
                if deadline.hit:  # it fired between the wrap and the line above, on the detached plain socket
                    raise TimeoutError("handshake deadline")
                session = server_handshake(conn, self.token, self.compat)
            finally:
                deadline.cancel()
            if deadline.hit:
                raise TimeoutError("handshake deadline")
            while True:
                header, _ = session.recv(into=[])
                op, tid = header.get("op"), str(header.get("transfer_id", ""))
                if op == "read":
                    lease = self._pin(tid)
                    if lease is None:
                        session.send({"status": "expired"})
                        continue
                    # The pin covers the send (on CPU the bytes go out straight from the cache), and a reader too
                    # slow to take one frame within a lease period loses its connection: the pin cannot outlive
                    # the lease it extended.
                    deadline = Deadline(self.config.kv_lease_seconds, conn)
                    try:
                        start, count = int(header["start"]), int(header["count"])
                        ids = lease.block_ids[start:start + count]
                        payload = self._views(ids) if self._flat else [self._gather(ids)]
                        session.send({"status": "ok", "count": len(ids)}, payload)
                    finally:
                        deadline.cancel()
                        self._unpin(tid)
                        if deadline.hit:
                            self._count("slow_reader")
                            logger.warning("KV read of transfer %s took over kv_lease_seconds: connection closed",
                                           tid)
                    with self._lock:
                        self.stats.bytes_sent += len(ids) * self.bytes_per_block
                elif op == "renew":  # D waits for blocks before it can read: the lease is extended, not pinned
                    left = self._renew(tid)
                    session.send({"status": "ok", "lease_seconds": left} if left else {"status": "expired"})
                elif op == "done":
                    with self._lock:
                        if tid in self.leases:
                            self.leases[tid].done = True
                    session.send({"status": "ok"})
                else:
                    session.send({"status": "error", "error": f"unknown op {op!r}"})
        except TIMEOUTS:  # an idle or stalled peer: nothing to answer
            pass
        except ssl.SSLError as e:  # e.g. a consumer without TLS
            self._count("tls")
            logger.warning("KV connection refused: TLS handshake failed (consumer without TLS?): %s", e)
        except OSError:  # the peer went away, or a deadline shut the connection: nothing to answer
            pass
        except Exception as e:  # a broken or malformed frame (ProtocolError, ValueError, ...): this connection only
            self._count(type(e).__name__)
            logger.warning("KV connection refused or broken: %s: %s", type(e).__name__, e)
        finally:
            conn.close()

    def _count(self, cause: str) -> None:
        with self._lock:  # server, loader and engine threads all count
            self.stats.failures[cause] += 1

    def _pin(self, tid: str) -> Optional[Lease]:
        with self._lock:
            lease = self.leases.get(tid)
            if lease is None or lease.done or time.monotonic() > lease.expiry:
                return None
            lease.pins += 1
            lease.expiry = time.monotonic() + self.config.kv_lease_seconds
            return lease

    def _renew(self, tid: str) -> float:
        """Seconds left in the extended lease; 0 for an unknown, released or expired one."""
        with self._lock:
            lease = self.leases.get(tid)
            if lease is None or lease.done or time.monotonic() > lease.expiry:
                return 0.0
            lease.expiry = time.monotonic() + self.config.kv_lease_seconds
            return self.config.kv_lease_seconds

    def _unpin(self, tid: str) -> None:
        with self._lock:
            self.leases[tid].pins -= 1

    def register_kv_caches(self, kv_caches: list) -> None:
        super().register_kv_caches(kv_caches)
        c0 = kv_caches[0]  # [2 (K, V), blocks, block_size, kv heads, head size] per layer
        self.num_blocks, self.chunk_bytes = c0.shape[1], c0[0, 0].numel() * c0.element_size()
        self.bytes_per_block = 2 * len(kv_caches) * self.chunk_bytes
        # On CPU, flat byte views of each layer's cache: reads are sent from, and loads received into, the blocks
        # themselves. Elsewhere reads gather into host memory and loads scatter from it.
        self._flat = [c.view(-1).view(torch.uint8).numpy() for c in kv_caches] if c0.device.type == "cpu" else None

    def _views(self, block_ids: list[int]) -> list[np.ndarray]:
        """Byte views (numpy: untracked by the GC) of `block_ids` in wire order [layer, K/V, block], one per run of
        consecutive ids."""
        if not block_ids:
            return []
        ids = np.asarray(block_ids)
        cut = np.flatnonzero(np.diff(ids) != 1) + 1
        runs = list(zip(ids[np.r_[0, cut]].tolist(), (ids[np.r_[cut - 1, len(ids) - 1]] + 1).tolist()))
        n, cb = self.num_blocks, self.chunk_bytes
        return [flat[(kv * n + s) * cb:(kv * n + e) * cb] for flat in self._flat for kv in (0, 1) for s, e in runs]

    def _gather(self, block_ids: list[int]) -> np.ndarray:
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.kv_caches[0].device)
        data = torch.stack([c.index_select(1, idx) for c in self.kv_caches])  # [layers, 2, n, B, H, D]
        return data.cpu().contiguous().view(torch.uint8).numpy()

    def request_finished(self, req: Request, block_ids: list[int]) -> tuple[bool, Optional[dict]]:
        params = req.kv_transfer_params or {}
        if self._server is None:  # consumer only: no KV server that a decoder could read these blocks from
            return False, None
        if not params.get("do_remote_decode") or req.status not in (RequestStatus.FINISHED_STOPPED,
                                                                    RequestStatus.FINISHED_LENGTH):
            return False, None
        n = req.num_prompt_tokens
        if n < 2:  # nothing to hand over: D prefills a one-token prompt itself
            return False, None
        tid = uuid.uuid4().hex
        with self._lock:
            self.leases[tid] = Lease(req.request_id, list(block_ids), time.monotonic() + self.config.kv_lease_seconds)
        return True, {"do_remote_prefill": True, "do_remote_decode": False, "transfer_id": tid,
                      "remote_engine_id": self.config.engine_id, "remote_request_id": req.request_id,
                      "remote_host": self.config.kv_advertise_host or self.config.kv_host, "remote_port": self.port,
                      "remote_block_ids": list(block_ids[:cdiv(n - 1, self.block_size)]),
                      "num_prompt_tokens": n, "prompt_hash": prompt_hash(req.prompt_token_ids),
                      "lease_seconds": self.config.kv_lease_seconds}

    def leased_blocks(self) -> int:
        with self._lock:
            return sum(len(lease.block_ids) for lease in self.leases.values())

    def release_lease(self, tid: str, request_id: str) -> bool:
        """P: end the open lease `tid` (of request `request_id`) now, as D's `done` would. The router's call, through
        P's `POST /v1/kv/release`, for params no decode node took. False when no such lease is open: never made
        here, made for another request, already released, or expired (so a repeat is harmless)."""
        with self._lock:
            lease = self.leases.get(tid)
            if lease is None or lease.done or lease.request_id != request_id or time.monotonic() > lease.expiry:
                return False
            lease.done = True  # a read in flight keeps its pin; get_finished frees the blocks after it
            return True

    # ---- consumer ------------------------------------------------------------------------------------------
    def peer_allowed(self, host: str, port: int) -> bool:
        peers = self.config.kv_peers
        return f"{host}:{port}" in peers if peers else host in LOOPBACK

    def release_remote(self, params: dict, request_id: str) -> bool:
        """D: a bare `done` now for remote-prefill `params` this side will never load (the request was refused with a
        400 or 503, or aborted before its load was asked for), so P's lease ends at once rather than at expiry. The
        caller has checked the router's proof; only a peer in `kv_peers` is dialed. True if the `done` is on its way."""
        if self.config.kv_role == "kv_producer" or not params.get("transfer_id"):
            return False
        try:
            host, port = str(params["remote_host"]), int(params["remote_port"])
        except (KeyError, TypeError, ValueError):
            return False
        if not self.peer_allowed(host, port):
            logger.warning("request %s: not releasing the producer's lease: KV peer %s:%s is not in kv_peers",
                           request_id, host, port)
            return False
        self.start_load_kv(ConnectorMeta([LoadJob(request_id, dict(params), 0, [])]))
        return True

    def get_num_new_matched_tokens(self, req: Request, num_local_computed: int) -> int:
        p = req.kv_transfer_params or {}
        if not p.get("do_remote_prefill"):
            return 0
        n = req.num_prompt_tokens
        why, peer_ok = None, self.peer_allowed(str(p.get("remote_host")), int(p.get("remote_port", -1)))
        if not peer_ok:
            why = f"KV peer {p.get('remote_host')}:{p.get('remote_port')} is not in kv_peers"
        elif p.get("num_prompt_tokens") != n or p.get("prompt_hash") != prompt_hash(req.prompt_token_ids):
            why = "prompt hash mismatch (different tokenization on P and D)"
        if why:
            req.kv_load_error = why
            self._count("rejected")
            logger.warning("request %s: not loading remote KV: %s", req.request_id, why)
            if peer_ok:  # a peer this side may dial: tell it to free the lease now (never dial one outside kv_peers)
                self._queued.append(LoadJob(req.request_id, dict(p), 0, []))
            return 0
        if num_local_computed >= n - 1:  # all cached here: nothing to pull, but P must hear `done` to free its
            self._queued.append(LoadJob(req.request_id, dict(p), 0, []))  # lease now, not at expiry (as vLLM's Nixl)
            return 0
        return n - 1 - num_local_computed

    def update_state_after_alloc(self, req: Request, block_ids: list[int], num_local_computed: int) -> None:
        """`block_ids` empty: the lease ran out while blocks were short and D prefills locally; only P's lease is
        released."""
        self._queued.append(load_job(req, block_ids, num_local_computed, self.block_size))

    def build_connector_meta(self) -> ConnectorMeta:
        meta, self._queued = ConnectorMeta(self._queued), []
        return meta

    def start_load_kv(self, meta: ConnectorMeta) -> None:
        for job in meta.loads:
            with self._lock:
                self._inflight.add(job.request_id)
            self._pool.submit(self._pull, job, time.monotonic())

    def _connect(self, p: dict, until: float):
        """An authenticated session with the producer `p` names, and the Deadline that shuts it at `until`."""
        left = until - time.monotonic()
        if left <= 0:
            raise TimeoutError("kv_transfer_timeout passed while queued behind other loads")
        sock = socket.create_connection((p["remote_host"], int(p["remote_port"])), timeout=left)
        deadline = Deadline(until - time.monotonic(), sock)
        try:
            tune(sock, self.config.kv_transfer_timeout)
            if self._tls_client is not None:
                sock = deadline.sock = self._tls_client.wrap_socket(sock, server_hostname=p["remote_host"])
            if deadline.hit:  # it fired on the plain socket the wrapper had just detached
                raise TimeoutError("kv_transfer_timeout")
            return client_handshake(sock, self.token, self.compat), deadline
        except BaseException as e:
            deadline.cancel()
            sock.close()
            if deadline.hit and not isinstance(e, TimeoutError):
                raise TimeoutError("kv_transfer_timeout") from e
            raise

    def _pull(self, job: LoadJob, queued: float) -> None:
        """A load, or with no `dst_blocks` a bare `done` that only releases P's lease. Either has
        kv_transfer_timeout from `queued` in all (time spent waiting for a worker counts)."""
        p, t0, bare = job.params, time.monotonic(), not job.dst_blocks
        deadline = None
        try:
            session, deadline = self._connect(p, queued + self.config.kv_transfer_timeout)
            # All reads go out first, so P sends the next batch while this side receives the previous one.
            batches = [job.dst_blocks[i:i + BLOCKS_PER_READ] for i in range(0, len(job.dst_blocks),
                                                                           BLOCKS_PER_READ)]
            for i, dst in enumerate(batches):
                session.send({"op": "read", "transfer_id": p["transfer_id"],
                              "start": job.src_start + i * BLOCKS_PER_READ, "count": len(dst)})
            for dst in batches:
                # Straight into the request's own blocks; if the frame then fails authentication, the load
                # fails and the scheduler drops these blocks unpublished.
                nbytes = len(dst) * self.bytes_per_block
                into = self._views(dst) if self._flat else [memoryview(bytearray(nbytes))]
                header, _ = session.recv(into=into)
                if header.get("status") != "ok" or header.get("count") != len(dst):
                    raise ProtocolError(f"producer answered {header.get('status')!r} for transfer "
                                        f"{p['transfer_id']}")
                if not self._flat:
                    self._scatter(dst, into[0])
                with self._lock:
                    self.stats.bytes_received += nbytes
            session.send({"op": "done", "transfer_id": p["transfer_id"]})
            session.recv(into=[])
            if not bare:  # a bare done is nobody's load: the request already prefills here
                with self._lock:
                    self._done.add(job.request_id)
        except Exception as e:
            cause = "timeout" if isinstance(e, TIMEOUTS) or (deadline and deadline.hit) else type(e).__name__
            if bare:  # P frees the lease at expiry instead
                logger.info("request %s: could not release the producer's lease (%s): %s", job.request_id, cause, e)
            else:  # every failed load ends in the scheduler's failure policy
                self._count(cause)
                logger.warning("request %s: KV load failed (%s): %s", job.request_id, cause, e)
                with self._lock:
                    self._failed[job.request_id] = f"KV load failed ({cause}): {e}"
        finally:
            if deadline is not None:
                deadline.cancel()
                deadline.sock.close()  # the TLS wrapper when there is one: it owns the descriptor
            with self._lock:
                self.stats.seconds_receiving += 0.0 if bare else time.monotonic() - t0
                self._inflight.discard(job.request_id)

    def lease_time_left(self, req: Request) -> float:
        """Seconds P still holds `req`'s KV, on this host's clock. P states its lease as seconds left (clocks are
        never compared across hosts), counted here from the request's arrival less a tenth for the hop from P. Past
        half of it a background `renew` extends it; a lease P no longer has, or a P that cannot be reached, ends
        the wait (the request then prefills locally)."""
        seconds = float((req.kv_transfer_params or {}).get("lease_seconds", self.config.kv_lease_seconds))
        now = time.monotonic()
        if req.kv_lease_end is None:
            req.kv_lease_end = req.arrival_time + 0.9 * seconds
        left = req.kv_lease_end - now
        with self._lock:
            renew = 0 < left < seconds / 2 and req.request_id not in self._renewing
            if renew:
                self._renewing.add(req.request_id)
        if renew:
            self._pool.submit(self._renew_lease, req, seconds)
        return left

    def watch_lease(self, req: Request) -> None:
        p = req.kv_transfer_params
        try:
            ok = self.peer_allowed(str(p["remote_host"]), int(p["remote_port"])) and p.get("transfer_id")
        except (KeyError, TypeError, ValueError):
            ok = False
        if ok:
            self._look_again(req, req.arrival_time)

    def _look_again(self, req: Request, at: float) -> None:
        self._seq += 1
        heapq.heappush(self._watched, (at, self._seq, req))

    def _renew_watched(self) -> None:
        """Engine thread, every step: queued requests whose lease is past half get a background renewal (the queue's
        head is also asked each step by the scheduler; this reaches the requests behind it). O(1) when none is due."""
        now = time.monotonic()
        while self._watched and self._watched[0][0] <= now:
            _, _, req = heapq.heappop(self._watched)
            if req.is_finished or req.kv_load_tried:
                continue
            seconds = float(req.kv_transfer_params.get("lease_seconds", self.config.kv_lease_seconds))
            if self.lease_time_left(req) > 0:
                self._look_again(req, now + max(seconds / 8, 0.01))

    def _renew_lease(self, req: Request, seconds: float) -> None:
        p, sent, deadline = req.kv_transfer_params, time.monotonic(), None
        try:
            session, deadline = self._connect(p, sent + self.config.kv_transfer_timeout)
            session.send({"op": "renew", "transfer_id": p["transfer_id"]})
            header, _ = session.recv(into=[])
            left = float(header.get("lease_seconds", 0)) if header.get("status") == "ok" else 0.0
            req.kv_lease_end = sent + 0.9 * left
        except Exception as e:
            logger.info("request %s: could not renew the producer's lease: %s", req.request_id, e)
            req.kv_lease_end = sent
        finally:
            if deadline is not None:
                deadline.cancel()
                deadline.sock.close()
            with self._lock:
                self._renewing.discard(req.request_id)

    def request_abandoned(self, req: Request) -> None:
        if (req.kv_transfer_params or {}).get("do_remote_prefill"):  # verified when the request was added
            self.release_remote(req.kv_transfer_params, req.request_id)

    def _scatter(self, dst: list[int], payload: memoryview) -> None:
        c0 = self.kv_caches[0]
        shape = (len(self.kv_caches), 2, len(dst), *c0.shape[2:])  # the payload's size was checked on receipt
        data = torch.frombuffer(payload, dtype=torch.uint8).view(c0.dtype).view(shape).to(c0.device)
        idx = torch.tensor(dst, dtype=torch.long, device=c0.device)
        for layer, cache in enumerate(self.kv_caches):
            cache.index_copy_(1, idx, data[layer])
        if c0.device.type == "cuda":  # on this thread's stream: the load is reported done only once it has run
            done = torch.cuda.Event()
            done.record()
            done.synchronize()

    # ---- both ----------------------------------------------------------------------------------------------
    def get_finished(self) -> FinishedTransfers:
        self._renew_watched()
        now = time.monotonic()
        out = FinishedTransfers()
        with self._lock:
            for tid, lease in list(self.leases.items()):
                if lease.pins == 0 and (lease.done or now > lease.expiry):
                    if not lease.done:
                        self.stats.failures["lease_expired"] += 1
                    del self.leases[tid]
                    out.done_sending.add(lease.request_id)
            out.done_recving, self._done = self._done, set()
            out.failed, self._failed = self._failed, {}
        return out

    def has_pending(self) -> bool:
        with self._lock:
            return bool(self.leases or self._inflight or self._done or self._failed or self._queued)

    def shutdown(self) -> None:
        self._closing.set()
        if self._server is not None:
            self._server.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
