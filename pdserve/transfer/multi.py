"""MultiConnector: loads from the first child that can supply the tokens, hands finished requests to all. A finished
request whose blocks several children keep is freed only when every one of them has let go: one child's lease
ending must not free blocks another child's reader may still be reading. The response carries one set of params,
the first child's that made any, so a later child's lease on the same request could never be read: it is ended at
once (one lease per request, not one per child, each pinning the blocks for kv_lease_seconds). The gateway's
optional calls fan out to every child."""
from __future__ import annotations

import time
from typing import Optional

from pdserve.request import Request
from pdserve.transfer.base import ConnectorContext, ConnectorMeta, FinishedTransfers, KVConnector, merge_stats
from pdserve.transfer.factory import connector_class


class MultiConnector(KVConnector):
    def __init__(self, config, ctx: Optional[ConnectorContext]):
        super().__init__(config, ctx)
        self.children = [connector_class(c.kv_connector)(c, ctx) for c in config.connectors]
        self._source: dict[str, KVConnector] = {}
        self._load_owner: dict[str, KVConnector] = {}
        self._keepers: dict[str, set[int]] = {}  # finished request id -> children (indices) still keeping its blocks

    def register_kv_caches(self, kv_caches: list) -> None:
        super().register_kv_caches(kv_caches)
        for c in self.children:
            c.register_kv_caches(kv_caches)

    def get_num_new_matched_tokens(self, req: Request, num_local_computed: int) -> int:
        for c in self.children:
            n = c.get_num_new_matched_tokens(req, num_local_computed)
            if n > 0:
                self._source[req.request_id] = c
                return n
        return 0

    def update_state_after_alloc(self, req: Request, block_ids: list[int], num_local_computed: int) -> None:
        self._source.pop(req.request_id).update_state_after_alloc(req, block_ids, num_local_computed)

    def lease_time_left(self, req: Request) -> float:
        c = self._source.get(req.request_id)
        return c.lease_time_left(req) if c is not None else 0.0

    def watch_lease(self, req: Request) -> None:
        for c in self.children:
            c.watch_lease(req)

    def request_abandoned(self, req: Request) -> None:
        c = self._source.pop(req.request_id, None)
        for child in [c] if c is not None else self.children:
            child.request_abandoned(req)

    def build_connector_meta(self) -> ConnectorMeta:
        loads, self._load_owner = [], {}
        for c in self.children:
            for job in c.build_connector_meta().loads:
                self._load_owner[job.request_id] = c
                loads.append(job)
        return ConnectorMeta(loads)

    def start_load_kv(self, meta: ConnectorMeta) -> None:
        for c in self.children:
            c.start_load_kv(ConnectorMeta([j for j in meta.loads if self._load_owner.get(j.request_id) is c]))

    def request_finished(self, req: Request, block_ids: list[int]) -> tuple[bool, Optional[dict]]:
        keepers, params = set(), None
        for i, c in enumerate(self.children):
            k, p = c.request_finished(req, block_ids)
            if k and p and params is not None and c.release_lease(str(p.get("transfer_id", "")), req.request_id):
                continue  # a second lease nobody is told of: ended now (its end, when reaped, frees nothing)
            if k:
                keepers.add(i)
            params = params or p
        if keepers:
            self._keepers[req.request_id] = keepers
        return bool(keepers), params

    def get_finished(self) -> FinishedTransfers:
        out = FinishedTransfers()
        for i, c in enumerate(self.children):
            f = c.get_finished()
            for rid in f.done_sending:
                keepers = self._keepers.get(rid)
                if keepers is None or i not in keepers:  # a lease ended at request_finished: not a keeper
                    continue
                keepers.discard(i)
                if not keepers:
                    del self._keepers[rid]
                    out.done_sending.add(rid)
                    out.released_at[rid] = f.released_at.get(rid, time.monotonic())  # the last keeper's end
            out.done_recving |= f.done_recving
            out.failed.update(f.failed)
            out.gone |= f.gone
            out.overdue.update(f.overdue)
            out.ended |= f.ended
            out.params.update(f.params)
            out.refused.update(f.refused)
        return out

    def handoff(self, key: str, params: Optional[dict], reason: str) -> None:
        for c in self.children:  # only a child with an await on its KV server keeps it
            c.handoff(key, params, reason)

    def orphaned_leases(self) -> dict[str, float]:
        """Requests every keeping child holds for no reader any more: since the last of them let go."""
        over = [c.orphaned_leases() for c in self.children]
        return {rid: max(over[i][rid] for i in keepers) for rid, keepers in self._keepers.items()
                if all(rid in over[i] for i in keepers)}

    def has_pending(self) -> bool:
        return any(c.has_pending() for c in self.children)

    def shutdown(self) -> None:
        for c in self.children:
            c.shutdown()

    # ---- the gateway's calls, fanned out ---------------------------------------------------------------------
    def check_remote(self, params: dict) -> float:
        return max(c.check_remote(params) for c in self.children)

    def release_remote(self, params: dict, request_id: str) -> bool:
        return any(c.release_remote(params, request_id) for c in self.children)

    def release_lease(self, transfer_id: str, request_id: str) -> Optional[bool]:
        answers = []
        for c in self.children:
            answers.append(c.release_lease(transfer_id, request_id))
            if answers[-1]:
                return True
        return None if all(a is None for a in answers) else False

    def transfer_stats(self) -> Optional[dict]:
        return merge_stats([c.transfer_stats() for c in self.children])
