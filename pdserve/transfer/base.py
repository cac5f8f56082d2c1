"""KV connector API in two halves, as vLLM's KV connector v1, and the connector registry.

Scheduler side (engine thread): which tokens can come from elsewhere, what to load after blocks are allocated,
what a finished request hands on. Worker side: owns the KV tensors' remote I/O, runs loads in the background and
reports, when polled, which finished and which failed. Loads write only blocks the request owns alone.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable, Optional

from pdserve.request import Request


@dataclass
class LoadJob:
    request_id: str
    params: dict  # the request's kv_transfer_params (where and what to read)
    src_start: int  # first block index of the producer's transfer to read
    dst_blocks: list[int]  # this node's blocks to write, one per read block


def load_job(req: Request, block_ids: list[int], num_local_computed: int, block_size: int) -> LoadJob:
    """The load of `req`'s first n - 1 prompt tokens past its local prefix hit into its `block_ids` (the replay's
    block, allocated with them, is not read); with no blocks, a bare `done` that only releases the producer's lease."""
    if not block_ids:
        return LoadJob(req.request_id, dict(req.kv_transfer_params), 0, [])
    first, last = num_local_computed // block_size, -(-(req.num_prompt_tokens - 1) // block_size)
    return LoadJob(req.request_id, dict(req.kv_transfer_params), first, block_ids[first:last])


@dataclass
class ConnectorMeta:
    loads: list[LoadJob] = field(default_factory=list)


@dataclass
class FinishedTransfers:
    done_sending: set[str] = field(default_factory=set)  # producer: leases to release (confirmed or expired)
    done_recving: set[str] = field(default_factory=set)  # consumer: loads that completed and verified
    failed: dict[str, str] = field(default_factory=dict)  # consumer: request id -> why the load failed


class KVConnector(ABC):
    def __init__(self, config, engine):
        self.config = config  # KVTransferConfig
        self.engine = engine

    # ---- scheduler side -------------------------------------------------------------------------------------
    @abstractmethod
    def get_num_new_matched_tokens(self, req: Request, num_local_computed: int) -> int:
        """Tokens beyond the local prefix-cache hit that this connector can load for `req` (0: none)."""

    @abstractmethod
    def update_state_after_alloc(self, req: Request, block_ids: list[int], num_local_computed: int) -> None:
        """Blocks are allocated for the local hit, the loadable tokens and the replay's token (not loaded): queue the
        load. No blocks: the request prefills locally; only release what the producer holds for it."""

    @abstractmethod
    def build_connector_meta(self) -> ConnectorMeta:
        """The loads queued since the last step (and forget them)."""

    @abstractmethod
    def request_finished(self, req: Request, block_ids: list[int]) -> tuple[bool, Optional[dict]]:
        """(keep the blocks for a remote reader, kv_transfer_params for the response)."""

    def lease_time_left(self, req: Request) -> float:
        """Consumer: seconds the producer still holds `req`'s KV. While > 0, a request short of blocks for its load
        waits and asks again; at 0 it prefills locally."""
        return 0.0

    def watch_lease(self, req: Request) -> None:
        """Consumer: `req` (remote-prefill params, checked) now waits to be scheduled: keep what the producer holds
        for it alive until its load starts or it ends."""

    def request_abandoned(self, req: Request) -> None:
        """Consumer: `req` finished before its load started; let the producer release what it holds for it."""

    # ---- worker side ----------------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: list) -> None:
        self.kv_caches = kv_caches

    @abstractmethod
    def start_load_kv(self, meta: ConnectorMeta) -> None:
        """Start the loads in the background."""

    @abstractmethod
    def get_finished(self) -> FinishedTransfers:
        """Transfers that ended since the last poll."""

    def has_pending(self) -> bool:
        """Loads in flight or leases open: the engine keeps polling while this is true."""
        return False

    def shutdown(self) -> None:
        pass


CONNECTORS: dict[str, Callable[..., KVConnector]] = {}


def register_connector(name: str):
    def deco(cls):
        CONNECTORS[name] = cls
        return cls
    return deco


def make_connector(config, engine) -> Optional[KVConnector]:
    # the arrival driver works through LLMEngine.add_prefilled_request: nothing to connect, and nothing imported,
    # since the transfer modules need server packages (cryptography) that a GPU benchmark machine may lack
    if config is None or config.kv_connector == "DecodeBenchConnector":
        return None
    if not {config.kv_connector, *(c.kv_connector for c in config.connectors)} <= CONNECTORS.keys():
        import pdserve.transfer.tcp.connector  # noqa: F401  (registers TcpConnector)
        import pdserve.transfer.multi  # noqa: F401
        import pdserve.transfer.nixl.connector  # noqa: F401  (imports no nixl: NixlConnector checks for it when made)
    return CONNECTORS[config.kv_connector](config, engine)
