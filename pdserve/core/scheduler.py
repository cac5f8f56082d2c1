"""Continuous batching: running requests first, then admissions; chunked prefill; preemption by recompute.

One step:
1. every RUNNING request gets its next tokens (1 for a decode; for a prefill chunk, up to the budget and
   `long_prefill_token_threshold`); when blocks run out, the most recently admitted running request is preempted
   (blocks freed, back to the queue's front);
2. if nothing was preempted, requests holding imported KV (`ready`) get a seat for their one-token replay, then
   WAITING/PREEMPTED requests are admitted strictly in order while seats, tokens and blocks last, starting after
   their prefix-cache hit; on a P/D consumer a request whose KV can be loaded is parked in `loading` instead (its
   blocks allocated, no seat, no tokens) until the load ends;
3. after the model ran, `update_from_output` advances `num_computed_tokens`, publishes full blocks, appends the
   sampled token of each row that reached the end of its known tokens, and applies the stop conditions.

Speculative decoding (`speculative_config`): in step 1 a decode row (one token left to compute, a P/D replay
included) also schedules K drafts the n-gram proposer looked up in its own tokens, padded with placeholders to K
(fewer only where max_model_len ends the row), all or nothing against the budget, with their lookahead slots; a
remote load allocates the replay's lookahead slots with its blocks. In step 3 such a row gets its emitted tokens
(accepted drafts, then the correction or bonus) one by one against the stop conditions; `num_computed_tokens`
advances by 1 + accepted only (capped at the kept tokens), so rejected KV is never read or published.

Async scheduling (core/step_pipeline.py): step 1 of the next step runs while the model runs this one, which
`mark_in_flight` counted as landed (its tokens computed, a sampling row's token a placeholder: counted in
`num_tokens_with_placeholders`, not appended); step 3 then runs with `in_flight=True`.
"""
from __future__ import annotations

from collections import deque
from typing import Optional, Sequence

from pdserve.config import SchedulerConfig
from pdserve.core.kv_cache_manager import KVCacheManager
from pdserve.core.kv_transfers import KVTransfers
from pdserve.request import Request, RequestStatus
from pdserve.sched_output import NO_DRAFTS, ScheduledRow, SchedulerOutput, cdiv
from pdserve.spec_decode.config import SpeculativeConfig
from pdserve.spec_decode.ngram_proposer import NgramProposer
from pdserve.transfer.channel.handoffs import AWAIT_KV

class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, max_model_len: int,
                 speculative_config: Optional[SpeculativeConfig] = None, transfers: Optional[KVTransfers] = None):
        if not config.enable_chunked_prefill and config.max_num_batched_tokens < max_model_len:
            # Without chunking a whole (re)computed sequence must fit one step, or it could never be admitted.
            raise ValueError(f"max_num_batched_tokens ({config.max_num_batched_tokens}) must be >= max_model_len "
                             f"({max_model_len}) when enable_chunked_prefill is off")
        self.config = config
        self.kv = kv
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()  # to admit, in order (fresh, preempted, loads short of blocks)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        # vLLM's prefix-cache counters, in tokens: each admission from `waiting` (or load start) counts its tokens
        # once as queried and its cached prefix as hits; a head of the queue that waits for room is not recounted
        self.prefix_cache_queries = 0
        self.external_prefix_cache_queries = self.external_prefix_cache_hits = 0  # with a KV connector, as vLLM's
        self.prefix_cache_hits = 0
        # the P/D half (loads, imported KV waiting for a seat, leases, held blocks); without a connector only its
        # `ready` queue is used (the arrival driver's imports)
        self.transfers = transfers if transfers is not None else KVTransfers(kv)
        self.connector = self.transfers.connector
        self.spec = speculative_config
        self.proposer = NgramProposer(speculative_config, max_model_len) if speculative_config else None

    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        self.requests[req.request_id] = req
        self.waiting.append(req)
        self.transfers.watch(req)

    def mark_imported(self, req: Request) -> None:
        """`req`, just added, holds the KV of its first n - 1 prompt tokens (the arrival driver filled it)."""
        self.waiting.pop() if self.waiting[-1] is req else self.waiting.remove(req)
        self.transfers.ready.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.transfers.num_waiting)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + self.transfers.num_waiting

    def process_transfers(self, fin) -> list[Request]:
        """Apply the connector's finished transfers (KVTransfers.process); returns the requests that failed."""
        recompute, failed = self.transfers.process(fin)
        # to the queue's front, in the order their loads began: they came before what arrived while they loaded
        self.waiting.extendleft(reversed(recompute))
        self.waiting.extendleft(req for req, _ in failed)  # finish_request takes them from there
        return [self.finish_request(req.request_id, RequestStatus.FINISHED_ERROR, why) for req, why in failed]

    def start_loads(self) -> bool:
        """Before `schedule()`: the queue's head requests whose prompt KV a connector loads start loading now rather
        than after this step's rows were scheduled, so a short load can end in time for this step (step_pipeline's
        kv_load_wait). Only what `schedule()` would start itself (a free seat, strictly in order), and only while the
        free blocks still cover every running row's next slots beside it: never the cause of a preemption. Returns
        whether a load started."""
        started = False
        seats = self.config.max_num_seqs
        while self.waiting and not self.transfers.ready and len(self.running) < seats:
            req = self.waiting[0]
            lookahead = self.num_lookahead(req)
            if not (req.kv_transfer_params or {}).get("do_remote_prefill") or req.kv_load_tried or \
                    self._short_of_blocks(req) or self._await_waits(req):
                break
            hits, num_hit = self.kv.get_computed_blocks(req)
            if self.transfers.start_load(req, hits, num_hit, lookahead) != "loading":
                break  # "blocked" (no blocks yet) or prefilled here: schedule() decides, as it would have
            self.waiting.popleft()
            self._count_lookup(req, num_hit, req.num_importable_tokens - num_hit)
            started = True
        return started

    def _short_of_blocks(self, req: Request) -> bool:
        """`req`'s blocks (its tokens, the next one's slot and lookahead) would eat into what the running rows' next
        tokens may need (each a block boundary apart): loading it now could cause a preemption."""
        bs = self.kv.block_size
        k = self.spec.num_lookahead_slots if self.spec is not None else 0
        reserve = len(self.running) * (1 + cdiv(1 + k, bs))
        return self.kv.num_free_blocks() < reserve + cdiv(req.num_tokens + 1 + self.num_lookahead(req), bs)

    def _await_waits(self, req: Request) -> bool:
        """An await (channel/handoffs.py) holds its blocks for P's queue and prefill, not a pull's milliseconds: it
        takes a seat's worth (awaits and running rows together stay within max_num_seqs, so a P that queues cannot
        make D hold more requests' blocks than it runs) and allocates only while the free blocks still cover every
        running row's next slots beside it, so it is never the cause of a preemption; until then it waits at the
        queue's head, its await not yet asked."""
        if req.kv_load_tried or AWAIT_KV not in (req.kv_transfer_params or {}):
            return False
        awaiting = sum(AWAIT_KV in (r.kv_transfer_params or {}) for r in self.transfers.loading.values())
        return len(self.running) + awaiting >= self.config.max_num_seqs or self._short_of_blocks(req)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        drafting = self.spec is not None and self.spec.speculates(len(self.running))
        for req in list(self.running):
            if budget <= 0:
                break
            if req.status != RequestStatus.RUNNING:  # preempted earlier in this loop
                continue
            if req.num_output_placeholders and self._capped_when_landed(req):
                continue  # its in-flight token ends it: another row would compute a token never kept
            left = req.num_tokens_with_placeholders - req.num_computed_tokens
            drafts = self._drafts(req) if drafting and left == 1 else NO_DRAFTS
            num_new = self._chunk(left)
            # All or nothing: drafts that do not fit the budget or the free blocks are dropped (the row decodes
            # its one token), never cut short, and never the cause of a preemption.
            if drafts and (1 + len(drafts) <= budget and self.kv.allocate_slots(req, 1 + len(drafts))):
                num_new += len(drafts)
            else:
                drafts = NO_DRAFTS
            num_new = min(num_new, budget)
            while not self.kv.allocate_slots(req, num_new):
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            if req.status == RequestStatus.RUNNING:
                out.rows.append(ScheduledRow(req, req.num_computed_tokens, num_new, drafts))
                budget -= num_new
        if out.preempted:
            return out
        seats = self.config.max_num_seqs
        # Requests holding imported KV go first: a replay needs a seat and one token, no block (its slot came with
        # the load), and finishing them frees memory for the rest.
        ready = self.transfers.ready
        while ready and budget > 0 and len(self.running) < seats:
            req = ready[0]
            num_new = req.num_tokens - req.num_computed_tokens
            drafts = self._drafts(req) if drafting else NO_DRAFTS
            if drafts and (num_new + len(drafts) > budget or not self.kv.allocate_slots(req, num_new + len(drafts))):
                drafts = NO_DRAFTS  # its load allocated the lookahead slots; an arrival driver's import may not
            if num_new + len(drafts) > budget or not self.kv.allocate_slots(req, num_new):
                break
            ready.popleft()
            budget -= self._admit(req, [], req.num_computed_tokens, num_new + len(drafts), out, drafts)
        # Then strictly FIFO: the first request that cannot be admitted stops admission, so a step costs the same
        # however many wait behind it.
        while self.waiting and budget > 0 and len(self.running) < seats:
            req = self.waiting[0]
            if self._await_waits(req):
                break
            hits, num_hit = self.kv.get_computed_blocks(req)
            load = self.transfers.start_load(req, hits, num_hit, self.num_lookahead(req))
            if load == "loading":
                self.waiting.popleft()
                self._count_lookup(req, num_hit, req.num_importable_tokens - num_hit)  # what the connector loads
                continue
            left = req.num_tokens - num_hit
            # a preempted request whose prefix cache covers all but its last token resumes as a decode row
            drafts = self._drafts(req) if drafting and left == 1 and num_hit and load is None else NO_DRAFTS
            num_new = self._chunk(left)
            if drafts and 1 + len(drafts) <= budget and self.kv.allocate_slots(req, 1 + len(drafts), hits):
                self.waiting.popleft()
                self._count_lookup(req, num_hit)
                budget -= self._admit(req, hits, num_hit, 1 + len(drafts), out, drafts)
                continue
            if load == "blocked" or (num_new > budget and not self.config.enable_chunked_prefill) or \
                    not self.kv.allocate_slots(req, min(num_new, budget), hits):
                break
            self.waiting.popleft()
            self._count_lookup(req, num_hit)
            budget -= self._admit(req, hits, num_hit, min(num_new, budget), out)
        return out

    def _count_lookup(self, req: Request, num_hit: int, num_external: int = 0) -> None:
        """At admission, once per admission (not per retry of a blocked head): local prefix-cache and, with a
        connector, external (remote KV) queries and hits, in tokens."""
        if self.kv.pool.enable_caching:
            self.prefix_cache_queries += req.num_tokens
            self.prefix_cache_hits += num_hit
        if self.connector is not None:
            self.external_prefix_cache_queries += req.num_tokens
            self.external_prefix_cache_hits += num_external

    def _chunk(self, num_new: int) -> int:
        """A row's tokens to compute this step, capped at long_prefill_token_threshold (never a decode's one token:
        the threshold is >= 1 when set)."""
        cap = self.config.long_prefill_token_threshold
        return min(num_new, cap) if cap else num_new

    def _admit(self, req: Request, hits: list[int], num_hit: int, num_new: int, out: SchedulerOutput,
               drafts: Sequence[int] = NO_DRAFTS) -> int:
        req.num_computed_tokens = num_hit
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = num_hit
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        out.rows.append(ScheduledRow(req, num_hit, num_new, drafts))
        return num_new

    def num_lookahead(self, req: Request) -> int:
        """Draft slots a decode step of `req` schedules: K, fewer where max_model_len ends the row (a position past
        it is never computed)."""
        return 0 if self.spec is None else max(0, min(self.spec.num_lookahead_slots,
                                                      self.max_model_len - req.num_tokens))

    def _drafts(self, req: Request) -> list[int]:
        """The row's drafts from its own tokens, padded with placeholders to num_lookahead."""
        k = self.num_lookahead(req)
        return self.proposer.propose_padded_for(req, k) if k else []

    def _capped_when_landed(self, req: Request) -> bool:
        """A length cap `_check_stop` will certainly apply once the in-flight token lands (a P's first token for D
        is its one token: the hand-off ends it)."""
        return req.num_tokens_with_placeholders >= self.max_model_len or \
            req.num_output_tokens + req.num_output_placeholders >= req.max_tokens or req.hands_off_first_token

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        # the readmission recomputes the outputs too: a prefill, as vLLM's MRv2 (an in-flight token included: it
        # lands before the readmission)
        req.prefill_len = req.num_tokens_with_placeholders
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def mark_in_flight(self, out: SchedulerOutput) -> None:
        """Async scheduling: count a launched step as landed, so that the next `schedule()` can run while it runs:
        each row's tokens computed, a sampling row's token pending as a placeholder (not appended)."""
        for row in out.rows:
            req = row.request
            if row.samples:
                req.num_output_placeholders += 1
            req.num_computed_tokens += row.num_scheduled_tokens

    def update_from_output(self, out: SchedulerOutput, sampled: list, in_flight: bool = False) -> list[Request]:
        """Apply one step's results (per row: a token, None, or a drafting row's emitted tokens); returns the
        requests that got new tokens (finished ones included), each with `num_new_tokens` set. `in_flight`: the
        step was counted at launch (`mark_in_flight`): a token takes its placeholder's place, and a request the
        schedule made meanwhile preempted gets its token and stop check but keeps its computed count reset."""
        updated = []
        for row, token in zip(out.rows, sampled):
            req = row.request
            if req.is_finished:  # aborted (or stopped by a stop string) while the step ran
                continue
            if row.draft_token_ids:
                self._apply_verified(req, row, token)
                updated.append(req)
                continue
            req.num_new_tokens = 1
            if not in_flight:
                req.num_computed_tokens += row.num_scheduled_tokens
            if req.status == RequestStatus.RUNNING:  # a preempted request holds no blocks
                self.kv.cache_blocks(req)
            if token is None:
                continue
            if in_flight:
                req.num_output_placeholders -= 1
            req.append_output_token(token)
            updated.append(req)
            status = self._check_stop(req, token)
            if status is not None:
                self.finish_request(req.request_id, status)
        return updated

    def _apply_verified(self, req: Request, row: ScheduledRow, emitted: list[int]) -> None:
        """Emitted tokens (accepted drafts, then the correction or bonus) one by one until a stop; the KV of the
        last known token and the accepted drafts is valid, and only of the tokens kept."""
        status = None
        n = 0
        for n, tok in enumerate(emitted, 1):
            req.append_output_token(tok)
            status = self._check_stop(req, tok)
            if status is not None:
                break
        req.num_new_tokens = n
        req.num_computed_tokens = min(row.num_computed_tokens + len(emitted), req.num_tokens - 1)
        self.kv.cache_blocks(req)
        if status is not None:
            self.finish_request(req.request_id, status)

    def _check_stop(self, req: Request, token: int) -> Optional[RequestStatus]:
        status = self.check_stop(req, token)
        # P sampling a first token for D: one token, then handed off (`Request.handed_off` tells it from a real end)
        return RequestStatus.FINISHED_LENGTH if status is None and req.hands_off_first_token else status

    def check_stop(self, req: Request, token: int) -> Optional[RequestStatus]:
        """As vLLM: before min_tokens only the end of the context stops a request; then EOS, a stop token id (the
        stop_reason), and only then the length caps (a stop token that is also the last allowed one is a stop)."""
        sp = req.sampling_params
        capped = req.num_tokens >= self.max_model_len or req.num_output_tokens >= req.max_tokens
        if req.num_output_tokens < sp.min_tokens:
            return RequestStatus.FINISHED_LENGTH if capped else None
        if not sp.ignore_eos and token in req.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if token in sp.stop_token_ids:
            req.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        return RequestStatus.FINISHED_LENGTH if capped else None

    def finish_request(self, request_id: str, status: RequestStatus, error: Optional[str] = None) -> Optional[Request]:
        """Finish (stop, abort, fail) a request in any state and free its blocks. Unknown ids are ignored."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        if req in self.running:
            self.running.remove(req)
        elif not self.transfers.take(req):
            self.waiting.remove(req)
        loading = req.status == RequestStatus.WAITING_FOR_REMOTE_KV
        req.status = status
        req.error = error
        self.transfers.finish(req, status, loading)
        return req

    def check_invariants(self) -> None:
        self.kv.check_invariants()
        owners = {r.request_id for q in (self.running, self.waiting) for r in q} | self.transfers.owners()
        assert set(self.kv.req_blocks) <= owners, f"blocks held by unknown requests: {set(self.kv.req_blocks) - owners}"
        for r in self.waiting:  # only requests with imported KV (ready) or KV on its way (loading) hold blocks
            assert r.request_id not in self.kv.req_blocks and r.num_computed_tokens == 0, f"{r} waits holding blocks"
            assert not r.num_output_placeholders, f"{r} waits with an in-flight token (it lands in its preempting step)"
        assert all(r.num_output_placeholders in (0, 1) for r in self.running), "more than one step in flight"
        self.transfers.check_invariants()
