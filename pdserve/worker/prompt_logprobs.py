"""Prompt logprobs (`SamplingParams.prompt_logprobs`): the logprob of each prompt token given the ones before it,
with the top N, from the final hidden states of the request's prefill chunks.

Position p's logits predict token p + 1, so a chunk over positions [c, c + n) gives the entries of prompt tokens
c + 1 .. min(c + n, P - 1) (P the prompt's length); the last prompt position's logits are the first output's, which
the sampler takes as usual. Entries are appended to `request.prompt_logprobs` in order, so a recompute after a
preemption skips what is already there. Such a request takes no prefix-cache hit and no imported KV (the engine
refuses P/D params with it), so no position is ever skipped. The logits are made `chunk` positions at a time, as
many as the sampler's largest step (what the start-up profile measured): a long prompt's at once would be prompt x
vocabulary floats. `request.prompt_logprobs_todo` turns off once every entry is there, so a request that decodes
costs the step nothing more.
"""
from __future__ import annotations

import operator

from pdserve.model.sampler import logprobs_of

wants_prompt_logprobs = operator.attrgetter("request.prompt_logprobs_todo")


def add_prompt_logprobs(model, hidden_all, rows, starts: list[int], order: list[int], chunk: int) -> None:
    """For each row that asks, the entries its chunk computed; `hidden_all` [tokens, hidden] in layout order, row
    `order[r]` starting at token `starts[r]`."""
    for r, i in enumerate(order):
        row = rows[i]
        req = row.request
        if not req.prompt_logprobs_todo or row.draft_token_ids:
            continue
        out, c = req.prompt_logprobs, row.num_computed_tokens
        if c > len(out) - 1:  # never: nothing imported, no cache hit; entries at the wrong place would be worse
            raise RuntimeError(f"{req.request_id}: prompt logprobs from position {len(out) - 1} missing")
        first, end = len(out) - 1, min(c + row.num_scheduled_tokens, req.num_prompt_tokens - 1)
        if first >= end:
            continue
        s = starts[r] + first - c
        targets = req.prompt_token_ids[first + 1:end + 1]
        top = req.sampling_params.prompt_logprobs
        for a in range(0, end - first, chunk):
            m = min(chunk, end - first - a)
            out.extend(logprobs_of(model.compute_logits(hidden_all[s + a:s + a + m]), targets[a:a + m], [top] * m))
        req.prompt_logprobs_todo = len(out) < req.num_prompt_tokens
