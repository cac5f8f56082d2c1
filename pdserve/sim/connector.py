"""A simulated P/D KV connector: the scheduler side is the real contract (transfer/base.py), the wire is a
transfer-time model (latency + bytes / bandwidth) on the simulator's clock.

P (`kv_producer`) keeps a finished prefill's blocks under a lease (`request_finished` says keep) and hands out
params naming the transfer, with P's first token when the router asked for it (`--pd-first-token prefill`: D then
imports all n prompt tokens); D (`kv_consumer`) offers the n - 1 (or n) prompt tokens past its own prefix hit
(`get_num_new_matched_tokens`), so `KVTransfers.start_load` allocates and parks the request in `loading`
exactly as on a real D; its load completes at now + transfer time, reported by `get_finished` on D's first step at
or after that time, and releases P's lease (D's `done` rides its last read, as TcpConnector's).

Under the router's early decode (`--pd-first-token prefill`, its default) D holds the request from the moment P is
asked, with `await_kv` params (channel/handoffs.py): its scheduler allocates the blocks of all n prompt tokens as for
any load, and the await is posted on the fabric by its handoff key. P's params come on the fabric when P's step that
seals them ends (`Fabric.post`, the simulator's call), and the await then completes as a load of those blocks would
(the transfer model's time from then, or from the await's start if it began later), reported with P's params
(`FinishedTransfers.params`) for D to take P's first token; an await cancelled by its request's end (the router
dropping D) is reported at once, so its blocks are freed at D's next poll; one that begins after P's lease ended
(D's seats were full for that long) is `gone`, prefilled on D, as a real P's KV server answers it.

What fails, as on a real pair: P's lease expires `lease_seconds` after P's answer (P frees the blocks at its first
poll after that; a D whose request queued past it prefills locally: `KVTransfers.start_load`, which starts no load
on a lease already over, so P never answers a simulated read `expired`); a started load fails with probability
`load_failure_rate` (seeded), reported when it would have ended; a failed load is recomputed on D
(`kv_load_failure_policy` recompute) and tells P `done`.
"""
from __future__ import annotations

import heapq
import math
import random
from typing import Optional

from pdserve.kv_transfer_config import KVTransferConfig
from pdserve.request import Request
from pdserve.transfer.base import ConnectorMeta, FinishedTransfers, KVConnector, LoadJob, load_job
from pdserve.transfer.channel.handoffs import AWAIT_KV

CANCELLED = "the request ended while it awaited P's params"
GONE = "the prefill node's lease ended before the await began"


class TransferModel:
    """Seconds to move `num_bytes` of KV between two nodes: a fixed latency plus bytes over bandwidth; how long P
    holds a prefill's KV for D (`lease_seconds`, kv_lease_seconds), how often a load fails, how long D's step
    waits for the loads it started early (`load_wait_s`, kv_load_wait_ms: the engine's default unless set), and
    what the router adds each time it sends a request on to a node (`router_latency_s`: its HTTP in and out)."""

    def __init__(self, bandwidth_bytes_s: float, latency_s: float, lease_seconds: float = 30.0,
                 load_failure_rate: float = 0.0, load_wait_s: float = KVTransferConfig.kv_load_wait_ms / 1000,
                 router_latency_s: float = 0.0):
        if not bandwidth_bytes_s > 0 or not math.isfinite(bandwidth_bytes_s):
            raise ValueError("--kv-bandwidth-gb-s must be a number > 0")
        if not 0 <= latency_s < math.inf:
            raise ValueError("--kv-latency-ms must be a number >= 0")
        if not 0 < lease_seconds < math.inf:
            raise ValueError("--kv-lease-seconds must be a number > 0")
        if not 0 <= load_failure_rate <= 1:
            raise ValueError("--kv-load-failure-rate must be in [0, 1]")
        if not 0 <= load_wait_s <= 1:
            raise ValueError("--kv-load-wait-ms must be in [0, 1000]")
        if not 0 <= router_latency_s <= 1:
            raise ValueError("--router-latency-ms must be in [0, 1000]")
        self.bandwidth = bandwidth_bytes_s
        self.latency = latency_s
        self.lease_seconds = lease_seconds
        self.load_failure_rate = load_failure_rate
        self.load_wait_s = load_wait_s
        self.router_latency_s = router_latency_s

    def seconds(self, num_bytes: float) -> float:
        return self.latency + num_bytes / self.bandwidth


class Fabric:
    """The producers' leases, by transfer id: where a D's load finds the P to release."""

    def __init__(self, transfer: TransferModel, kv_bytes_per_token: float, block_size: int, seed: int = 0):
        self.transfer = transfer
        self.block_bytes = kv_bytes_per_token * block_size
        self.producers: dict[str, "SimConnector"] = {}
        self.bytes_moved = 0.0
        self.rng = random.Random(seed)  # which loads fail
        self.failed_loads = 0  # loads that failed (the failure rate)
        self.expired_leases = 0  # leases P ended at their expiry, unread
        # early decode: handoff key -> (when P posted, its params) not awaited yet, and handoff key -> (D's
        # connector, its await's load) not answered yet. A request whose token ended it at P posts nothing: the
        # router drops its D (the simulator aborts it there)
        self.board: dict[str, tuple[float, dict]] = {}
        self.awaits: dict[str, tuple["SimConnector", LoadJob]] = {}

    def post(self, key: str, params: dict, now: float) -> Optional["SimConnector"]:
        """P's params under handoff `key` at `now`; returns the D connector whose await they answer now (None: no
        await yet, they wait on the board for it)."""
        waiting = self.awaits.pop(key, None)
        if waiting is None:
            self.board[key] = (now, params)
            return None
        waiting[0].answer(waiting[1], params, now)
        return waiting[0]

    def release(self, params: dict) -> None:
        """D's `done` (its last read, or a bare one): P frees the blocks at its next poll, unless the lease ended."""
        p = self.producers.get(params.get("remote_engine_id"))
        if p is not None and p.leases.pop(params["remote_request_id"], None) is not None:
            p.released.add(params["remote_request_id"])


class SimConnector(KVConnector):
    def __init__(self, role: str, engine_id: str, fabric: Fabric, block_size: int):
        super().__init__(None, None)
        self.role, self.engine_id, self.fabric, self.block_size = role, engine_id, fabric, block_size
        self.now = 0.0  # the node sets it before each step: the simulator's clock
        self.queued: list[LoadJob] = []
        # heap of (end time, request id, P's params (None: an await that ended without a load), why failed, awaited)
        self.inflight: list[tuple[float, str, Optional[dict], str, bool]] = []
        self.released: set[str] = set()  # P: leases D has finished reading, or that expired
        self.leases: dict[str, float] = {}  # P: open leases -> when they expire
        # D: request id -> [load started, load seen done], the engine's kv_load_start/end_time (its TTFT split)
        self.load_times: dict[str, list[float]] = {}
        self.open_leases = 0
        self.can_await = role == "kv_consumer"
        if role == "kv_producer":
            fabric.producers[engine_id] = self

    # ---- scheduler side --------------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, req: Request, num_local_computed: int) -> int:
        if self.role != "kv_consumer" or not (req.kv_transfer_params or {}).get("do_remote_prefill"):
            return 0
        m = req.num_importable_tokens  # n - 1 (D replays the last prompt token), or n with P's first token
        if num_local_computed >= m:  # all cached here: nothing to pull, but P must hear `done` (as TcpConnector)
            self.queued.append(LoadJob(req.request_id, dict(req.kv_transfer_params), 0, []))
            return 0
        return m - num_local_computed

    def lease_time_left(self, req: Request) -> float:
        return (req.kv_transfer_params or {}).get("lease_expires", math.inf) - self.now

    def update_state_after_alloc(self, req: Request, block_ids: list[int], num_local_computed: int) -> None:
        self.queued.append(load_job(req, block_ids, num_local_computed, self.block_size))

    def build_connector_meta(self) -> ConnectorMeta:
        meta, self.queued = ConnectorMeta(self.queued), []
        return meta

    def request_finished(self, req: Request, block_ids: list[int]) -> tuple[bool, Optional[dict]]:
        if self.role != "kv_producer" or not (req.kv_transfer_params or {}).get("do_remote_decode"):
            return False, None
        if req.hands_off_first_token and not req.handed_off:
            return False, None  # P's first token ended the request: the engine ends the lease at once, D is not asked
        self.open_leases += 1
        expires = self.now + self.fabric.transfer.lease_seconds
        self.leases[req.request_id] = expires
        params = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": self.engine_id,
                  "remote_request_id": req.request_id, "remote_block_ids": list(block_ids),
                  "num_prompt_tokens": req.num_prompt_tokens, "lease_expires": expires}
        if req.hands_off_first_token:  # as the engine seals them: the token and the key of the params that drew it
            params["first_token"] = {"id": req.output_token_ids[0], "key": req.sampling_params.first_token_key()}
        return True, params

    def request_abandoned(self, req: Request) -> None:
        self.fabric.release(req.kv_transfer_params)

    # ---- worker side -----------------------------------------------------------------------------------------
    def start_load_kv(self, meta: ConnectorMeta) -> None:
        for job in meta.loads:
            if not job.dst_blocks:  # a bare `done`: D had the prompt cached, or prefills it itself
                self.fabric.release(job.params)
                continue
            spec = job.params.get(AWAIT_KV)
            if spec is None:
                self._load(job, job.params, self.now)
            elif (posted := self.fabric.board.pop(spec["key"], None)) is not None:
                self.answer(job, posted[1], self.now)
            else:
                self.fabric.awaits[spec["key"]] = (self, job)

    def answer(self, job: LoadJob, params: dict, now: float) -> None:
        """D: P's `params` for the await `job` came at `now`: its KV loads from then."""
        if params.get("lease_expires", math.inf) <= now:  # D's await began after P let the KV go: LeaseGone
            heapq.heappush(self.inflight, (now, job.request_id, None, GONE, False))
        else:
            self._load(job, params, now, awaited=True)

    def _load(self, job: LoadJob, params: dict, now: float, awaited: bool = False) -> None:
        num_bytes = len(job.dst_blocks) * self.fabric.block_bytes
        self.load_times[job.request_id] = [now, math.nan]
        fabric, ends = self.fabric, now + self.fabric.transfer.seconds(num_bytes)
        why = ""
        if fabric.transfer.load_failure_rate and fabric.rng.random() < fabric.transfer.load_failure_rate:
            why = "simulated load failure"
        else:
            fabric.bytes_moved += num_bytes
        heapq.heappush(self.inflight, (ends, job.request_id, params, why, awaited))

    def cancel_load(self, request_id: str) -> None:
        """An await not answered yet stops now (reported at the next poll); a load runs to its end."""
        for key, (conn, job) in list(self.fabric.awaits.items()):
            if conn is self and job.request_id == request_id:
                del self.fabric.awaits[key]
                heapq.heappush(self.inflight, (self.now, request_id, None, CANCELLED, False))

    def load_ends(self, request_ids: set[str]) -> list[float]:
        """When the loads in flight of `request_ids` end (are seen by a poll at or after that time)."""
        return [end for end, rid, *_ in self.inflight if rid in request_ids]

    def get_finished(self) -> FinishedTransfers:
        fin = FinishedTransfers()
        while self.inflight and self.inflight[0][0] <= self.now:
            _, rid, params, why, awaited = heapq.heappop(self.inflight)
            if params is None:  # an await that ended without a load: cancelled, or P's lease was over
                if why == CANCELLED:
                    fin.failed[rid] = why
                else:
                    fin.gone.add(rid)  # prefilled here whatever the policy
                continue
            if why:
                fin.failed[rid] = why
                self.fabric.failed_loads += 1
            else:
                fin.done_recving.add(rid)
                if awaited:
                    fin.params[rid] = (params, self.load_times[rid][0])
            self.load_times[rid][1] = self.now  # seen done at this poll, as the engine stamps it
            self.fabric.release(params)  # a failed load's bare `done` too
        for rid in [rid for rid, t in self.leases.items() if t <= self.now]:  # P: expired, never read
            del self.leases[rid]
            self.released.add(rid)
            self.fabric.expired_leases += 1
        if self.released:
            fin.done_sending, self.released = self.released, set()
            self.open_leases -= len(fin.done_sending)
        return fin

    def next_event(self) -> Optional[float]:
        """When this connector next has something to report: the earliest load in flight, or lease expiry."""
        return min(([self.inflight[0][0]] if self.inflight else []) + list(self.leases.values()), default=None)

    def has_pending(self) -> bool:
        return bool(self.inflight or self.released)
