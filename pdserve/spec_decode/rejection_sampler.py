"""Exact verification of point-mass drafts (the n-gram proposer is deterministic): rows of 1 + K scored positions.

Position j (0..K-1) of a row holds the target distribution p_j given the prompt, the output so far and drafts
0..j-1 (so it verifies draft j); position K holds the bonus distribution, used after K accepts.

The rule, for a draft d at position j: accept with probability p_j(d); on rejection emit a token drawn from p_j
with d removed and renormalised; a placeholder (PLACEHOLDER_TOKEN_ID) is always rejected and its position draws
from the full p_j; after K accepts the bonus is drawn from p_K. Stop at the first rejection. For a point-mass draft
this is exactly: draw t_j ~ p_j by the inverse CDF with the row's uniform u_j, accept while t_j == d_j, emit
t_0..t_n with n the first mismatch (or K). t_j == d iff u_j falls in d's CDF interval, of width p_j(d); any other
u_j lands on another token with its own width, i.e. on p_j with d removed, renormalised. So no residual is ever
built: p_j(d) == 1 can never reject, a residual without mass cannot arise, nothing can turn NaN, a placeholder
(never equal to a sampled id >= 0) rejects and leaves the full p_j, and token 0 is an ordinary token. Greedy rows
are the same with t_j the argmax (only the argmax of their slice is read: pass the logits the plain sampler takes
the argmax of, and ties break as in plain greedy decoding).

Randomness contract. One float64 uniform per scored position, used by `inverse_cdf` exactly as the plain sampler
uses its one per step: greedy rows draw none. Unseeded rows draw K + 1 each, together in row order, from the
engine's generator, every step whatever is accepted. A seeded row draws its K + 1 one at a time from its own
generator (the sampler's, `Sampler.generator_for`: the very stream the plain sampler draws from), and
`RowDraws.commit` then rewinds that generator to just after the draws of the tokens actually emitted. Its stream is
therefore consumed one uniform per emitted token, and the token at output index i always comes from the i-th
uniform of its stream on its own distribution: a seeded request emits the same tokens with or without speculative
decoding, for any K, any drafts, any batch (to rounding of the target distributions themselves).

Stops: every emitted token is returned (up to K + 1); the caller applies stop ids, EOS, max_tokens and stop
strings token by token and drops what follows the first stop.
"""
from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from pdserve.model.probs import inverse_cdf
from pdserve.model.sampler import GREEDY_EPS, Sampler
from pdserve.request import Request

PLACEHOLDER_TOKEN_ID = -1  # vLLM's name: a scheduled draft slot with no real draft (never a token id)


class RowDraws:
    """The uniforms of one verify step: `u` [rows, 1 + K] float64 (greedy rows' entries unused), and for each
    seeded row the states of its generator after each of its draws, for `commit`. `sampler` owns the generators:
    the engine's for unseeded rows, each seeded request's own (None will do for greedy rows only)."""

    def __init__(self, reqs: Sequence[Request], k: int, sampler: Optional[Sampler], device: torch.device):
        n = k + 1
        self.u = torch.zeros(len(reqs), n, dtype=torch.float64, device=device)
        sps = [r.sampling_params for r in reqs]
        free = [i for i, sp in enumerate(sps) if sp.temperature >= GREEDY_EPS and sp.seed is None]
        if free:
            generator = sampler.generator
            self.u[free] = torch.rand(len(free), n, generator=generator, dtype=torch.float64,
                                      device=generator.device).to(device)
        self._states: dict[int, tuple[torch.Generator, list[torch.Tensor]]] = {}
        for i, sp in enumerate(sps):
            if sp.temperature >= GREEDY_EPS and sp.seed is not None:
                g = sampler.generator_for(reqs[i])
                # One call per position, each the plain sampler's call, so this row's j-th uniform is the one
                # the plain sampler would take for the j-th token from here.
                draws, states = [], []
                for _ in range(n):
                    draws.append(torch.rand(1, generator=g, dtype=torch.float64, device=g.device))
                    states.append(g.get_state())
                self.u[i] = torch.cat(draws).to(device)
                self._states[i] = (g, states)

    def commit(self, num_emitted: Sequence[int]) -> None:
        """Rewind each seeded row's generator to just after the draws of its `num_emitted` tokens."""
        for i, (g, states) in self._states.items():
            g.set_state(states[num_emitted[i] - 1])
        self._states = {}


def _rows(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return x if idx.numel() == x.shape[0] else x[idx]


def target_tokens(target_probs: torch.Tensor, greedy: torch.Tensor, u: Optional[torch.Tensor]) -> torch.Tensor:
    """[rows, 1 + K] the target's token at every scored position: the argmax for greedy rows, for the others the
    inverse-CDF draw with that position's uniform."""
    rows, q, vocab = target_probs.shape
    dev = target_probs.device
    greedy = greedy.to(dev)
    out = torch.empty(rows, q, dtype=torch.long, device=dev)
    g, s = greedy.nonzero()[:, 0], (~greedy).nonzero()[:, 0]
    if g.numel():
        out[g] = _rows(target_probs, g).argmax(-1)
    if s.numel():
        if u is None:
            raise ValueError("rejection_sample: sampling rows need uniforms")
        p = _rows(target_probs, s).reshape(-1, vocab)
        out[s] = inverse_cdf(p, _rows(u.to(dev, torch.float64), s).reshape(-1)).view(-1, q)
    return out


def rejection_sample(target_probs: torch.Tensor, drafts: torch.Tensor, greedy: torch.Tensor,
                     uniforms: Union[torch.Tensor, RowDraws, None] = None) -> tuple[list[list[int]], list[int]]:
    """Verify a batch. target_probs [rows, 1 + K, V]: each position's distribution after every filter (a row need
    not sum to 1: the inverse CDF scales by its total, so min-p's unrenormalised output serves; greedy rows:
    anything with the target's argmax). drafts [rows, K], PLACEHOLDER_TOKEN_ID where there is none. greedy [rows]
    bool. uniforms [rows, 1 + K] float64, or a RowDraws, whose seeded generators are then committed. Returns each
    row's emitted tokens (1..K + 1: the accepted drafts, then the correction or bonus token) and its number of
    accepted drafts."""
    rows, q, _ = target_probs.shape
    if drafts.shape != (rows, q - 1):
        raise ValueError(f"rejection_sample: drafts {tuple(drafts.shape)} do not match target_probs "
                         f"{tuple(target_probs.shape)}")
    u = uniforms.u if isinstance(uniforms, RowDraws) else uniforms
    if u is not None and u.shape != (rows, q):
        raise ValueError(f"rejection_sample: uniforms {tuple(u.shape)} must be [rows, 1 + K] = {(rows, q)}")
    tokens = target_tokens(target_probs, greedy, u)
    accept = tokens[:, :-1] == drafts.to(tokens.device)  # a placeholder (-1) never equals a token id
    num_accepted = accept.to(torch.int32).cumprod(1).sum(1).tolist()
    out = [row[:n + 1] for row, n in zip(tokens.tolist(), num_accepted)]
    if isinstance(uniforms, RowDraws):
        uniforms.commit([n + 1 for n in num_accepted])
    return out, num_accepted
