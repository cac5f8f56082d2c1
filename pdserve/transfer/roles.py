"""A connector made of a producer role (P: leases, KV server) and a consumer role (D: checks, loads, lease
keeping), either or both present by `kv_role`: the delegation both transports share. A subclass sets `producer`,
`consumer`, `lease_table` and `stats`, and says which params are its own (`owns`: a MultiConnector asks every
child, so a child must leave params another transport made alone)."""
from __future__ import annotations

from typing import Optional

from pdserve.request import Request
from pdserve.transfer.base import ConnectorMeta, KVConnector
from pdserve.transfer.channel.leases import Lease


class RoleConnector(KVConnector):
    producer = None
    consumer = None

    def owns(self, params) -> bool:
        return True

    @property
    def leases(self) -> dict[str, Lease]:
        return self.lease_table.leases

    # ---- producer ------------------------------------------------------------------------------------------
    def request_finished(self, req: Request, block_ids: list[int]) -> tuple[bool, Optional[dict]]:
        if self.producer is None:  # consumer only: no KV server that a decoder could read these blocks from
            return False, None
        return self.producer.request_finished(req, block_ids)

    def transfer_stats(self) -> Optional[dict]:
        with self.stats.lock:  # a loader thread adding a failure cause mid-copy would break the copy
            st = self.stats
            out = {"bytes_sent": st.bytes_sent, "bytes_received": st.bytes_received,
                   "seconds_receiving": st.seconds_receiving, "failures": dict(st.failures)}
        return {**out, "nixl": self.nixl_stats()}

    def nixl_stats(self) -> dict:
        """vLLM's NIXL series (NixlConnector's); {} for other transports."""
        return {}

    def leased_blocks(self) -> int:
        return self.lease_table.num_blocks()

    def orphaned_leases(self) -> dict[str, float]:
        return self.lease_table.orphans()

    def release_lease(self, tid: str, request_id: str) -> bool:
        """P: end the open lease `tid` (of request `request_id`) now, as D's `done` would: the router's call,
        through P's `POST /v1/kv/release`, for params no decode node took. False when no such lease is open (never
        made here, made for another request, already released, or expired: a repeat is harmless); a lease a reader
        has claimed stays pinned until it is done."""
        return self.lease_table.release(tid, request_id)

    # ---- consumer ------------------------------------------------------------------------------------------
    def _d(self):
        if self.consumer is None:
            raise RuntimeError(f"this {type(self).__name__} is kv_producer: it reads from no producer")
        return self.consumer

    def peer_allowed(self, host: str, port: int) -> bool:
        return self._d().peer_allowed(host, port)

    def check_remote(self, params: dict) -> float:
        return self._d().check_remote(params)

    def release_remote(self, params: dict, request_id: str) -> bool:
        return self.consumer is not None and self.consumer.release_remote(params, request_id)

    def get_num_new_matched_tokens(self, req: Request, num_local_computed: int) -> int:
        # a producer loads nothing (remote-prefill params sent here prefill locally)
        if self.consumer is None or not self.owns(req.kv_transfer_params):
            return 0
        return self.consumer.get_num_new_matched_tokens(req, num_local_computed)

    def update_state_after_alloc(self, req: Request, block_ids: list[int], num_local_computed: int) -> None:
        self._d().update_state_after_alloc(req, block_ids, num_local_computed)

    def build_connector_meta(self) -> ConnectorMeta:
        return self.consumer.build_connector_meta() if self.consumer is not None else ConnectorMeta()

    def start_load_kv(self, meta: ConnectorMeta) -> None:
        if meta.loads:
            self._d().start_load_kv(meta)

    def lease_time_left(self, req: Request) -> float:
        return self.consumer.lease_time_left(req) if self.consumer is not None else 0.0

    def watch_lease(self, req: Request) -> None:
        if self.consumer is not None and self.owns(req.kv_transfer_params):
            self.consumer.watch_lease(req)

    def request_abandoned(self, req: Request) -> None:
        if self.consumer is not None and self.owns(req.kv_transfer_params):
            self.consumer.request_abandoned(req)

    # ---- both ----------------------------------------------------------------------------------------------
    def has_pending(self) -> bool:
        return bool(self.lease_table) or (self.consumer is not None and self.consumer.has_pending())

    def shutdown(self) -> None:
        for role in (self.producer, self.consumer):
            if role is not None:
                role.shutdown()
