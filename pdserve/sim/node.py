"""One simulated pdserve node: the engine's own Scheduler, KVCacheManager, BlockPool, KVTransfers and graph
dispatcher, driven through the calls `LLMEngine.step` makes (poll transfers -> schedule -> connector loads ->
graph choice -> run -> update_from_output); only the model forward is replaced by a step-time profile and a
stand-in sampler.

The stand-in sampler gives every row that samples (`ScheduledRow.samples`) a token id that is never EOS or a stop
token (the requests are made with `ignore_eos` and no stop ids), so every request runs to its trace's output length
through the scheduler's own stop checks. With speculative decoding its tokens repeat as text does (`_token`), so the
engine's n-gram proposer finds drafts, and a drafting row gets its accepted drafts, each kept with probability
`spec_acceptance` until the first rejection (placeholders are always rejected, as the rejection sampler's), then one
more token.

Event-leaping (`Leap`, when the simulator leaps: its default): while a node's batch is a steady decode run
(every running request one plain decode token from its next sample, nothing it could admit, no transfer due), its
next steps are planned at once (`plan_leap`) and applied when the run's chunk ends or when something touches the
node first (`catch_up`): the same allocations in the same order, tokens from the same rng draws, the same
publications, graph labels and step times as that many `step` calls, without running the scheduler.
"""
from __future__ import annotations

import bisect
import random
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from pdserve.config import EngineConfig
from pdserve.core.kv_cache_manager import KVCacheManager
from pdserve.core.kv_transfers import KVTransfers
from pdserve.core.scheduler import Scheduler
from pdserve.request import Request
from pdserve.sampling_params import SamplingParams
from pdserve.sched_output import NO_DRAFTS, ScheduledRow, SchedulerOutput, cdiv
from pdserve.sim.connector import SimConnector
from pdserve.sim.profile import Profile, StepShape
from pdserve.sim.trace import FIRST_TOKEN_ID
from pdserve.spec_decode.rejection_sampler import PLACEHOLDER_TOKEN_ID
from pdserve.worker.cudagraph_dispatch import choose_graph, dispatcher_for
from pdserve.worker.graph_metrics import GraphStats

DEFAULT_MAX_MODEL_LEN = 4096  # the engine's cap on a model's max_position_embeddings
# A leap is planned in chunks, the first this many steps, doubling while nothing cuts them short (up to the last):
# what a cut wastes (step times computed for steps never taken) stays within what the chunk before it took.
LEAP_FIRST_CHUNK, LEAP_MAX_CHUNK = 8, 4096


@dataclass
class StepRecord:
    """One simulated step, in the terms the engine's step has: its rows as scheduled, the graph the dispatcher
    chose, what the update emitted and finished."""
    start: float
    end: float
    mode: str  # "" for a step that only preempted (nothing ran)
    reason: Optional[str]
    num_tokens: int
    padded_tokens: int
    rows: list[tuple[str, int, int]]  # (request id, num_computed_tokens, num_scheduled_tokens), in order
    preempted: list[str] = field(default_factory=list)
    emitted: list[tuple[Request, int]] = field(default_factory=list)  # (request, tokens this step)


@dataclass
class Leap:
    """Planned plain decode steps of a node's running requests (`rows`, in the scheduler's order): step j starts at
    `starts[j]` and ends at `ends[j]`; `allocs` are (step, row index) of each block a row takes on the way, in the
    order `schedule()` would take them. Once applied (`SimNode.catch_up`), `c0` holds each row's
    num_computed_tokens before the leap's first step and `num_steps` the steps applied."""
    rows: list[Request]
    mode: str
    reason: Optional[str]
    num_tokens: int
    padded_tokens: int
    starts: list[float]
    ends: list[float]
    allocs: list[tuple[int, int]]
    finishing: bool  # its last step ends rows (a length cap)
    colds: list[float]  # what each step pays for the idle time before the run (SimNode._cold after it)
    c0: list[int] = field(default_factory=list)
    num_steps: int = 0

    def records(self) -> list[StepRecord]:
        """The applied steps as `SimNode.step` would have returned them, one StepRecord each (made when the leap
        is applied: the requests in `emitted` are then in their state after its last step)."""
        return [StepRecord(self.starts[j], self.ends[j], self.mode, self.reason, self.num_tokens, self.padded_tokens,
                           [(r.request_id, c + j, 1) for r, c in zip(self.rows, self.c0)], [],
                           [(r, 1) for r in self.rows]) for j in range(self.num_steps)]


def num_blocks_for(config: EngineConfig, kv_bytes_per_token: float, max_model_len: int) -> int:
    """KV blocks of a node, the null block included, as the engine sizes them on CPU: the override, else
    kv_cache_memory_gb over the profile's bytes per block, capped at max_num_seqs full-length sequences."""
    cc = config.cache
    per_seq = cdiv(max_model_len, cc.block_size)
    if cc.num_gpu_blocks_override is not None:
        n = cc.num_gpu_blocks_override
    else:
        per_block = kv_bytes_per_token * cc.block_size
        n = min(int(cc.kv_cache_memory_gb * 2 ** 30 // per_block), config.scheduler.max_num_seqs * per_seq) + 1
    if n - 1 < per_seq:
        flag = "--num-gpu-blocks-override" if cc.num_gpu_blocks_override is not None else "--kv-cache-memory-gb"
        raise ValueError(f"the KV cache ({n - 1} blocks of {cc.block_size} tokens) cannot hold one max_model_len "
                         f"({max_model_len}) sequence; raise {flag} or lower --max-model-len")
    return n


class SimNode:
    def __init__(self, name: str, config: EngineConfig, profile: Profile, max_model_len: int, num_blocks: int,
                 connector: Optional[SimConnector] = None, spec_acceptance: float = 0.0, vocab_size: int = 32000,
                 seed: int = 0, device: str = "sim"):
        self.name, self.config, self.profile, self.max_model_len = name, config, profile, max_model_len
        self.kv = KVCacheManager(num_blocks, config.cache.block_size, config.cache.enable_prefix_caching)
        self.connector = connector
        policy = config.kv_transfer.kv_load_failure_policy if config.kv_transfer else "recompute"
        transfers = KVTransfers(self.kv, connector, policy)
        # the engine's own scheduler, built as LLMEngine builds it
        self.scheduler = Scheduler(config.scheduler, self.kv, max_model_len, config.speculative_config, transfers)
        self.dispatcher = dispatcher_for(config)
        self.uniform_query_len = 1 + config.num_speculative_tokens
        self.rule = config.compilation.full_graph_rule
        self.is_pd_consumer = connector is not None and connector.role == "kv_consumer"
        # the engine on this device schedules a step while the last one runs (CUDA's default, not with spec decode,
        # as LLMEngine decides): it starts loads after schedule() and never waits (EngineStep._load_early is sync's)
        self.async_engine = config.scheduler.use_async_scheduling("cuda" if device == "cuda" else "cpu") and \
            config.speculative_config is None
        self.graph_stats = GraphStats(device, captured=False)
        self.spec_acceptance = spec_acceptance if config.speculative_config is not None else 0.0
        self.spec_counts = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0,
                            "num_placeholder_tokens": 0}
        self.vocab_size = vocab_size
        self.rng = random.Random(seed)
        self._follow: dict[str, tuple[dict, int]] = {}  # request id -> (token -> latest successor, tokens indexed)
        self.busy_until = 0.0  # when its last step ends (or ended)
        self._cold = 0.0  # what its last step paid for the idle time before it (the profile's `idle` section)
        # the nodes sharing this one's machine (itself included; `--shared-host`): each one mid-step slows a step
        # that starts by the profile's served.neighbour_scale. None: a machine of its own.
        self.host: Optional[list["SimNode"]] = None
        self.num_steps = 0
        self.num_rows = 0  # rows over all steps
        self.busy_s = 0.0  # simulated seconds spent in steps
        # tests: a step's sampled tokens from elsewhere (a recorded engine run), in place of the stand-in's
        self.sampler: Optional[Callable[[SchedulerOutput], list]] = None
        # Leaping needs the stand-in sampler without speculative decoding: one random token a row a step, so the
        # leap can draw a run's tokens in step order. With drafts a step's tokens and computed counts hang on the
        # proposer and the acceptance draws, so such a node steps one step at a time.
        self.can_leap = config.speculative_config is None
        self.leap: Optional[Leap] = None  # planned, not yet applied
        self._leap_graph: dict[int, tuple] = {}  # rows -> choose_graph's answer for a decode run of that many
        self._chunk = LEAP_FIRST_CHUNK

    def make_request(self, request_id: str, prompt_token_ids: list[int], output_len: int, arrival_time: float,
                     kv_transfer_params: Optional[dict] = None) -> Request:
        """A request as the engine's make_request builds it for `max_tokens=output_len, ignore_eos=True`; the
        engine's prompt checks (ValueError, the same messages)."""
        n = len(prompt_token_ids)
        if n >= self.max_model_len:
            raise ValueError(f"prompt has {n} tokens but max_model_len is {self.max_model_len}")
        if n + output_len > self.max_model_len:
            raise ValueError(f"prompt ({n} tokens) plus max_tokens ({output_len}) exceeds max_model_len "
                             f"({self.max_model_len})")
        params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0)
        req = Request(request_id, prompt_token_ids, params, frozenset(), arrival_time, max_tokens=output_len,
                      kv_transfer_params=kv_transfer_params)
        if (kv_transfer_params or {}).get("do_remote_prefill"):
            _take_first_token(req, kv_transfer_params)
        return req

    def add(self, req: Request) -> None:
        """The scheduler takes `req`; a D request with P's first token then answers it at admission, through the
        same stop checks (LLMEngine._first_output): a token that ends the request finishes it here."""
        self.scheduler.add_request(req)
        if req.num_output_tokens:
            req.num_new_tokens = 1
            status = self.scheduler.check_stop(req, req.output_token_ids[0])
            if status is not None:
                self.scheduler.finish_request(req.request_id, status)

    def has_work(self) -> bool:
        return self.scheduler.has_unfinished()

    def next_transfer_event(self) -> Optional[float]:
        return self.connector.next_event() if self.connector is not None else None

    def step(self, now: float) -> Optional[StepRecord]:
        """One engine step at `now`; None when there was nothing to do (loads in flight, or idle)."""
        assert self.leap is None, "a planned leap is applied (catch_up) before the node steps again"
        if self.connector is not None:
            self.connector.now = now
            self._process_transfers()
            now = self._load_early(now)
        out = self.scheduler.schedule()
        if self.connector is not None:
            self.connector.start_load_kv(self.connector.build_connector_meta())
        if not out.rows:
            # a running request that preempted itself (the blocks it needs held by loads or imports): the engine
            # returns at once and its loop steps again, so this step takes no time but is not idle
            return StepRecord(now, now, "", None, 0, 0, [], [r.request_id for r in out.preempted]) \
                if out.preempted else None
        mode, desc, reason, num_tokens = choose_graph(self.dispatcher, out.rows, self.uniform_query_len, self.rule,
                                                      self.is_pd_consumer)
        self.graph_stats.record(mode.value, num_tokens, desc.num_tokens, len(out.rows), reason)
        dt = self.profile.step_time(_shape(out, mode.value, desc.num_tokens, num_tokens))
        if self.host is not None:
            busy = sum(n is not self and n.busy_until > now for n in self.host)
            dt *= 1.0 + self.profile.served.neighbour_scale * busy
        self._cold = self.profile.idle.extra(now - self.busy_until, self._cold)
        dt += self._cold
        rows = [(r.request.request_id, r.num_computed_tokens, r.num_scheduled_tokens) for r in out.rows]
        sampled = self.sampler(out) if self.sampler is not None else self._sample(out)
        updated = self.scheduler.update_from_output(out, sampled)
        for r in updated:
            if r.is_finished:
                self._follow.pop(r.request_id, None)
        self.num_steps += 1
        self.num_rows += len(out.rows)
        self.busy_until = end = now + dt
        self.busy_s += end - now
        self._chunk = LEAP_FIRST_CHUNK
        return StepRecord(now, end, mode.value, reason, num_tokens, desc.num_tokens, rows,
                          [r.request_id for r in out.preempted], [(r, r.num_new_tokens) for r in updated])

    def plan_leap(self, now: float) -> bool:
        """At a step's start (`now`, the node free): when the batch is a steady decode run, plan its next steps
        (up to the chunk size) as a `Leap` and say so; the simulator wakes the node at `busy_until`, the planned
        run's end, or the start of its last step when that step ends rows. Steady: every running request has one
        token to compute, which samples (a plain decode row of 1 token, past its prefill), and only a length cap
        can stop it; the budget holds every row; nothing is admitted (no request waits or is ready, or every seat
        is taken); the connector has nothing queued or released. The run ends with the first step that ends a row
        (taken at its start, as step by step takes it: the router sees the finish then), before the first step
        whose allocation the free blocks cannot supply (a normal step preempts), and before the first step that
        starts at or after the connector's next event (a load ending, a lease expiring: its poll would see it).
        Whatever else could change the batch touches the node from outside (a request routed here, a lease
        released), and the simulator applies the steps that started before it first (`catch_up`)."""
        if not self.can_leap or self.sampler is not None:
            return False
        sched = self.scheduler
        running = sched.running
        num_rows = len(running)
        sc = self.config.scheduler
        if not num_rows or num_rows > sc.max_num_batched_tokens:  # a guard: admission stops when the budget is
            return False  # spent, so the running rows fit it (schedule() would leave the rest out)
        if (sched.waiting or sched.transfers.ready) and num_rows < sc.max_num_seqs:
            return False
        conn = self.connector
        if conn is not None and (conn.queued or conn.released):
            return False
        last = LEAP_MAX_CHUNK  # the step (from 0) at which the first row appends its last allowed token
        mml = self.max_model_len
        for r in reversed(running):  # the latest admitted first: the likeliest to be still in its prefill
            c = r.num_computed_tokens
            sp = r.sampling_params
            if r.num_tokens - c != 1 or c < r.prefill_len or r.num_output_placeholders or \
                    r.hands_off_first_token or sp.stop_token_ids or (r.eos_token_ids and not sp.ignore_eos):
                return False
            last = min(last, r.max_tokens - r.num_output_tokens - 1, mml - r.num_tokens - 1)  # check_stop's caps
        steps = min(self._chunk, last + 1)
        # each row takes a block at the step whose token is the first past its slots, then every block_size steps
        # (allocate_slots' need), rows in order within a step
        bs = self.kv.block_size
        allocs = []
        for i, r in enumerate(running):
            for j in range(len(self.kv.blocks_of(r.request_id)) * bs - r.num_computed_tokens, steps, bs):
                allocs.append((j, i))
        allocs.sort()
        free = self.kv.num_free_blocks()
        if len(allocs) > free:
            steps = allocs[free][0]  # that step's schedule() would preempt
            if steps <= 0:
                return False
        graph = self._leap_graph.get(num_rows)
        if graph is None:
            # rows of 1 token each past their prefill are decode-shaped under every rule, at every step of the run:
            # the dispatcher's answer depends on the row count alone
            rows = [ScheduledRow(r, r.num_computed_tokens, 1, NO_DRAFTS) for r in running]
            graph = self._leap_graph[num_rows] = choose_graph(self.dispatcher, rows, self.uniform_query_len,
                                                              self.rule, self.is_pd_consumer)
        mode, desc, reason, num_tokens = graph
        nxt = conn.next_event() if conn is not None else None
        ctx = sum(r.num_computed_tokens for r in running) + num_rows  # _shape's context: c + 1 a row, +1 a step
        starts, ends, colds = [], [], []
        t = now
        step_time, m, idle = self.profile.step_time, mode.value, self.profile.idle
        cold, gap = self._cold, now - self.busy_until  # as `step` reads them: only the first step follows a gap
        for _ in range(steps):
            if nxt is not None and t >= nxt:
                break
            starts.append(t)
            cold = idle.extra(gap, cold)
            gap = 0.0
            t = t + (step_time(StepShape(m, num_tokens, desc.num_tokens, num_rows, ctx, ctx)) + cold)
            ends.append(t)
            colds.append(cold)
            ctx += num_rows
        if not starts:
            return False
        n = len(starts)
        finishing = n == last + 1
        self.leap = Leap(list(running), m, reason, num_tokens, desc.num_tokens, starts, ends,
                         [a for a in allocs if a[0] < n], finishing, colds)
        self.busy_until = starts[-1] if finishing else ends[-1]
        return True

    def catch_up(self, now: float, at_end: bool = False) -> Optional[Leap]:
        """Apply the planned leap's steps that started before `now` (its first always: it started when it was
        planned, before whatever touches the node now), as that many `step` calls would have left the node, and
        drop the rest; returns the leap with what was applied (None without one). `at_end`: the simulator's wake
        at `busy_until`, which applies all of it (a finishing last step included, which starts then), and the
        next chunk may be twice as long."""
        lp = self.leap
        if lp is None:
            return None
        self.leap = None
        starts = lp.starts
        m = len(starts) if at_end else max(1, bisect.bisect_left(starts, now))
        if m < len(starts):
            lp.finishing = False
            del starts[m:], lp.ends[m:], lp.colds[m:]
        self._chunk = min(2 * self._chunk, LEAP_MAX_CHUNK) if at_end else LEAP_FIRST_CHUNK
        rows, kv, sched = lp.rows, self.kv, self.scheduler
        num_rows = len(rows)
        c0 = lp.c0 = [r.num_computed_tokens for r in rows]
        lp.num_steps = m
        # the stand-in sampler's draws, in step order then row order, as m `_sample` calls make them
        rnd, span = self.rng.random, self.vocab_size - FIRST_TOKEN_ID
        draws = [FIRST_TOKEN_ID + int(rnd() * span) for _ in range(m * num_rows)]  # _random_token's, inlined
        # What touches the block pool, in the order m steps touch it: step j's schedule() takes a row's block
        # (phase 0), then its update publishes the block the row's token filled (phase 1, kind 0: cache_blocks) and,
        # in a finishing last step, frees the rows that end (kind 1), rows in order. After its last update a
        # running row has published every full computed block, so only a step that fills a block publishes one.
        # A row's tokens are appended as far as each of its events needs them, so its block hashes come from the
        # same tokens at the same point as step by step.
        events = [(j, 0, i, 0) for j, i in lp.allocs if j < m]
        if kv.pool.enable_caching:
            bs = kv.block_size
            for i, c in enumerate(c0):
                for j in range(-(c + 1) % bs, m, bs):
                    events.append((j, 1, i, 0))
        if lp.finishing:
            mml = self.max_model_len
            for i, r in enumerate(rows):
                if r.num_output_tokens + m >= r.max_tokens or r.num_tokens + m >= mml:
                    events.append((m - 1, 1, i, 1))
        events.sort()
        appended = [0] * num_rows
        for j, phase, i, kind in events:
            req = rows[i]
            if phase == 0:  # room for the token at position c0 + j (allocate_slots' need: one block)
                if not kv.allocate_slots(req, c0[i] + j + 1 - req.num_computed_tokens):
                    raise AssertionError(f"leap: no block for {req.request_id} at its step {j}")  # plan_leap's bound
                continue
            for tok in draws[i + appended[i] * num_rows:i + j * num_rows:num_rows]:
                req.append_output_token(tok)
            appended[i] = j
            req.num_computed_tokens = c0[i] + j + 1
            if kind == 0:
                kv.cache_blocks(req)
                continue
            tok = draws[i + j * num_rows]  # the last step's token ends it, through the scheduler's stop checks
            req.append_output_token(tok)
            appended[i] = m
            req.num_new_tokens = 1
            status = sched.check_stop(req, tok)
            if status is None:
                raise AssertionError(f"leap: {req.request_id} was to end at its step {j}")
            sched.finish_request(req.request_id, status)
        for i, req in enumerate(rows):
            for tok in draws[i + appended[i] * num_rows::num_rows]:
                req.append_output_token(tok)
            req.num_computed_tokens = c0[i] + m
            req.num_new_tokens = 1
        record = self.graph_stats.record
        for _ in range(m):
            record(lp.mode, lp.num_tokens, lp.padded_tokens, num_rows, lp.reason)
        self.num_steps += m
        self.num_rows += m * num_rows
        for s, e in zip(starts, lp.ends):  # added one by one, as step by step adds them (the same float sum)
            self.busy_s += e - s
        self.busy_until = lp.ends[-1]
        self._cold = lp.colds[-1]
        if self.connector is not None:
            self.connector.now = starts[-1]  # as the last step's poll set it
        return lp

    def _load_early(self, now: float) -> float:
        """As the engine's `EngineStep._load_early`: the queue head's loads start before the step is scheduled
        (`Scheduler.start_loads`), and the step waits for them up to the link's `load_wait_s` (kv_load_wait_ms), so
        a load that ends within it joins this step. Returns when the step then starts."""
        if self.async_engine or not self.scheduler.start_loads():
            return now
        meta = self.connector.build_connector_meta()
        pending = {job.request_id for job in meta.loads if job.dst_blocks}
        self.connector.start_load_kv(meta)
        ends = self.connector.load_ends(pending)
        if not ends or not self.connector.fabric.transfer.load_wait_s:
            return now
        deadline = now + self.connector.fabric.transfer.load_wait_s
        start = max(ends) if max(ends) <= deadline else deadline  # the engine polls until all end, or the deadline
        if start > now:
            self.connector.now = start
            self._process_transfers()
        return start

    def _process_transfers(self) -> None:
        """The connector's finished transfers at its `now`, as the engine's poll applies them: an await's params
        first (LLMEngine.take_awaited: P's first token becomes the request's, through the stop checks), then the
        scheduler's P/D half."""
        fin = self.connector.get_finished()
        for rid, (params, _) in fin.params.items():
            req = self.scheduler.requests.get(rid)
            if req is None or rid not in fin.done_recving:
                continue
            if _take_first_token(req, params):
                req.num_new_tokens = 1
                status = self.scheduler.check_stop(req, req.output_token_ids[0])
                if status is not None:
                    self.scheduler.finish_request(rid, status)
        self.scheduler.process_transfers(fin)

    def _random_token(self) -> int:
        return FIRST_TOKEN_ID + int(self.rng.random() * (self.vocab_size - FIRST_TOKEN_ID))  # randrange's cost / 3

    def _token(self, req: Request, extra: Sequence[int] = ()) -> int:
        """The stand-in model's next token for `req` (followed by `extra`, drafts accepted this step). With
        speculative decoding it repeats itself as text does, so the engine's n-gram proposer finds drafts: with
        probability spec_acceptance the token that followed the latest earlier occurrence of its last token (or,
        for a token not seen before, one from a random place in its context, where copying then goes on), else
        (and without speculative decoding always) a random id."""
        if self.spec_acceptance and self.rng.random() < self.spec_acceptance:
            follow, done = self._follow.setdefault(req.request_id, ({}, 0))
            toks = req.all_token_ids
            for i in range(done, len(toks) - 1):  # index what was appended since: token -> its latest successor
                follow[toks[i]] = toks[i + 1]
            self._follow[req.request_id] = (follow, max(done, len(toks) - 1))
            nxt = follow.get(extra[-1] if extra else toks[-1])
            if nxt is None and len(toks) > 1:  # a token never seen before: start copying a span of the context
                nxt = toks[1 + int(self.rng.random() * (len(toks) - 1))]
            if nxt is not None:
                return nxt
        return self._random_token()

    def _sample(self, out: SchedulerOutput) -> list:
        sampled: list = []
        for row in out.rows:
            if not row.samples:
                sampled.append(None)
            elif row.draft_token_ids:
                sampled.append(self._verify(row.request, row.draft_token_ids))
            else:
                sampled.append(self._token(row.request))
        return sampled

    def _verify(self, req: Request, drafts) -> list[int]:
        """A drafting row's emitted tokens, as greedy verification emits them: each real draft kept with
        probability spec_acceptance until the first rejection, then the model's own token (a correction, never the
        rejected draft) or, when all were kept, the bonus token."""
        c = self.spec_counts
        c["num_drafts"] += 1
        real = [d for d in drafts if d != PLACEHOLDER_TOKEN_ID]
        c["num_placeholder_tokens"] += len(drafts) - len(real)
        c["num_draft_tokens"] += len(real)
        emitted = []
        for d in drafts:
            if d == PLACEHOLDER_TOKEN_ID or self.rng.random() >= self.spec_acceptance:
                break
            emitted.append(d)
        c["num_accepted_tokens"] += len(emitted)
        if len(emitted) < len(drafts) and drafts[len(emitted)] != PLACEHOLDER_TOKEN_ID:
            rejected = drafts[len(emitted)]
            tok = self._random_token()
            while tok == rejected:
                tok = self._random_token()
            return emitted + [tok]
        return emitted + [self._token(req, emitted)]


def _take_first_token(req: Request, params: dict) -> bool:
    """D: `params` become the request's, and P's first token in them its first output, as the engine's
    `_take_first_token` takes it; True when taken. Drawn with other params it is dropped and replayed here (never
    in a simulation: both sides use the trace's)."""
    req.kv_transfer_params = params
    first = params.get("first_token")
    if first is None:
        return False
    if first.get("key") != req.sampling_params.first_token_key():
        req.kv_transfer_params = {k: v for k, v in params.items() if k != "first_token"}
        return False
    req.append_output_token(first["id"])
    return True


def _shape(out: SchedulerOutput, mode: str, padded: int, num_tokens: int) -> StepShape:
    ctx = pairs = 0
    for r in out.rows:
        c, q = r.num_computed_tokens, r.num_scheduled_tokens
        ctx += c + q
        pairs += q * c + q * (q + 1) // 2
    return StepShape(mode, num_tokens, padded, len(out.rows), ctx, pairs)
