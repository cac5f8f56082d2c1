"""Prompt logprobs (`SamplingParams.prompt_logprobs`): the logprob of each prompt token given the ones before it,
with the top N, from the final hidden states of the request's prefill chunks.

Position p's logits predict token p + 1, so a chunk over positions [c, c + n) gives the entries of prompt tokens
c + 1 .. min(c + n, P - 1) (P the prompt's length); the last prompt position's logits are the first output's, which
the sampler takes as usual. Entries are made in order and only once: the runner keeps how far each request's are
(`PromptLogprobs`), so a recompute after a preemption skips what is already made. Such a request takes no
prefix-cache hit and no imported KV (the engine refuses P/D params with it), so no position is ever skipped. The
logits are made `chunk` positions at a time, as many as the sampler's largest step (what the start-up profile
measured): a long prompt's at once would be prompt x vocabulary floats. A request with every entry made costs the
step nothing more.

Who keeps what: the runner only the count (it decides what a chunk computes); a step's new entries go out in
`ModelRunnerOutput.prompt_logprobs` (by request id) to the output processor, which keeps the list and sends it.
"""
from __future__ import annotations

import weakref

from pdserve.model.sampler import logprobs_of


class PromptLogprobs:
    """How many prompt tokens of each request have their entry (the first token's None included), keyed weakly by
    the Request object, as the sampler's state: the count lives as long as its request with no call on finish (the
    runner never learns of one), and a preempted request is the same object when it resumes."""

    def __init__(self):
        self._made: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def todo(self, req) -> bool:
        """The request asks for prompt logprobs and some entries are still to be made."""
        return req.sampling_params.prompt_logprobs is not None and self._made.get(req, 1) < req.num_prompt_tokens

    def wanted(self, rows) -> bool:
        """Whether a step's rows make any entry; one attribute test per row that does not ask."""
        return any(r.request.sampling_params.prompt_logprobs is not None for r in rows) and \
            any(self.todo(r.request) for r in rows)

    def add(self, model, hidden_all, rows, starts: list[int], order: list[int], chunk: int) -> dict[str, list]:
        """For each row that asks, the entries its chunk computed, by request id; `hidden_all` [tokens, hidden] in
        layout order, row `order[r]` starting at token `starts[r]`."""
        new: dict[str, list] = {}
        for r, i in enumerate(order):
            row = rows[i]
            req = row.request
            if row.draft_token_ids or not self.todo(req):
                continue
            made, c = self._made.get(req, 1), row.num_computed_tokens
            if c > made - 1:  # never: nothing imported, no cache hit; entries at the wrong place would be worse
                raise RuntimeError(f"{req.request_id}: prompt logprobs from position {made - 1} missing")
            first, end = made - 1, min(c + row.num_scheduled_tokens, req.num_prompt_tokens - 1)
            if first >= end:
                continue
            s = starts[r] + first - c
            targets = req.prompt_token_ids[first + 1:end + 1]
            top = req.sampling_params.prompt_logprobs
            out = new[req.request_id] = []
            for a in range(0, end - first, chunk):
                m = min(chunk, end - first - a)
                out.extend(logprobs_of(model.compute_logits(hidden_all[s + a:s + a + m]), targets[a:a + m],
                                       [top] * m))
            self._made[req] = end + 1
        return new
