"""The verify half of a drafting step: every scored position's target distribution, then exact rejection sampling.

A drafting row (last known token + K drafts) has 1 + K scored positions. Position j's target is what the plain
sampler would sample from had drafts 0..j-1 been emitted: penalties count them as output, `min_tokens` masks EOS
and stop ids while output + j is short of it, then temperature, top-k, top-p and min-p (`filtered_probs`, which
renormalises after each filter through the inverse CDF's scaling). Greedy rows take the argmax of the same
penalised logits. Rows without drafts in the same step (a prompt's last chunk) go through the plain sampler.
Logprobs are of the raw distribution at each emitted token's position, as without speculation.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from pdserve.model.probs import filtered_probs
from pdserve.model.sampler import GREEDY_EPS, Sampler, logprobs_of, penalised
from pdserve.spec_decode.rejection_sampler import PLACEHOLDER_TOKEN_ID, RowDraws, rejection_sample


@dataclass
class SpecDecodeStats:
    """Counters since start, vLLM's definitions: a draft is a row that proposed >= 1 real token; placeholders
    are never draft tokens (and never accepted)."""
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_placeholder_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def record(self, drafts: list[list[int]], num_accepted: list[int]) -> None:
        for d, a in zip(drafts, num_accepted):
            real = sum(1 for t in d if t != PLACEHOLDER_TOKEN_ID)
            self.num_placeholder_tokens += len(d) - real
            if not real:
                continue
            self.num_drafts += 1
            self.num_draft_tokens += real
            self.num_accepted_tokens += a
            if len(self.accepted_per_pos) < len(d):
                self.accepted_per_pos += [0] * (len(d) - len(self.accepted_per_pos))
            for j in range(a):
                self.accepted_per_pos[j] += 1

    def snapshot(self) -> dict:
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens,
                "num_placeholder_tokens": self.num_placeholder_tokens,
                "accepted_per_pos": list(self.accepted_per_pos)}


def verify(sampler: Sampler, logits: torch.Tensor, reqs: list, drafts: list[list[int]], stats: SpecDecodeStats
           ) -> tuple[list[list[int]], list[Optional[list[dict]]]]:
    """logits [rows * (1 + K), V] (each row's positions contiguous), `reqs` and `drafts` per row, all rows with
    the same K. Returns each row's emitted tokens and, for rows that ask, one logprobs entry per emitted token."""
    n, q = len(reqs), len(drafts[0]) + 1
    pos_reqs = [r for r in reqs for _ in range(q)]
    greedy = [r.sampling_params.temperature < GREEDY_EPS for r in reqs]
    work = penalised_logits(sampler, logits, reqs, drafts, copy=not all(greedy))
    rand = [i for i in range(n * q) if not greedy[i // q]]
    if rand:
        work[rand] = filtered_probs(work[rand], [pos_reqs[i] for i in rand]).to(work.dtype)
    draws = RowDraws(reqs, q - 1, sampler, logits.device) if rand else None
    dev = logits.device
    emitted, num_accepted = rejection_sample(work.view(n, q, -1), torch.tensor(drafts, device=dev),
                                             torch.tensor(greedy, device=dev), draws)
    stats.record(drafts, num_accepted)
    logprobs: list[Optional[list[dict]]] = [None] * n
    want = [i for i, r in enumerate(reqs) if r.sampling_params.logprobs is not None]
    if want:
        idx = [i * q + j for i in want for j in range(len(emitted[i]))]
        entries = iter(logprobs_of(logits[idx], [t for i in want for t in emitted[i]],
                                   [reqs[i].sampling_params.logprobs for i in want for _ in emitted[i]]))
        for i in want:
            logprobs[i] = [next(entries) for _ in emitted[i]]
    return emitted, logprobs



def penalised_logits(sampler: Sampler, logits: torch.Tensor, reqs: list, drafts: list[list[int]],
                     copy: bool = False) -> torch.Tensor:
    """[rows * (1 + K), V]: each position's logits after penalties and min_tokens masking, as the plain sampler
    would apply them had the row's earlier real drafts been emitted (placeholders trail the real ones). `logits`
    itself when nothing changes and not `copy`."""
    q = len(drafts[0]) + 1
    pos_reqs = [r for r in reqs for _ in range(q)]
    pen = [i for i, r in enumerate(pos_reqs) if penalised(r, r.sampling_params)]
    if not pen:
        return logits.clone() if copy else logits
    extras = [[t for t in drafts[i // q][:i % q] if t != PLACEHOLDER_TOKEN_ID] for i in pen]
    return sampler._apply_penalties(logits.clone(), [pos_reqs[i] for i in pen], pen, extras)
