"""The default `tcp` KV transport: D pulls, P is passive (NIXL-shaped, so another transport can sit behind it).

`TcpConnector` composes the roles: a `TcpProducer` (tcp_producer.py: P's leases and KV server, with the producer
lifecycle of a request) and a `TcpConsumer` (tcp_consumer.py: D's checks, pulls and lease keeping, with the
consumer lifecycle), over the lease table (leases.py) and the authenticated, reused control channel
(tcp_channel.py, tcp_pool.py: one handshake per session, many transfers per session). `kv_both` runs both; the
delegation to the roles is roles.py's, shared with NixlConnector.
`kv_connector_extra_config.session_idle_seconds` (60) is how long P keeps an idle session; D reuses one for half.
"""
from __future__ import annotations

from typing import Optional

from pdserve.transfer.base import ConnectorContext, FinishedTransfers
from pdserve.transfer.channel.leases import Lease, LeaseTable, prompt_hash
from pdserve.transfer.roles import RoleConnector
from pdserve.transfer.channel.blocks import BLOCKS_PER_READ, KVBlocks, TransferStats
from pdserve.transfer.tcp.consumer import TcpConsumer
from pdserve.transfer.tcp.producer import TcpProducer

__all__ = ["BLOCKS_PER_READ", "Lease", "TcpConnector", "TransferStats", "prompt_hash"]


NAME = "TcpConnector"


class TcpConnector(RoleConnector):
    def __init__(self, config, ctx: ConnectorContext):
        super().__init__(config, ctx)
        self.block_size = ctx.block_size
        self.token = config.auth_token().encode()
        self.compat = ctx.compat
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

    def owns(self, params) -> bool:
        """Params a TcpConnector producer made: they name no connector (older ones) or this one."""
        return (params or {}).get("kv_connector", NAME) == NAME

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
    def _renew(self, tid: str) -> float:
        """P's answer to D's `renew`: seconds left in the extended lease; 0 for an unknown, released or expired one."""
        return self.lease_table.renew(tid)

    def handoff(self, key: str, params: Optional[dict], reason: str) -> None:
        if self.producer is not None:
            self.producer.handoff(key, params, reason)

    # ---- consumer ------------------------------------------------------------------------------------------
    @property
    def can_await(self) -> bool:
        return self.consumer is not None

    def cancel_load(self, request_id: str) -> None:
        if self.consumer is not None:
            self.consumer.cancel(request_id)

    def wait_for_transfers(self, timeout: float) -> None:
        if self.consumer is not None:
            self.consumer.wait_for_transfers(timeout)
        else:
            super().wait_for_transfers(timeout)

    # ---- both ----------------------------------------------------------------------------------------------
    def get_finished(self) -> FinishedTransfers:
        out = FinishedTransfers()
        if self.consumer is not None:
            self.consumer.keeper.tick()
            self.consumer.take_finished(out)
        out.released_at, expired = self.lease_table.reap()
        out.done_sending = set(out.released_at)
        self.stats.count("lease_expired", expired)
        return out
