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
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from pdserve.config import EngineConfig
from pdserve.core.kv_cache_manager import KVCacheManager
from pdserve.core.kv_transfers import KVTransfers
from pdserve.core.scheduler import Scheduler
from pdserve.request import Request
from pdserve.sampling_params import SamplingParams
from pdserve.sched_output import SchedulerOutput, cdiv
from pdserve.sim.connector import SimConnector
from pdserve.sim.profile import Profile, StepShape
from pdserve.sim.trace import FIRST_TOKEN_ID
from pdserve.spec_decode.rejection_sampler import PLACEHOLDER_TOKEN_ID
from pdserve.worker.cudagraph_dispatch import choose_graph, dispatcher_for
from pdserve.worker.graph_metrics import GraphStats

DEFAULT_MAX_MODEL_LEN = 4096  # the engine's cap on a model's max_position_embeddings


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
        self.busy_until = 0.0
        self.num_steps = 0
        # tests: a step's sampled tokens from elsewhere (a recorded engine run), in place of the stand-in's
        self.sampler: Optional[Callable[[SchedulerOutput], list]] = None

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
        first = (kv_transfer_params or {}).get("first_token") if (kv_transfer_params or {}).get(
            "do_remote_prefill") else None
        if first is not None:  # D: P's first token, taken as the engine's _take_first_token takes it
            if first.get("key") == params.first_token_key():
                req.append_output_token(first["id"])
            else:  # drawn with other params: replayed here (never in a simulation: both sides use the trace's)
                req.kv_transfer_params = {k: v for k, v in kv_transfer_params.items() if k != "first_token"}
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
        if self.connector is not None:
            self.connector.now = now
            self.scheduler.process_transfers(self.connector.get_finished())  # no load fails here
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
        rows = [(r.request.request_id, r.num_computed_tokens, r.num_scheduled_tokens) for r in out.rows]
        sampled = self.sampler(out) if self.sampler is not None else self._sample(out)
        updated = self.scheduler.update_from_output(out, sampled)
        for r in updated:
            if r.is_finished:
                self._follow.pop(r.request_id, None)
        self.num_steps += 1
        self.busy_until = now + dt
        return StepRecord(now, now + dt, mode.value, reason, num_tokens, desc.num_tokens, rows,
                          [r.request_id for r in out.preempted], [(r, r.num_new_tokens) for r in updated])

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
            self.scheduler.process_transfers(self.connector.get_finished())
        return start

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


def _shape(out: SchedulerOutput, mode: str, padded: int, num_tokens: int) -> StepShape:
    ctx = pairs = 0
    for r in out.rows:
        c, q = r.num_computed_tokens, r.num_scheduled_tokens
        ctx += c + q
        pairs += q * c + q * (q + 1) // 2
    return StepShape(mode, num_tokens, padded, len(out.rows), ctx, pairs)
