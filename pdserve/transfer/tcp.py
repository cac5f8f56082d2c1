"""The default `tcp` KV transport: D pulls, P is passive (NIXL-shaped, so another transport can sit behind it).

`TcpConnector` composes the roles: a `TcpProducer` (tcp_producer.py: P's leases and KV server, with the producer
lifecycle of a request) and a `TcpConsumer` (tcp_consumer.py: D's checks, pulls and lease keeping, with the
consumer lifecycle), over the lease table (leases.py) and the authenticated, reused control channel
(tcp_channel.py, tcp_pool.py: one handshake per session, many transfers per session). `kv_both` runs both.
`kv_connector_extra_config.session_idle_seconds` (60) is how long P keeps an idle session; D reuses one for half.
"""
from __future__ import annotations

from typing import Optional

from pdserve.request import Request
from pdserve.transfer.base import ConnectorMeta, FinishedTransfers, KVConnector, register_connector
from pdserve.transfer.leases import Lease, LeaseTable, prompt_hash
from pdserve.transfer.tcp_blocks import BLOCKS_PER_READ, KVBlocks, TransferStats
from pdserve.transfer.tcp_consumer import TcpConsumer
from pdserve.transfer.tcp_producer import TcpProducer

__all__ = ["BLOCKS_PER_READ", "Lease", "TcpConnector", "TransferStats", "prompt_hash"]


NAME = "TcpConnector"


@register_connector(NAME)
class TcpConnector(KVConnector):
    def __init__(self, config, engine):
        super().__init__(config, engine)
        self.block_size = engine.config.cache.block_size
        self.token = config.auth_token().encode()
        self.compat = engine.compat_fields()
        self.stats = TransferStats()
        self.lease_table = LeaseTable(config.kv_lease_seconds)
        self.blocks = KVBlocks()
        self.producer: Optional[TcpProducer] = None
        self.consumer: Optional[TcpConsumer] = None
        if config.kv_role in ("kv_producer", "kv_both"):
            # `renew` answers through the connector's `_renew`, looked up per call, so the connector answers as one
            self.producer = TcpProducer(config, self.token, self.compat, self.block_size, self.lease_table,
                                        self.blocks, self.stats, renew=lambda tid: self._renew(tid))
            self.port = self.producer.port
        if config.kv_role in ("kv_consumer", "kv_both"):
            self.consumer = TcpConsumer(config, self.token, self.compat, self.block_size, self.blocks, self.stats)
            self.pool = self.consumer.pool

    @property
    def _lock(self):  # what the engine holds while it copies `stats`
        return self.stats.lock

    @property
    def leases(self) -> dict[str, Lease]:
        return self.lease_table.leases

    @property
    def bytes_per_block(self) -> int:
        return self.blocks.bytes_per_block

    @property
    def _flat(self):
        return self.blocks.flat

    @_flat.setter
    def _flat(self, flat) -> None:  # None: the staged path (gather on P, scatter on D) that caches off the CPU take
        self.blocks.flat = flat

    def register_kv_caches(self, kv_caches: list) -> None:
        super().register_kv_caches(kv_caches)
        self.blocks.register(kv_caches)

    # ---- producer ------------------------------------------------------------------------------------------
    def request_finished(self, req: Request, block_ids: list[int]) -> tuple[bool, Optional[dict]]:
        if self.producer is None:  # consumer only: no KV server that a decoder could read these blocks from
            return False, None
        return self.producer.request_finished(req, block_ids)

    def _renew(self, tid: str) -> float:
        """P's answer to D's `renew`: seconds left in the extended lease; 0 for an unknown, released or expired one."""
        return self.lease_table.renew(tid)

    def leased_blocks(self) -> int:
        return self.lease_table.num_blocks()

    def release_lease(self, tid: str, request_id: str) -> bool:
        """P: end the open lease `tid` (of request `request_id`) now, as D's `done` would. The router's call, through
        P's `POST /v1/kv/release`, for params no decode node took. False when no such lease is open: never made
        here, made for another request, already released, or expired (so a repeat is harmless)."""
        return self.lease_table.release(tid, request_id)

    # ---- consumer ------------------------------------------------------------------------------------------
    def _d(self) -> TcpConsumer:
        if self.consumer is None:
            raise RuntimeError("this TcpConnector is kv_producer: it reads from no producer")
        return self.consumer

    def peer_allowed(self, host: str, port: int) -> bool:
        return self._d().peer_allowed(host, port)

    def check_remote(self, params: dict) -> float:
        return self._d().check_remote(params)

    def release_remote(self, params: dict, request_id: str) -> bool:
        return self.consumer is not None and self.consumer.release_remote(params, request_id)

    def get_num_new_matched_tokens(self, req: Request, num_local_computed: int) -> int:
        # a producer loads nothing (remote-prefill params sent here prefill locally), and params another
        # connector made (NixlConnector's name them) are that connector's, whatever the order of a MultiConnector
        if self.consumer is None or not _ours(req.kv_transfer_params):
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
        if self.consumer is not None and _ours(req.kv_transfer_params):
            self.consumer.watch_lease(req)

    def request_abandoned(self, req: Request) -> None:
        if self.consumer is not None and _ours(req.kv_transfer_params):
            self.consumer.request_abandoned(req)

    # ---- both ----------------------------------------------------------------------------------------------
    def get_finished(self) -> FinishedTransfers:
        out = FinishedTransfers()
        if self.consumer is not None:
            self.consumer.keeper.tick()
            out.done_recving, out.failed = self.consumer.take_finished()
        out.done_sending, expired = self.lease_table.reap()
        self.stats.count("lease_expired", expired)
        return out

    def has_pending(self) -> bool:
        return bool(self.lease_table) or (self.consumer is not None and self.consumer.has_pending())

    def shutdown(self) -> None:
        for role in (self.producer, self.consumer):
            if role is not None:
                role.shutdown()


def _ours(params) -> bool:
    """Params a TcpConnector producer made: they name no connector (older ones) or this one."""
    return (params or {}).get("kv_connector", NAME) == NAME
