"""Which graph a step runs: the full-graph rule (a pure classification of the scheduled rows) and the dispatcher.

A row is decode-shaped when it schedules exactly q = 1 + num_speculative_tokens tokens over prior context
(num_computed_tokens > 0). The rule only decides graph eligibility; what a row reads, how attention splits it,
whether it samples and where it writes KV all still follow the row's own phase.

- strict: every row past its prompt and scheduling q tokens (vLLM MRv2 before the fix);
- prompt-tail: the seed's fix: on a P/D consumer, with q == 1 and max query len 1, a prefill row with prior
  context does not block;
- decode-shaped (default): every row decode-shaped, any role, any q.
Under every rule a fresh prompt row (num_computed_tokens == 0) blocks FULL: stateful layers read "no prior
state" as a prefill.
"""
from __future__ import annotations

import bisect
import enum
import operator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Optional, Sequence, Union

if TYPE_CHECKING:
    from pdserve.config import EngineConfig

Rule = Literal["strict", "prompt-tail", "decode-shaped"]
# Why a step is not FULL: its rows (prefill, non_uniform), its size (over_capture_size: more tokens than the largest
# capture; no_full_size: no FULL graph for its query length holds it), or the policy (full_disabled: a FULL-eligible
# step under a mode without FULL graphs, PIECEWISE; eager_forced: NONE or --enforce-eager).
Reason = Literal["prefill", "non_uniform", "over_capture_size", "no_full_size", "full_disabled", "eager_forced"]
RULES: tuple[Rule, ...] = ("strict", "prompt-tail", "decode-shaped")


class CUDAGraphMode(enum.Enum):
    """Runtime modes (NONE, PIECEWISE, FULL) and policies (FULL_DECODE_ONLY, FULL_AND_PIECEWISE), as vLLM."""
    NONE = "NONE"
    PIECEWISE = "PIECEWISE"
    FULL = "FULL"
    FULL_DECODE_ONLY = "FULL_DECODE_ONLY"
    FULL_AND_PIECEWISE = "FULL_AND_PIECEWISE"

    def decode_mode(self) -> "CUDAGraphMode":
        """Runtime mode for a FULL-eligible batch."""
        return {"NONE": CUDAGraphMode.NONE, "PIECEWISE": CUDAGraphMode.PIECEWISE}.get(self.value, CUDAGraphMode.FULL)

    def mixed_mode(self) -> "CUDAGraphMode":
        """Runtime mode for any other batch (our attention has no FULL graph for mixed batches)."""
        return CUDAGraphMode.PIECEWISE if self in (CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL_AND_PIECEWISE) \
            else CUDAGraphMode.NONE


@dataclass(frozen=True)
class BatchDescriptor:
    """What a graph was captured for. uniform_query_len is 0 for PIECEWISE (token count only)."""
    num_tokens: int
    num_reqs: int
    uniform_query_len: int


@dataclass(frozen=True)
class Classification:
    full_eligible: bool
    uniform_query_len: Optional[int]  # set when every row schedules the same number of tokens
    reason: Optional[Reason]  # why not FULL-eligible; None when eligible


def classify(num_scheduled: Sequence[int], num_computed: Sequence[int], prefill_lens: Sequence[int], q: int,
             rule: Rule, is_pd_consumer: bool) -> Classification:
    """Graph eligibility of one step's rows (three parallel sequences). Pure: no engine state. A row's prefill_len
    is its prompt's, or after a preemption every token it had then (Request.prefill_len, as vLLM's MRv2)."""
    # Builtins over whole sequences (min/max/map run in C): this runs every step over up to max_num_seqs rows.
    if not num_scheduled:
        return Classification(False, None, "non_uniform")
    lo, hi = min(num_scheduled), max(num_scheduled)
    uniform = lo if lo == hi else None
    if min(num_computed) == 0:
        return Classification(False, uniform, "prefill")
    if rule == "strict" or (rule == "prompt-tail" and not (is_pd_consumer and q == 1 and uniform == 1)):
        if any(map(operator.lt, num_computed, prefill_lens)):
            return Classification(False, uniform, "prefill")
    elif rule not in RULES:
        raise ValueError(f"unknown full_graph_rule {rule!r}; choose from {', '.join(RULES)}")
    if uniform != q:
        # A row off the uniform length is a prefill chunk when it is still inside its prompt.
        off = [(c, p) for n, c, p in zip(num_scheduled, num_computed, prefill_lens) if n != q]
        return Classification(False, uniform, "prefill" if any(c < p for c, p in off) else "non_uniform")
    return Classification(True, q, None)


def _upto_rows(sizes: list[int], q: int, max_rows: Optional[int]) -> list[int]:
    if max_rows is None:
        return sizes
    i = bisect.bisect_left(sizes, q * max_rows)
    return sizes[:i + 1]


class CudagraphDispatcher:
    """Maps a step to (runtime mode, padded descriptor, reason). FULL decode descriptors are preferred for eligible
    batches, PIECEWISE (by token count) for the rest, NONE when nothing fits or eager is forced."""

    def __init__(self, capture_sizes: Sequence[int], mode: CUDAGraphMode, enforce_eager: bool,
                 q: Union[int, Sequence[int]] = 1, max_rows: Optional[int] = None):
        """`q`: the uniform query length(s) FULL graphs exist for: 1, and with speculative decoding also 1 + K
        (a step that drafts nothing, e.g. under disable_by_batch_size, stays on q = 1 graphs). `max_rows`
        (max_num_seqs): no FULL graph has more rows than the first size that holds that many, since a batch never
        does."""
        self.sizes = sorted(set(capture_sizes))
        self.max_size = self.sizes[-1] if self.sizes else 0
        self.mode = CUDAGraphMode.NONE if enforce_eager else mode
        self.qs = (q,) if isinstance(q, int) else tuple(sorted(set(q)))
        self.q = self.qs[-1]
        # padding table: token count -> smallest captured size that fits
        self.pad = [0] * (self.max_size + 1)
        for n in range(1, self.max_size + 1):
            self.pad[n] = self.sizes[bisect.bisect_left(self.sizes, n)]
        # per query length: token count -> smallest FULL size (a multiple of q) that fits
        self.full_sizes = {q: _upto_rows([s for s in self.sizes if s % q == 0], q, max_rows) for q in self.qs}
        self.full_pad: dict[int, dict[int, int]] = {}
        for q, sizes in self.full_sizes.items():
            table = self.full_pad[q] = {}
            for n in range(1, self.max_size + 1):
                i = bisect.bisect_left(sizes, n)
                if i < len(sizes):
                    table[n] = sizes[i]

    def full_descriptors(self) -> list[BatchDescriptor]:
        if self.mode.decode_mode() != CUDAGraphMode.FULL:
            return []
        return [BatchDescriptor(s, s // q, q) for q in self.qs for s in self.full_sizes[q]]

    def piecewise_descriptors(self) -> list[BatchDescriptor]:
        if CUDAGraphMode.PIECEWISE not in (self.mode.decode_mode(), self.mode.mixed_mode()):
            return []
        return [BatchDescriptor(s, s, 0) for s in self.sizes]

    def dispatch(self, num_tokens: int, num_reqs: int, cls: Classification
                 ) -> tuple[CUDAGraphMode, BatchDescriptor, Optional[Reason]]:
        if self.mode == CUDAGraphMode.NONE:
            return CUDAGraphMode.NONE, BatchDescriptor(num_tokens, num_reqs, 0), "eager_forced"
        if num_tokens > self.max_size:
            reason = "over_capture_size" if cls.full_eligible else cls.reason
            return CUDAGraphMode.NONE, BatchDescriptor(num_tokens, num_reqs, 0), reason
        runtime = self.mode.decode_mode() if cls.full_eligible else self.mode.mixed_mode()
        q = cls.uniform_query_len
        if runtime == CUDAGraphMode.FULL and num_tokens in self.full_pad.get(q, ()):
            padded = self.full_pad[q][num_tokens]
            return CUDAGraphMode.FULL, BatchDescriptor(padded, padded // q, q), None
        if cls.full_eligible and runtime == CUDAGraphMode.FULL:  # FULL-eligible but no FULL size fits
            runtime = self.mode.mixed_mode()
            reason: Optional[Reason] = "no_full_size"
        elif cls.full_eligible:
            reason = "full_disabled"
        else:
            reason = cls.reason
        if runtime == CUDAGraphMode.PIECEWISE:
            return CUDAGraphMode.PIECEWISE, BatchDescriptor(self.pad[num_tokens], num_reqs, 0), reason
        return CUDAGraphMode.NONE, BatchDescriptor(num_tokens, num_reqs, 0), reason


def dispatcher_for(config: "EngineConfig") -> CudagraphDispatcher:
    """The dispatcher an engine with `config` runs: its capture ladder and graph policy. A function of the config
    alone, so the model runner and the fleet simulator (pdserve/sim) pad and label steps by the same table."""
    sched, comp = config.scheduler, config.compilation
    uniform_query_len = 1 + config.num_speculative_tokens
    capture_sizes = comp.capture_sizes(sched.max_num_seqs)
    if uniform_query_len > 1 and not comp.cudagraph_capture_sizes:
        # the FULL ladder becomes q x {1, 2, 4, 8, ...} rows (the default ladder read as row counts, up to
        # the first that holds max_num_seqs)
        q = uniform_query_len
        rows = [s for s in capture_sizes if s < sched.max_num_seqs]
        rows.append(next((s for s in capture_sizes if s >= sched.max_num_seqs), sched.max_num_seqs))
        capture_sizes = sorted(set(capture_sizes) | {q * s for s in rows})
    return CudagraphDispatcher(capture_sizes, CUDAGraphMode(comp.cudagraph_mode), comp.enforce_eager,
                               sorted({1, uniform_query_len}), sched.max_num_seqs)


_SCHEDULED = operator.attrgetter("num_scheduled_tokens")
_COMPUTED = operator.attrgetter("num_computed_tokens")
_PREFILL_LEN = operator.attrgetter("request.prefill_len")
_DRAFTS = operator.attrgetter("draft_token_ids")


def choose_graph(dispatcher: CudagraphDispatcher, rows, uniform_query_len: int, rule: Rule, is_pd_consumer: bool
                 ) -> tuple[CUDAGraphMode, BatchDescriptor, Optional[Reason], int]:
    """(runtime mode, padded descriptor, reason, unpadded tokens) for a step's `rows` (ScheduledRows, read before
    the step's update). A step without drafts rides q = 1 graphs even with speculative decoding."""
    num_scheduled = list(map(_SCHEDULED, rows))
    num_tokens = sum(num_scheduled)
    q = uniform_query_len if uniform_query_len > 1 and any(map(_DRAFTS, rows)) else 1
    cls = classify(num_scheduled, list(map(_COMPUTED, rows)), list(map(_PREFILL_LEN, rows)), q, rule, is_pd_consumer)
    return (*dispatcher.dispatch(num_tokens, len(rows), cls), num_tokens)
