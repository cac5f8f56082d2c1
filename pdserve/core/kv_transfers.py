"""The scheduler's P/D half, an object that owns its state: requests parked while their prompt KV loads, loaded
requests waiting for a seat, finished transfers applied, and blocks kept for a remote reader or a load still writing.

A decode node's (D) request with remote-prefill params:
1. `watch` (at add): the connector keeps P's lease alive while the request queues;
2. `start_load` (at admission): blocks for the loadable tokens, the replay's token and its lookahead slots; the
   request is parked in `loading` (WAITING_FOR_REMOTE_KV: no seat, no token budget); short of blocks while P's lease
   lasts it waits at the queue's head ("blocked"); otherwise it prefills locally;
3. `process` (each step, the connector's `FinishedTransfers`): a loaded request goes to `ready` (its replay, or
   with P's first token its first decode, takes a seat next); a failed one is recomputed locally (handed back to
   requeue) or failed, by the failure policy; one P no longer held the KV for (`gone`: P answered `expired`) is
   recomputed locally whatever the policy, and an await P handed nothing to (`refused`) fails whatever it; a load
   that cannot be stopped and is overdue (`overdue`) lets its request go on while its blocks stay held under a
   stand-in id until the load `ended`;
4. `finish`: a request finished while loading leaves its blocks in `deferred_free` until its load reports.
A prefill node's (P) finished request whose blocks the connector keeps for a reader sits in `leased` until the
connector reports it `done_sending` (read, released or expired).
Invariant: every block a transfer may still read or write is owned by an entry here, never by the free pool.

Reclamation is a contract: blocks held with no live request behind them (P: a lease that ended or expired but is
not freed yet; D: `deferred_free`, blocks a load no live request owns may still write) are *orphaned*
(`orphaned_blocks`, 0 at rest), and how long each such hold lasted until its blocks were freed is observed in
`reclaim` (a histogram), so a leak or a slow reclaim shows in /metrics before the pool runs dry.
"""
from __future__ import annotations

import bisect
import time
import uuid
from collections import deque
from types import SimpleNamespace
from typing import Callable, Optional

from pdserve.core.kv_cache_manager import KVCacheManager
from pdserve.request import Request, RequestStatus


def _unsigned(params: dict) -> dict:
    return params


RECLAIM_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class ReclaimTimes:
    """A histogram of reclaim times (seconds from when blocks were held for no one to their free); engine thread."""

    def __init__(self):
        self.counts = [0] * (len(RECLAIM_BUCKETS) + 1)  # the last: over every bound
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        seconds = max(seconds, 0.0)
        self.counts[bisect.bisect_left(RECLAIM_BUCKETS, seconds)] += 1  # Prometheus buckets hold values <= le
        self.sum += seconds

    def snapshot(self) -> dict:
        """{"buckets": [(le, cumulative count)], "count", "sum"} (the +Inf bucket is `count`)."""
        cum, acc = [], 0
        for c in self.counts[:-1]:
            acc += c
            cum.append(acc)
        return {"buckets": list(zip(RECLAIM_BUCKETS, cum)), "count": sum(self.counts), "sum": self.sum}


class KVTransfers:
    def __init__(self, kv: KVCacheManager, connector=None, load_failure_policy: str = "recompute",
                 sign: Callable[[dict], dict] = _unsigned):
        self.kv = kv
        self.connector = connector
        self.load_failure_policy = load_failure_policy
        self.sign = sign  # P vouches for the params it hands out (the engine's KV gateway signs them)
        self.loading: dict[str, Request] = {}  # D: WAITING_FOR_REMOTE_KV, its blocks being filled from P
        self.ready: deque[Request] = deque()  # D: holding imported KV, waiting for a seat for its replay
        self.leased: dict[str, Request] = {}  # P: finished, blocks kept until D read them or the lease ended
        self.deferred_free: dict[str, Request] = {}  # D: finished (or stood in for) while a load still writes
        self.held: dict[str, deque[str]] = {}  # D: request id -> stand-in ids of its overdue loads' blocks
        self._orphaned_at: dict[str, float] = {}  # D: deferred_free id -> when its request left (or stood in)
        self.reclaim = ReclaimTimes()

    def watch(self, req: Request) -> None:
        if req.kv_load_tried:
            return
        if self.connector is not None and (req.kv_transfer_params or {}).get("do_remote_prefill"):
            self.connector.watch_lease(req)  # kept alive while it queues, wherever it is in the queue

    def start_load(self, req: Request, hits: list[int], num_hit: int, num_lookahead: int) -> Optional[str]:
        """P/D consumer: allocate blocks for the prompt KV a connector can load and park the request in `loading`
        until the load ends: "loading". "blocked": no blocks for it yet, but the producer's lease lasts, so the
        request waits and asks again next step. None: prefill locally."""
        if self.connector is None or req.kv_transfer_params is None or req.kv_load_tried:
            return None
        num_external = self.connector.get_num_new_matched_tokens(req, num_hit)
        if num_external <= 0:
            req.kv_load_tried = True
            return None
        # The replay's slot comes with the load: a load for exactly k blocks whose replay then needed block k + 1
        # could wait forever once waiting imports held every block (they take no seat and are never preempted).
        alive = self.connector.lease_time_left(req) > 0  # a request that queued past its lease is not pulled
        if not alive or not self.kv.allocate_slots(req, num_external + 1 + num_lookahead, hits):
            if alive:
                return "blocked"
            # The lease ran out while blocks were short: prefill locally. No blocks to fill tells the connector
            # to let the producer release it now (vLLM's update_state_after_alloc with none external).
            req.kv_load_tried = True
            self.connector.update_state_after_alloc(req, [], num_hit)
            return None
        req.kv_load_tried = True
        req.num_computed_tokens = num_hit
        req.num_cached_tokens = num_hit
        req.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self.loading[req.request_id] = req
        self.connector.update_state_after_alloc(req, self.kv.blocks_of(req.request_id), num_hit)
        return "loading"

    def process(self, fin) -> tuple[list[Request], list[tuple[Request, str]]]:
        """Apply finished transfers: release P's leases; on D, a loaded request becomes its one-token replay, a
        failed one is recomputed locally or fails. Returns (requests to prefill locally, each put at the queue's front
        in turn; (request, why) to fail): the scheduler's queues are the scheduler's."""
        now = time.monotonic()
        # Finished transfers come as sets; they are applied in the order the leases and loads began (these dicts'
        # order), so what a step schedules next (and which freed blocks are evicted first) never hangs on hashing.
        for rid in [r for r in self.leased if r in fin.done_sending] if fin.done_sending else ():
            req = self.leased.pop(rid, None)
            if req is not None:
                self.kv.free(req)
                self.reclaim.observe(now - fin.released_at.get(rid, now))
        failed_loads = {**fin.failed, **fin.refused}
        for rid, why in fin.overdue.items():
            held = self._hold(rid)
            if held is not None:
                self.held.setdefault(rid, deque()).append(held)
                if held != rid:  # the request goes on (its failure policy) without the blocks the load may write
                    failed_loads[rid] = why
        for rid in fin.ended:  # an overdue load is over: the blocks it held may be reused
            standins = self.held.get(rid)
            if standins:
                held = standins.popleft()
                if not standins:
                    del self.held[rid]
                failed_loads.setdefault(held, "the overdue load ended")
        recompute, failed = [], []
        ended = fin.done_recving | set(failed_loads) | fin.gone
        for rid in dict.fromkeys(r for r in (*self.deferred_free, *self.loading) if r in ended) if ended else ():
            if rid in self.deferred_free:
                self.kv.free(self.deferred_free.pop(rid))
                self.reclaim.observe(now - self._orphaned_at.pop(rid, now))
                continue
            req = self.loading.pop(rid, None)
            if req is None:
                continue
            req.status = RequestStatus.WAITING
            if rid in fin.done_recving:
                req.num_computed_tokens = req.num_importable_tokens
                req.num_external_tokens = req.num_computed_tokens - req.num_cached_tokens
                self.kv.cache_blocks(req)  # authenticated and complete: safe to share
                self.ready.append(req)
            elif (self.load_failure_policy == "recompute" and rid not in fin.refused) or rid in fin.gone:
                # The partly written blocks are dropped, never published; the prompt is prefilled here, in the
                # queue's front (it came before whatever arrived while it loaded). A lease gone (LeaseGone) is
                # nobody's failure: prefilled here whatever the policy.
                self.kv.free(req)
                req.num_computed_tokens = 0
                recompute.append(req)
            else:
                failed.append((req, failed_loads[rid]))
        return recompute, failed

    def _hold(self, request_id: str) -> Optional[str]:
        """D: keep the blocks a load of `request_id` may still write out of use, under an id of their own, while the
        request goes on without them: for a load that cannot be stopped (a posted one-sided read). Returns the id:
        the request's own when it finished while loading (its deferred_free entry holds them already), a new
        stand-in `<request_id>#held-<hex>` while it waits for the load; None when no load of it holds blocks."""
        if request_id in self.deferred_free:
            return request_id
        if request_id not in self.loading:
            return None
        standin = f"{request_id}#held-{uuid.uuid4().hex[:8]}"
        self.kv.req_blocks[standin] = self.kv.req_blocks.pop(request_id, [])
        self.deferred_free[standin] = SimpleNamespace(request_id=standin)  # all kv.free reads of a request
        self._orphaned_at[standin] = time.monotonic()
        return standin

    def finish(self, req: Request, status: RequestStatus, was_loading: bool) -> None:
        """`req` left the scheduler's queues as `status`: hand its blocks to a remote reader (P), keep them from a
        load still writing (D), or free them."""
        keep = False
        if self.connector is not None and status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH):
            keep, out = self.connector.request_finished(req, self.kv.blocks_of(req.request_id))
            req.kv_transfer_params_out = self.sign(out) if out else out  # D checks this proof, whoever relays it
        if self.connector is not None and (req.kv_transfer_params or {}).get("do_remote_prefill") and \
                not req.kv_load_tried:
            # e.g. aborted while short of blocks for its load, or P's first token stopped it at admission
            self.connector.request_abandoned(req)
        if keep:
            self.leased[req.request_id] = req
        elif was_loading:  # a loader thread may still write these blocks: free them when it reports
            self.connector.cancel_load(req.request_id)  # an await stops soon; a pull runs to its end
            self.deferred_free[req.request_id] = req
            self._orphaned_at[req.request_id] = time.monotonic()
        else:
            self.kv.free(req)

    def drop_all(self) -> None:
        """The engine is dead and its connector shut down (no reader, no loader left): free what leases and loads
        held, so the pool is whole for whoever inspects it."""
        for owner in list(self.leased.values()) + list(self.deferred_free.values()):
            self.kv.free(owner)
        self.leased.clear()
        self.deferred_free.clear()
        self._orphaned_at.clear()
        self.held.clear()

    def take(self, req: Request) -> bool:
        """Take `req` off `loading` or `ready` (it is finishing); False when it is in neither."""
        if self.loading.pop(req.request_id, None) is not None:
            return True
        if req in self.ready:
            self.ready.remove(req)
            return True
        return False

    def holds(self, request_id: str) -> bool:
        """Blocks are still held under this id (leased to a reader, or a load still writes them)."""
        return request_id in self.leased or request_id in self.deferred_free

    def num_leased_blocks(self) -> int:
        return sum(len(self.kv.blocks_of(r)) for r in self.leased)

    def orphaned_blocks(self) -> int:
        """Blocks held with no live request behind them: P's leases that ended or expired but are not freed yet
        (pinned by a read in flight, or not reaped yet), D's blocks that a load may still write for a request that
        finished or went on without them. 0 at rest."""
        over = self.connector.orphaned_leases() if self.connector is not None and self.leased else {}
        return sum(len(self.kv.blocks_of(r)) for r in over if r in self.leased) + \
            sum(len(self.kv.blocks_of(r)) for r in self.deferred_free)

    def reclaim_stats(self) -> dict:
        """/metrics: the orphaned blocks now and the reclaim-time histogram."""
        return {"orphaned_blocks": self.orphaned_blocks(), "reclaim_seconds": self.reclaim.snapshot()}

    @property
    def num_waiting(self) -> int:
        return len(self.ready) + len(self.loading)

    def owners(self) -> set[str]:
        """Ids of the block lists this half accounts for."""
        return {r.request_id for r in self.ready} | set(self.loading) | set(self.leased) | set(self.deferred_free)

    def check_invariants(self) -> None:
        assert all(r.status == RequestStatus.WAITING_FOR_REMOTE_KV for r in self.loading.values())
        assert all(r.num_computed_tokens > 0 and r.status == RequestStatus.WAITING for r in self.ready)
        assert all(s in self.deferred_free for q in self.held.values() for s in q if "#held-" in s)
        assert self._orphaned_at.keys() == self.deferred_free.keys(), "a deferred free without its start time"
