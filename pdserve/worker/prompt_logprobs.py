"""Prompt logprobs (`SamplingParams.prompt_logprobs`): the logprob of each prompt token given the ones before it,
with the top N, from the final hidden states of the request's prefill chunks.

Position p's logits predict token p + 1, so a chunk over positions [c, c + n) gives the entries of prompt tokens
c + 1 .. min(c + n, P - 1) (P the prompt's length); the last prompt position's logits are the first output's, which
the sampler takes as usual. Entries are appended to `request.prompt_logprobs` in order, so a recompute after a
preemption skips what is already there. Such a request takes no prefix-cache hit and no imported KV (the protocol
refuses P/D params with it), so no position is ever skipped. The logits are made CHUNK positions at a time: a long
prompt's at once would be prompt x vocabulary floats.
"""
from __future__ import annotations

import operator

from pdserve.model.sampler import logprobs_of

CHUNK = 256
wants_prompt_logprobs = operator.attrgetter("request.prompt_logprobs")


def add_prompt_logprobs(model, hidden_all, rows, starts: list[int], order: list[int]) -> None:
    """For each row that asks, the entries its chunk computed; `hidden_all` [tokens, hidden] in layout order, row
    `order[r]` starting at token `starts[r]`."""
    for r, i in enumerate(order):
        row = rows[i]
        out = row.request.prompt_logprobs
        if out is None or row.draft_token_ids:
            continue
        req, c = row.request, row.num_computed_tokens
        first, end = max(c, len(out) - 1), min(c + row.num_scheduled_tokens, req.num_prompt_tokens - 1)
        if first >= end:
            continue
        s = starts[r] + first - c
        targets = req.prompt_token_ids[first + 1:end + 1]
        top = req.sampling_params.prompt_logprobs
        for a in range(0, end - first, CHUNK):
            m = min(CHUNK, end - first - a)
            out.extend(logprobs_of(model.compute_logits(hidden_all[s + a:s + a + m]), targets[a:a + m], [top] * m))
