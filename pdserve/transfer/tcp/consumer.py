"""D's side of the tcp transport: checks remote-prefill params, pulls KV over pooled sessions, keeps leases alive.

Consumer (D) lifecycle of a request:
1. `get_num_new_matched_tokens` checks the params (peer in `kv_peers`, prompt length, prompt hash against D's own
   token ids) and offers the prompt tokens P hands over (n - 1, or all n with P's first token) beyond D's own
   prefix-cache hit;
2. the scheduler allocates blocks (for the replay's token too), parks the request in WAITING_FOR_REMOTE_KV (no
   token budget spent) and `update_state_after_alloc` queues the load; short of blocks, it keeps its place in the
   queue while `lease_time_left` lasts (P's `lease_seconds` from the request's arrival here, x0.9 for the hop),
   renewed in the background (`renew`, as `check_remote`) once less than half of that is left, for every request
   queued on a lease (`watch_lease`), then prefills locally; a request that reaches the head after its lease ended
   is not pulled;
3. `start_load_kv` pulls on a worker thread of that P's own (`peer_workers.py`: a hung P holds up only its own
   requests), over a session to P from the pool (a handshake only when no idle one
   is left): reads of up to 64 blocks per frame, all asked at once (the last one also says `done`) and received
   straight into D's own blocks; the whole pull, counted from when it was queued, has `kv_transfer_timeout`, and any
   failure drops the session (the next transfer dials anew) and sends P a bare `done` on a fresh one, so its
   lease ends now rather than at expiry;
4. `get_finished` reports the load done (the request is scheduled as the one-token replay), gone (P answered
   `expired`: its lease ended, was released or used, or P restarted; the request is prefilled here whatever the
   failure policy: the client did nothing wrong) or failed (the scheduler's failure policy: recompute locally, or
   fail the request). The load is D's only question to P about a request: nothing is asked before it. A request
   that D prefills itself instead (params rejected, the lease ran out while blocks were short, all cached here)
   still sends P a bare `done` for its lease, and so does a request D refuses or drops before asking for its load
   (a 400 or 503 answer, an abort while queued): `release_remote`, only for params with a valid router proof and
   only to a peer in `kv_peers`; a stopping D gives the `done`s its last aborts queued up to SHUTDOWN_GRACE to go
   out.
A request taken before P prefilled it (the router's early decode) comes with `await_kv` params instead (P's KV
endpoint and the handoff key, channel/handoffs.py): step 1 offers all n prompt tokens unchecked, step 3 awaits P's
post on a worker of its own (`kv-await`: an await lasts P's queue and prefill, and must not hold the loads' workers)
and gets the params and the KV in one operation, and step 4 reports the load done with the params, which the engine
verifies before the request runs; P answering `expired` is `gone` (prefilled here), P handing nothing over is
`refused` (the request ends: it is over on P), and a request that ends meanwhile stops its await within a slice
(`cancel`).
"""
from __future__ import annotations

import logging
import threading
import time
from contextlib import suppress

from pdserve.kv_transfer_config import LOOPBACK
from pdserve.request import Request
from pdserve.transfer.base import ConnectorMeta, FinishedTransfers, LoadJob, load_job
from pdserve.sched_output import cdiv
from pdserve.transfer.channel.handoffs import AWAIT_KV, SLICE, WAIT_SECONDS, read_params
from pdserve.transfer.channel.leases import LeaseKeeper, ask_renew, prompt_hash, send_done
from pdserve.transfer.channel.peer_workers import PeerWorkers, peer_of
from pdserve.transfer.channel.protocol import TIMEOUTS, LeaseGone, ProtocolError
from pdserve.transfer.channel.blocks import BLOCKS_PER_READ, KVBlocks, TransferStats
from pdserve.transfer.channel.pool import SessionPool

logger = logging.getLogger("pdserve.transfer")
SHUTDOWN_GRACE = 2.0  # s a stopping D gives its queued `done`s (and loads) before dropping them
AWAITS_PER_PEER = 16  # awaits at once per P: each holds its worker for P's queue and prefill


class HandedNothing(ProtocolError):
    """P's request ended without handing anything over (its first token ended it, it failed): so does D's."""


PENDING = object()  # an await P answered `pending`: ask again


class TcpConsumer:
    def __init__(self, config, token: bytes, compat: dict, block_size: int, blocks: KVBlocks, stats: TransferStats):
        self.config, self.block_size, self.blocks, self.stats = config, block_size, blocks, stats
        self.pool = SessionPool(token, compat, config.tls_client_context(), wait_timeout=config.kv_transfer_timeout,
                                max_idle=float(config.kv_connector_extra_config.get("session_idle_seconds", 60.0)) / 2)
        self._lock = threading.Lock()
        self._queued: list[LoadJob] = []  # engine thread only
        self._inflight: set[str] = set()
        self._done: set[str] = set()
        self._failed: dict[str, str] = {}
        self._gone: set[str] = set()  # loads P answered `expired` (LeaseGone)
        self._params: dict[str, tuple[dict, float]] = {}  # awaited loads' params, and when they came
        self._refused: dict[str, str] = {}  # awaits P answered with nothing to hand over
        self._cancelled: set[str] = set()  # awaits whose request ended: they stop at their next slice
        self._ended = threading.Event()  # a load ended since the engine last took them (wakes an idle engine)
        self._loaders = PeerWorkers(4, "kv-load")  # a hung P holds only its own requests' workers
        self._awaiters = PeerWorkers(AWAITS_PER_PEER, "kv-await")
        self.keeper = LeaseKeeper(config.kv_lease_seconds, self.check_remote,
                                  lambda fn, req: self._loaders.submit(peer_of(req.kv_transfer_params), fn, req))

    def peer_allowed(self, host: str, port: int) -> bool:
        peers = self.config.kv_peers
        return f"{host}:{port}" in peers if peers else host in LOOPBACK

    def _peer(self, params: dict) -> tuple[str, int]:
        """(host, port) of the producer `params` name, if this side may dial it; else ValueError."""
        try:
            host, port = str(params["remote_host"]), int(params["remote_port"])
        except (KeyError, TypeError, ValueError):
            raise ValueError("kv_transfer_params name no KV endpoint (remote_host, remote_port)") from None
        if not self.peer_allowed(host, port):
            raise ValueError(f"KV peer {host}:{port} is not in kv_peers")
        return host, port

    def check_remote(self, params: dict) -> float:
        """Seconds P still holds the lease `params` name (asking extends it, as a `renew`); 0.0 when P answers it
        has no such live lease. Raises ValueError for a peer outside kv_peers, and ConnectionError, ProtocolError
        or TimeoutError (within kv_transfer_timeout) when P cannot be asked. Thread-safe."""
        host, port = self._peer(params)
        tid = str(params.get("transfer_id") or "")
        if not tid:
            raise ValueError("kv_transfer_params name no transfer_id")
        until = time.monotonic() + self.config.kv_transfer_timeout
        return self.pool.call(host, port, until, lambda session: ask_renew(session, tid))

    def release_remote(self, params: dict, request_id: str) -> bool:
        """A bare `done` now for remote-prefill `params` this side will never load (the request was refused with a
        400 or 503, or aborted before its load was asked for), so P's lease ends at once rather than at expiry. The
        caller has checked the router's proof; only a peer in `kv_peers` is dialed. True if the `done` is on its way."""
        if not params.get("transfer_id"):
            return False
        try:
            self._peer(params)
        except ValueError as e:
            logger.warning("request %s: not releasing the producer's lease: %s", request_id, e)
            return False
        self.start_load_kv(ConnectorMeta([LoadJob(request_id, dict(params), 0, [])]))
        return True

    def _await_peer(self, spec) -> tuple[str, int]:
        if not isinstance(spec, dict):
            raise ValueError(f"{AWAIT_KV}: not an object")
        return self._peer({"remote_host": spec.get("host"), "remote_port": spec.get("port")})

    def get_num_new_matched_tokens(self, req: Request, num_local_computed: int) -> int:
        p = req.kv_transfer_params or {}
        if not p.get("do_remote_prefill"):
            return 0
        if AWAIT_KV in p:  # nothing to check before P's params come: the engine checks them then
            try:
                self._await_peer(p[AWAIT_KV])
            except ValueError as e:
                self.stats.count("rejected")
                logger.warning("request %s: not awaiting remote KV: %s", req.request_id, e)
                return 0
            return max(req.num_importable_tokens - num_local_computed, 0)
        n = req.num_prompt_tokens
        why, peer_ok = None, self.peer_allowed(str(p.get("remote_host")), int(p.get("remote_port", -1)))
        if not peer_ok:
            why = f"KV peer {p.get('remote_host')}:{p.get('remote_port')} is not in kv_peers"
        elif p.get("num_prompt_tokens") != n or p.get("prompt_hash") != prompt_hash(req.prompt_token_ids):
            why = "prompt hash mismatch (different tokenization on P and D)"
        if why:
            self.stats.count("rejected")
            logger.warning("request %s: not loading remote KV: %s", req.request_id, why)
            if peer_ok:  # a peer this side may dial: tell it to free the lease now (never dial one outside kv_peers)
                self._queued.append(LoadJob(req.request_id, dict(p), 0, []))
            return 0
        m = req.num_importable_tokens
        if num_local_computed >= m:  # all cached here: nothing to pull, but P must hear `done` to free its
            self._queued.append(LoadJob(req.request_id, dict(p), 0, []))  # lease now, not at expiry (as vLLM's Nixl)
            return 0
        return m - num_local_computed

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
            if AWAIT_KV in job.params:
                spec = job.params[AWAIT_KV]
                self._awaiters.submit(f"{spec.get('host')}:{spec.get('port')}", self._await, job, time.monotonic())
            else:
                self._loaders.submit(peer_of(job.params), self._pull, job, time.monotonic())

    def cancel(self, request_id: str) -> None:
        """The request ended while its load runs: an await stops at its next slice (a pull runs to its end)."""
        with self._lock:
            if request_id in self._inflight:
                self._cancelled.add(request_id)

    def _await(self, job: LoadJob, queued: float) -> None:
        """An awaited load: P's params and KV once P posts them (channel/handoffs.py), asked a slice at a time until
        WAIT_SECONDS from `queued`, or until the request ends."""
        rid, until = job.request_id, queued + WAIT_SECONDS
        try:
            host, port = self._await_peer(job.params[AWAIT_KV])
            got = PENDING
            while got is PENDING:
                with self._lock:
                    if rid in self._cancelled:
                        raise InterruptedError("the request ended while it awaited the prefill node's params")
                now = time.monotonic()
                if now >= until:
                    raise TimeoutError(f"the prefill node posted no params within {WAIT_SECONDS:.0f} s")
                wait = min(SLICE, until - now)
                got = self.pool.call(host, port, now + wait + self.config.kv_transfer_timeout,
                                     lambda session: self._await_once(session, job, wait))
            with self._lock:
                self._done.add(rid)
                self._params[rid] = got
            with self.stats.lock:  # from P's params on: the wait for P's prefill is not receiving
                self.stats.seconds_receiving += time.monotonic() - got[1]
        except HandedNothing as e:  # P's request is over: the router has P's answer, D's request ends too
            logger.info("request %s: %s", rid, e)
            with self._lock:
                self._refused[rid] = str(e)
        except LeaseGone as e:  # the client did nothing wrong: prefilled here
            self.stats.count("lease_gone")
            logger.info("request %s: %s: prefilling it here", rid, e)
            with self._lock:
                self._gone.add(rid)
        except ConnectionRefusedError as e:  # P's KV endpoint as D's server last learnt it: P restarted elsewhere?
            self.stats.count("await_refused")
            logger.info("request %s: the prefill node's KV server refused the await (%s): prefilling it here", rid, e)
            with self._lock:
                self._gone.add(rid)
        except Exception as e:
            cause = "timeout" if isinstance(e, TIMEOUTS) else type(e).__name__
            if not isinstance(e, InterruptedError):
                self.stats.count(cause)
                logger.warning("request %s: awaited KV load failed (%s): %s", rid, cause, e)
            with self._lock:
                self._failed[rid] = f"awaited KV load failed ({cause}): {e}"
            params = getattr(e, "handoff_params", None)
            if params:  # broken after P's params came: a bare `done` on a fresh session frees its lease now
                with suppress(RuntimeError):  # shut down meanwhile
                    self._loaders.submit(peer_of(params), self._pull, LoadJob(rid, params, 0, []), time.monotonic())
        finally:
            with self._lock:
                self._inflight.discard(rid)
                self._cancelled.discard(rid)
            self._ended.set()

    def _await_once(self, session, job: LoadJob, wait: float):
        """One `await`: PENDING, or (P's params, when they came) with the KV received into the job's blocks."""
        spec, dst = job.params[AWAIT_KV], job.dst_blocks
        session.send({"op": "await", "key": spec["key"], "start": job.src_start, "count": len(dst), "wait": wait})
        header, views = session.recv()
        status = header.get("status")
        if status == "pending":
            return PENDING
        if status == "none":
            raise HandedNothing(f"the prefill node handed nothing over: {header.get('reason') or 'no reason'}")
        if status == "expired":
            raise LeaseGone("the prefill node no longer holds the KV it posted")
        if status != "ok":
            raise ProtocolError(f"producer answered {status!r} to an await")
        at, params = time.monotonic(), read_params(views)
        count = header.get("count")
        first = job.src_start
        n = params.get("num_prompt_tokens")
        needed = cdiv(n - (0 if "first_token" in params else 1), self.block_size) - first if isinstance(n, int) else -1
        if not isinstance(count, int) or not 0 <= needed <= count <= len(dst):
            raise ProtocolError(f"producer sends {count!r} blocks for an await of {len(dst)} from block {first}, "
                                f"whose params need {needed}")
        try:
            for i in range(0, count, BLOCKS_PER_READ):
                batch = dst[i:min(i + BLOCKS_PER_READ, count)]
                into = self.blocks.receive_into(batch)
                h, _ = session.recv(into=into)
                if h.get("status") != "ok" or h.get("count") != len(batch):
                    raise ProtocolError(f"producer answered {h.get('status')!r} within an await")
                self.blocks.finish_receive(batch, into)
                with self.stats.lock:
                    self.stats.bytes_received += len(batch) * self.blocks.bytes_per_block
        except Exception as e:
            e.handoff_params = params  # the lease P may still hold: `_await` tells it `done`
            raise
        return params, at

    def _pull(self, job: LoadJob, queued: float) -> None:
        """A load, or with no `dst_blocks` a bare `done` that only releases P's lease. Either has
        kv_transfer_timeout from `queued` in all (time spent waiting for a worker counts)."""
        p, t0, bare = job.params, time.monotonic(), not job.dst_blocks
        try:
            host, port = self._peer(p)
            self.pool.call(host, port, queued + self.config.kv_transfer_timeout, lambda s: self._transfer(s, job))
            if not bare:  # a bare done is nobody's load: the request already prefills here
                with self._lock:
                    self._done.add(job.request_id)
        except LeaseGone as e:
            if not bare:  # nothing left on P to release
                self.stats.count("lease_gone")
                logger.info("request %s: %s: prefilling it here", job.request_id, e)
                with self._lock:
                    self._gone.add(job.request_id)
        except Exception as e:
            cause = "timeout" if isinstance(e, TIMEOUTS) else type(e).__name__
            if bare:  # P frees the lease at expiry instead
                logger.info("request %s: could not release the producer's lease (%s): %s", job.request_id, cause, e)
            else:  # every failed load ends in the scheduler's failure policy
                self.stats.count(cause)
                logger.warning("request %s: KV load failed (%s): %s", job.request_id, cause, e)
                with self._lock:
                    self._failed[job.request_id] = f"KV load failed ({cause}): {e}"
                # the request no longer needs P's KV either way (recomputed here, or failed): a bare `done` on a
                # fresh session frees the lease now, if P is there to hear it, rather than at its expiry
                with suppress(RuntimeError):  # shut down meanwhile
                    self._loaders.submit(peer_of(p), self._pull, LoadJob(job.request_id, p, 0, []), time.monotonic())
        finally:
            with self.stats.lock:
                self.stats.seconds_receiving += 0.0 if bare else time.monotonic() - t0
            with self._lock:
                self._inflight.discard(job.request_id)
            self._ended.set()

    def _transfer(self, session, job: LoadJob) -> None:
        """Every read goes out first, so P sends the next batch while this side receives the previous one; the last
        read carries `done` (P ends the lease once it has sent that batch; a session broken before then leaves the
        lease to expire). Safe to redo from the start (SessionPool.call)."""
        tid = job.params["transfer_id"]
        batches = [job.dst_blocks[i:i + BLOCKS_PER_READ] for i in range(0, len(job.dst_blocks), BLOCKS_PER_READ)]
        if not batches:
            return send_done(session, tid)
        for i, dst in enumerate(batches):
            last = {"done": True} if i == len(batches) - 1 else {}
            session.send({"op": "read", "transfer_id": tid, "start": job.src_start + i * BLOCKS_PER_READ,
                          "count": len(dst), **last})
        for dst in batches:
            # Straight into the request's own blocks; if the frame then fails authentication, the load fails and
            # the scheduler drops these blocks unpublished.
            into = self.blocks.receive_into(dst)
            header, _ = session.recv(into=into)
            if header.get("status") == "expired":
                raise LeaseGone(f"the producer no longer holds the KV of transfer {tid}")
            if header.get("status") != "ok" or header.get("count") != len(dst):
                raise ProtocolError(f"producer answered {header.get('status')!r} for transfer {tid}")
            self.blocks.finish_receive(dst, into)
            with self.stats.lock:
                self.stats.bytes_received += len(dst) * self.blocks.bytes_per_block

    def lease_time_left(self, req: Request) -> float:
        if AWAIT_KV in (req.kv_transfer_params or {}):  # no lease yet: the await's own wait
            return req.arrival_time + WAIT_SECONDS - time.monotonic()
        return self.keeper.time_left(req)

    def watch_lease(self, req: Request) -> None:
        p = req.kv_transfer_params
        try:
            ok = p.get("transfer_id") and self._peer(p)
        except (ValueError, AttributeError):
            ok = False
        if ok:
            self.keeper.watch(req)

    def request_abandoned(self, req: Request) -> None:
        if (req.kv_transfer_params or {}).get("do_remote_prefill"):  # verified when the request was added
            self.release_remote(req.kv_transfer_params, req.request_id)

    def take_finished(self, out: FinishedTransfers) -> None:
        """Engine thread: the loads that ended since the last call, into `out`."""
        self._ended.clear()  # before taking: a load that ends after this sets it again
        with self._lock:
            out.done_recving, self._done = self._done, set()
            out.failed, self._failed = self._failed, {}
            out.gone, self._gone = self._gone, set()
            out.params, self._params = self._params, {}
            out.refused, self._refused = self._refused, {}

    def wait_for_transfers(self, timeout: float) -> None:
        self._ended.wait(timeout)

    def has_pending(self) -> bool:
        with self._lock:
            return bool(self._inflight or self._done or self._failed or self._gone or self._queued or self._refused or
                        self._params)

    def shutdown(self) -> None:
        with self._lock:
            self._cancelled |= self._inflight  # awaits stop at their next slice
        self._awaiters.shutdown()
        self._loaders.shutdown(grace=SHUTDOWN_GRACE)
        self.pool.close()
