"""The KV connector contract in two halves, as vLLM's KV connector v1, written once here.

Scheduler side (engine thread): which tokens can come from elsewhere, what to load after blocks are allocated,
what a finished request hands on. Worker side: owns the KV tensors' remote I/O, runs loads in the background and
reports, when polled, which finished and which failed. Loads write only blocks the request owns alone.

A connector never sees the engine: it is made with a `ConnectorContext` (what it may know of this node), reads a
request's block ids where the scheduler hands them over, and reports everything back through `FinishedTransfers`,
which the scheduler's P/D half (core/kv_transfers.py) applies. Every optional call has a default here (a no-op, or
"nothing to say"), so the engine calls them without asking first; `MultiConnector` fans them out.
Connectors are registered by module path and imported when first made (factory.py).
"""
from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Optional

from pdserve.request import Request


@dataclass
class LoadJob:
    request_id: str
    params: dict  # the request's kv_transfer_params (where and what to read)
    src_start: int  # first block index of the producer's transfer to read
    dst_blocks: list[int]  # this node's blocks to write, one per read block


def load_job(req: Request, block_ids: list[int], num_local_computed: int, block_size: int) -> LoadJob:
    """The load of `req`'s importable prompt tokens (n - 1, or n with P's first token) past its local prefix hit
    into its `block_ids` (the block of the token D computes first, allocated with them, is not read); with no
    blocks, a bare `done` that only releases the producer's lease."""
    if not block_ids:
        return LoadJob(req.request_id, dict(req.kv_transfer_params), 0, [])
    first, last = num_local_computed // block_size, -(-req.num_importable_tokens // block_size)
    return LoadJob(req.request_id, dict(req.kv_transfer_params), first, block_ids[first:last])


@dataclass
class ConnectorMeta:
    loads: list[LoadJob] = field(default_factory=list)


@dataclass
class FinishedTransfers:
    done_sending: set[str] = field(default_factory=set)  # producer: leases to release (confirmed or expired)
    done_recving: set[str] = field(default_factory=set)  # consumer: loads that completed and verified
    failed: dict[str, str] = field(default_factory=dict)  # consumer: request id -> why the load failed
    # consumer: loads P answered `expired` (LeaseGone: nothing left to read): prefilled on D whatever the policy
    gone: set[str] = field(default_factory=set)
    # consumer: loads that cannot be stopped (a posted one-sided read) and are overdue: request id -> why. The
    # request goes on (its failure policy) without its blocks, which stay out of use until the load is reported in
    # `ended`; a request that finished while loading keeps its blocks held the same way.
    overdue: dict[str, str] = field(default_factory=dict)
    ended: set[str] = field(default_factory=set)  # consumer: overdue loads now over (one entry per overdue report)
    # consumer: awaits P answered with nothing to hand over (its first token ended the request, it failed or was
    # refused): request id -> why. The request is over on P too: it ends here (a 409), whatever the failure policy.
    refused: dict[str, str] = field(default_factory=dict)
    # consumer: an awaited load's params (channel/handoffs.py), not verified yet, and when they came
    # (time.monotonic()), by request id; the request is in done_recving too
    params: dict[str, tuple[dict, float]] = field(default_factory=dict)
    # producer: for done_sending requests, when their lease ended or expired (time.monotonic()): from then until
    # the scheduler frees the blocks is their reclaim time
    released_at: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class ConnectorContext:
    """What a connector may know of the node that makes it: never the engine itself."""
    block_size: int  # tokens per KV block
    compat: dict = field(default_factory=dict)  # what a KV peer must share with this node for blocks to mean the same


def merge_stats(parts: list[dict]) -> Optional[dict]:
    """Transfer counters of several connectors summed (a MultiConnector's children); None when none has any."""
    parts = [p for p in parts if p]
    if not parts:
        return None
    out = {"bytes_sent": 0, "bytes_received": 0, "seconds_receiving": 0.0, "failures": {}, "nixl": {}}
    for p in parts:
        for k in ("bytes_sent", "bytes_received", "seconds_receiving"):
            out[k] += p[k]
        for cause, n in p["failures"].items():
            out["failures"][cause] = out["failures"].get(cause, 0) + n
        out["nixl"] = out["nixl"] or p["nixl"]  # vLLM's NIXL series (NixlConnector)
    return out


class KVConnector(ABC):
    def __init__(self, config, ctx: Optional[ConnectorContext]):
        self.config = config  # KVTransferConfig
        self.ctx = ctx

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

    def handoff(self, key: str, params: Optional[dict], reason: str) -> None:
        """Producer: the request with handoff key `key` ended: a D may await what it hands over on this connector's
        KV server (sealed `params`, or None and why). A no-op where the transport has no such await."""

    def cancel_load(self, request_id: str) -> None:
        """Consumer: the request finished while its load runs: stop the load if it can still stop (an await not
        answered yet). It is reported ended (done or failed) either way."""

    can_await = False  # consumer: loads with `await_kv` params (channel/handoffs.py) are this connector's to run

    def orphaned_leases(self) -> dict[str, float]:
        """Producer: {request id: since when (time.monotonic())} of requests whose blocks this connector still keeps
        though no reader may take them any more (their lease ended or expired; a read in flight still pins it, or it
        is not reaped yet). At rest: empty."""
        return {}

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

    def wait_for_transfers(self, timeout: float) -> None:
        """An idle engine's wait between polls: up to `timeout` seconds, or less once a transfer ended."""
        time.sleep(timeout)

    def shutdown(self) -> None:
        pass

    # ---- the engine's P/D gateway (optional: the defaults say "nothing here") ----------------------------------
    def check_remote(self, params: dict) -> float:
        """Consumer: seconds the producer still holds the KV that checked `params` name (0.0: released, expired or
        never made there), asked over the KV session; raises when P cannot be asked. The default trusts the
        params' own lease."""
        return float(params.get("lease_seconds", 0.0))

    def release_remote(self, params: dict, request_id: str) -> bool:
        """Consumer: tell the producer to end the lease of checked `params` now (a bare `done`) for a request this
        node refused or never started loading. True if a `done` is on its way."""
        return False

    def release_lease(self, transfer_id: str, request_id: str) -> Optional[bool]:
        """Producer: end the open lease `transfer_id` of `request_id` now (the router's call for params no decode
        node took). True released; False no such open lease; None: this connector keeps no leases."""
        return None

    def transfer_stats(self) -> Optional[dict]:
        """Counters for /metrics ({bytes_sent, bytes_received, seconds_receiving, failures, nixl}), or None."""
        return None
