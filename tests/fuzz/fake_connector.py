"""A P/D consumer connector whose producer (P) is simulated in-process on a clock of engine steps.

P offers each transfer under a lease: `leased` when P answered the router, `renewed` when D's read starts (a read
pins and extends it, as tcp's), then `released` by D's done (a load, or a bare done for a prompt D prefills itself)
or `expired` when its steps run out unpinned. How each load ends is planned by the workload: `ok` after `latency`
steps (it writes P's prompt tokens, the fake model's KV, into D's blocks: the output is right only if they went to
the right blocks), `fail` after `latency` steps (a broken frame: garbage lands in the first block, which D must drop
unpublished), `hang` (P never answers: D's timeout, `timeout_steps`, fails it). A load slower than the timeout fails
at the timeout and writes nothing after. `get_finished` runs once per engine step and is the clock's tick.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Optional

import torch

from pdserve.transfer.base import ConnectorMeta, FinishedTransfers, KVConnector, LoadJob, load_job
from pdserve.transfer.factory import register_connector
from pdserve.transfer.channel.proof import sign_params

NAME = "FuzzConnector"
TOKEN = "fuzz-token"


@dataclass
class Lease:
    prompt: list[int]
    lease_steps: int
    expiry: int  # P drops the blocks once the clock passes this step with no read pinning them
    outcome: str = "ok"  # how a load of it ends: ok | fail | hang
    latency: int = 1
    state: str = "leased"  # leased | renewed | released | expired
    pins: int = 0
    load_failed: bool = False  # D's read failed: P cannot have heard D, so only expiry frees the lease

    @property
    def alive(self) -> bool:
        return self.state in ("leased", "renewed")


@dataclass
class Load:
    job: LoadJob
    start: int
    expired: bool  # P answered `expired`: the lease ended before D read


@dataclass
class FakeP:
    now: int = 0
    leases: dict[str, Lease] = field(default_factory=dict)

    def offer(self, tid: str, prompt: list[int], lease_steps: int, outcome: str, latency: int) -> dict:
        """P prefilled `prompt`: lease its KV and answer with the params the router signs and hands to D."""
        from pdserve.transfer.channel.proof import prompt_hash
        self.leases[tid] = Lease(list(prompt), lease_steps, self.now + lease_steps, outcome, latency)
        return sign_params({"do_remote_prefill": True, "do_remote_decode": False, "transfer_id": tid,
                            "remote_engine_id": "fakeP", "remote_host": "127.0.0.1", "remote_port": 1,
                            "num_prompt_tokens": len(prompt), "prompt_hash": prompt_hash(prompt),
                            "lease_seconds": 30.0},
                           TOKEN)

    def tick(self) -> None:
        self.now += 1
        for lease in self.leases.values():
            if lease.alive and lease.pins == 0 and self.now > lease.expiry:
                lease.state = "expired"

    def release(self, tid: str) -> None:
        lease = self.leases[tid]
        if lease.alive:
            lease.state = "released"


class FuzzConnector(KVConnector):
    def __init__(self, config, ctx):
        super().__init__(config, ctx)
        self.timeout = int(config.kv_connector_extra_config.get("timeout_steps", 8))
        self.block_size = ctx.block_size
        self.p = FakeP()
        self._queued: list[LoadJob] = []
        self._inflight: dict[str, Load] = {}
        self._done: set[str] = set()
        self._failed: dict[str, str] = {}
        self._gone: set[str] = set()  # loads P answered `expired`: prefilled on D, whatever the policy
        self.events: dict[str, list[str]] = defaultdict(list)  # per request, what D did with its transfer

    def _tid(self, req) -> Optional[str]:
        p = req.kv_transfer_params or {}
        return p.get("transfer_id") if p.get("do_remote_prefill") else None

    # ---- scheduler side ------------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, req, num_local_computed: int) -> int:
        tid = self._tid(req)
        if tid is None:
            return 0
        assert self.p.leases[tid].prompt == req.prompt_token_ids, "the test's params name another prompt"
        n = req.num_prompt_tokens
        self.events[req.request_id].append("asked")
        if num_local_computed >= n - 1:  # all cached here: release P's lease now
            self._queued.append(LoadJob(req.request_id, dict(req.kv_transfer_params), 0, []))
            return 0
        return n - 1 - num_local_computed

    def update_state_after_alloc(self, req, block_ids: list[int], num_local_computed: int) -> None:
        tid = self._tid(req)
        if not block_ids:
            lease = self.p.leases[tid]
            if lease.alive and num_local_computed < req.num_prompt_tokens - 1:
                self.events[req.request_id].append(f"gave_up@{self.p.now}")  # P still holds the KV D will recompute
        self._queued.append(load_job(req, block_ids, num_local_computed, self.block_size))

    def build_connector_meta(self) -> ConnectorMeta:
        meta, self._queued = ConnectorMeta(self._queued), []
        return meta

    def request_finished(self, req, block_ids: list[int]):
        """D is done with the request: if no load is under way, tell P to drop the lease now (as vLLM's Nixl)."""
        tid, rid = self._tid(req), req.request_id
        if tid is not None and self.p.leases[tid].alive and rid not in self._inflight \
                and all(j.request_id != rid for j in self._queued):
            self.p.release(tid)
            self.events[rid].append("released_on_finish")
        return False, None

    def lease_time_left(self, req) -> float:
        """Steps (not seconds: this P's clock) P still holds the request's KV; the scheduler only compares with 0."""
        lease = self.p.leases.get(self._tid(req))
        return max(0, lease.expiry - self.p.now + 1) if lease is not None and lease.alive else 0

    def request_abandoned(self, req) -> None:
        """D finished the request before its load started: P may drop the lease now."""
        tid = self._tid(req)
        if tid is not None and self.p.leases[tid].alive:
            self.p.release(tid)
            self.events[req.request_id].append("abandoned")

    # ---- worker side ---------------------------------------------------------------------------------------
    def start_load_kv(self, meta: ConnectorMeta) -> None:
        for job in meta.loads:
            tid = job.params["transfer_id"]
            lease = self.p.leases[tid]
            if not job.dst_blocks:  # a bare done
                self.p.release(tid)
                self.events[job.request_id].append("bare_done")
                continue
            assert job.request_id not in self._inflight, f"two loads at once for {job.request_id}"
            self.events[job.request_id].append(f"load@{self.p.now}")
            expired = not lease.alive
            if not expired:
                lease.state, lease.pins, lease.expiry = "renewed", lease.pins + 1, self.p.now + lease.lease_steps
            self._inflight[job.request_id] = Load(job, self.p.now, expired)

    def _write(self, job: LoadJob, lease: Lease, garbage: bool = False) -> None:
        """P's blocks src_start.. into D's dst_blocks: each slot gets the token and position P holds there (its
        whole prompt, the last token included). Garbage: a broken frame's wrong tokens in the first block."""
        bs, blocks = self.block_size, job.dst_blocks[:1] if garbage else job.dst_blocks
        pos = torch.arange(job.src_start * bs, min((job.src_start + len(blocks)) * bs, len(lease.prompt)))
        tok = torch.tensor(lease.prompt)[pos]
        slots = torch.tensor(blocks)[pos // bs - job.src_start] * bs + pos % bs
        cache = self.kv_caches[0]
        cache[0].view(-1).index_copy_(0, slots, ((tok + 7) % 61 if garbage else tok).to(cache.dtype) + 1)
        cache[1].view(-1).index_copy_(0, slots, pos.to(cache.dtype) + 1)

    def get_finished(self) -> FinishedTransfers:
        self.p.tick()
        now = self.p.now
        for rid, load in list(self._inflight.items()):
            lease = self.p.leases[load.job.params["transfer_id"]]
            age = now - load.start
            if load.expired:
                why = "expired"
            elif lease.outcome == "ok" and lease.latency < self.timeout and age >= lease.latency:
                why = None
            elif lease.outcome == "fail" and lease.latency < self.timeout and age >= lease.latency:
                why = "broken frame"
            elif age >= self.timeout:
                why = "timeout"
            else:
                continue
            del self._inflight[rid]
            if not load.expired:
                lease.pins -= 1
            if why is None:
                self._write(load.job, lease)
                self.p.release(load.job.params["transfer_id"])
                self._done.add(rid)
                self.events[rid].append("loaded")
            elif load.expired:  # P answered `expired` (LeaseGone): D prefills it whatever the policy
                self._gone.add(rid)
                self.events[rid].append("gone")
            else:
                self._write(load.job, lease, garbage=True)
                lease.load_failed = True
                self._failed[rid] = f"KV load failed ({why})"
                self.events[rid].append(f"failed:{why}")
        out = FinishedTransfers(done_recving=self._done, failed=self._failed, gone=self._gone)
        self._done, self._failed, self._gone = set(), {}, set()
        return out

    def has_pending(self) -> bool:
        return bool(self._queued or self._inflight or self._done or self._failed or self._gone)

    def max_wait_steps(self) -> int:
        """The longest a load lives: it ends by its timeout (a slower answer fails there)."""
        return self.timeout + 2


register_connector(NAME, __name__, "FuzzConnector")
