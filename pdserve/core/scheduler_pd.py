"""The scheduler's P/D half (a mixin of `Scheduler`): a consumer's requests parked while their prompt KV loads,
finished transfers applied (leases ended on P; loaded, failed or recomputed requests on D), and blocks a load that
cannot be stopped may still write kept out of use. The step these take part in is in scheduler.py's docstring."""
from __future__ import annotations

import uuid
from types import SimpleNamespace
from typing import Optional

from pdserve.request import Request, RequestStatus


class SchedulerPDMixin:
    """Works on the Scheduler's kv, connector, waiting, ready, loading, leased, deferred_free and
    load_failure_policy, with its num_lookahead and finish_request; it holds no state of its own."""

    def _start_remote_load(self, req: Request, hits: list[int], num_hit: int) -> Optional[str]:
        """P/D consumer: allocate blocks for the prompt KV a connector can load and park the request in
        WAITING_FOR_REMOTE_KV (no token budget, no seat) until the load ends: "loading". "blocked": no blocks for
        it yet, but the producer's lease lasts, so the request waits and asks again next step. None: prefill
        locally."""
        if self.connector is None or req.kv_transfer_params is None or req.kv_load_tried:
            return None
        num_external = self.connector.get_num_new_matched_tokens(req, num_hit)
        if num_external <= 0:
            req.kv_load_tried = True
            return None
        # The replay's slot comes with the load: a load for exactly k blocks whose replay then needed block k + 1
        # could wait forever once waiting imports held every block (they take no seat and are never preempted).
        alive = self.connector.lease_time_left(req) > 0  # a request that queued past its lease is not pulled
        if not alive or not self.kv.allocate_slots(req, num_external + 1 + self.num_lookahead(req), hits):
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
        self.connector.update_state_after_alloc(req, self.kv.blocks_of(req.request_id), num_hit)
        return "loading"

    def process_transfers(self, fin) -> list[Request]:
        """Apply finished transfers: release P's leases; on D, a loaded request becomes its one-token replay, a
        failed one is recomputed locally or fails. Returns the requests that failed."""
        for rid in fin.done_sending:
            req = self.leased.pop(rid, None)
            if req is not None:
                self.kv.free(req)
        failed = []
        for rid in fin.done_recving | set(fin.failed):
            if rid in self.deferred_free:
                self.kv.free(self.deferred_free.pop(rid))
                continue
            req = self.loading.pop(rid, None)
            if req is None:
                continue
            req.status = RequestStatus.WAITING
            if rid in fin.done_recving:
                req.num_computed_tokens = req.num_prompt_tokens - 1
                req.num_external_tokens = req.num_computed_tokens - req.num_cached_tokens
                self.kv.cache_blocks(req)  # authenticated and complete: safe to share
                self.ready.append(req)
            elif self.load_failure_policy == "recompute":
                # The partly written blocks are dropped, never published; the prompt is prefilled here, in the
                # queue's front (it came before whatever arrived while it loaded).
                req.kv_load_error = fin.failed[rid]
                self.kv.free(req)
                req.num_computed_tokens = 0
                self.waiting.appendleft(req)
            else:
                self.waiting.appendleft(req)  # finish_request takes it from there
                failed.append(self.finish_request(rid, RequestStatus.FINISHED_ERROR, fin.failed[rid]))
        return failed

    def hold_blocks(self, request_id: str, label: str) -> Optional[str]:
        """D: keep the blocks a load of `request_id` may still write out of use, under an id of their own, while the
        request goes on (its failure policy) without them: for a load that cannot be stopped (a posted one-sided
        read). They are freed when a finished transfer reports that id (`process_transfers`), which the caller
        does once the load has ended. Returns the id: the request's own when it finished while loading (its
        deferred_free entry holds them already), a new stand-in `<request_id>#<label>-<hex>` while it waits for
        the load; None when it is neither (no load of it holds blocks)."""
        if request_id in self.deferred_free:
            return request_id
        if request_id not in self.loading:
            return None
        standin = f"{request_id}#{label}-{uuid.uuid4().hex[:8]}"
        self.kv.req_blocks[standin] = self.kv.req_blocks.pop(request_id, [])
        self.deferred_free[standin] = SimpleNamespace(request_id=standin)  # all kv.free reads of a request
        return standin
