"""The contract between the scheduler and the worker, as vLLM's `v1/core/sched/output.py`: what the scheduler hands
the model runner for one step (`SchedulerOutput`, its `ScheduledRow`s), what the runner hands back
(`ModelRunnerOutput`), and the few shared constants and helpers both sides need. A leaf: it imports only `request`,
so the worker never imports the scheduler and the scheduler never imports the worker."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from pdserve.request import Request

NULL_BLOCK = 0  # block 0: never free, never owned, never cached; padded rows write and read it (block_pool.py)

NO_DRAFTS: tuple = ()


def cdiv(a: int, b: int) -> int:
    """Ceiling division: blocks that `a` tokens take at `b` tokens a block."""
    return -(-a // b)


@dataclass
class ScheduledRow:
    request: Request  # the runner reads its tokens, prefill_len and sampling params (and keys its own state by it)
    num_computed_tokens: int  # tokens whose KV is in the request's blocks when the step starts
    num_scheduled_tokens: int  # query length of the row this step (drafts included)
    # Speculative decoding: the K scheduled tokens after the last known one (PLACEHOLDER_TOKEN_ID where the
    # proposer found none); their positions are scored too.
    draft_token_ids: Sequence[int] = NO_DRAFTS

    @property
    def samples(self) -> bool:
        """The row ends at the request's last known token (plus drafts), so its logits give the next token(s)."""
        return self.num_computed_tokens + self.num_scheduled_tokens - len(self.draft_token_ids) == \
            self.request.num_tokens


@dataclass
class SchedulerOutput:
    rows: list[ScheduledRow] = field(default_factory=list)  # what the runner computes this step, in order
    preempted: list[Request] = field(default_factory=list)  # freed this step (the step then admits nothing)

    @property
    def num_tokens(self) -> int:
        return sum(r.num_scheduled_tokens for r in self.rows)


@dataclass
class ModelRunnerOutput:
    # per scheduler row: the new token, None for a prompt chunk that is not last, or a drafting row's emitted
    # tokens (a list); logprobs likewise (a list of entries for a drafting row)
    sampled: list
    logprobs: list
    # request id -> the prompt-logprob entries this step made (worker/prompt_logprobs.py), for the output processor
    prompt_logprobs: dict = field(default_factory=dict)
