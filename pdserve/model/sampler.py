"""Next-token sampling for the positions of a step that produce a token.

A row (one request) may sample several positions (speculative decoding verifies 1 + K of them); `row_of[i]` names
the request of position i. Greedy positions take the argmax and are never sorted. Random ones apply penalties,
temperature, top-k, top-p (one sort over the rows that filter) and min-p, then sample with the exponential race
(argmax p / E, E ~ Exp(1)): E for unseeded rows in one draw from the engine's generator, for a seeded request from
its own generator, so its tokens do not depend on what else is in the batch. Logprobs are of the raw model
distribution, for all the rows that ask in one pass.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from pdserve.request import Request

GREEDY_EPS = 1e-5


@dataclass
class Logprob:
    logprob: float
    rank: int
    decoded_token: Optional[str] = None


class TokenCounts:
    """A request's token counts over the vocabulary, kept across steps for its penalties: each step adds only the
    tokens appended since the last (never a rebuild from the whole history)."""

    def __init__(self, req: Request, vocab: int, device: torch.device):
        self.prompt = torch.zeros(vocab, dtype=torch.bool, device=device)
        self.prompt[torch.tensor(req.prompt_token_ids, device=device)] = True
        self.output = torch.zeros(vocab, dtype=torch.int64, device=device)
        self.counted = 0

    def update(self, req: Request) -> None:
        new = req.output_token_ids[self.counted:]
        if new:
            self.output.index_add_(0, torch.tensor(new, device=self.output.device),
                                   torch.ones(len(new), dtype=torch.int64, device=self.output.device))
            self.counted += len(new)


class Sampler:
    def __init__(self, device: torch.device, seed: int):
        self.device = device
        self.generator = torch.Generator(device).manual_seed(seed)

    def __call__(self, logits: torch.Tensor, reqs: list[Request], row_of: Optional[list[int]] = None
                 ) -> tuple[list[int], list[Optional[dict]]]:
        """logits [positions, vocab]; `reqs` the rows; `row_of` each position's row (default: one each)."""
        row_of = list(range(len(reqs))) if row_of is None else row_of
        params = [reqs[r].sampling_params for r in row_of]
        raw = logits
        penal = [i for i, (r, sp) in enumerate(zip(row_of, params)) if _penalised(reqs[r], sp)]
        if penal:
            logits = self._apply_penalties(logits.clone(), [reqs[row_of[i]] for i in penal], penal)
        rand = [i for i, sp in enumerate(params) if sp.temperature >= GREEDY_EPS]
        tokens = logits.argmax(dim=-1)
        if rand:
            tokens[rand] = self._sample(logits[rand], [reqs[row_of[i]] for i in rand])
        token_list = tokens.tolist()
        want = [i for i, sp in enumerate(params) if sp.logprobs is not None]
        logprobs: list[Optional[dict]] = [None] * len(token_list)
        if want:
            for i, lp in zip(want, _logprobs(raw[want], [token_list[i] for i in want],
                                             [params[i].logprobs for i in want])):
                logprobs[i] = lp
        return token_list, logprobs

    def _apply_penalties(self, logits: torch.Tensor, reqs: list[Request], pos: list[int]) -> torch.Tensor:
        vocab, dev = logits.shape[-1], logits.device
        ban_rows, ban_ids = [], []
        counted, counted_pos = [], []
        for i, r in zip(pos, reqs):
            sp = r.sampling_params
            if r.num_output_tokens < sp.min_tokens:
                banned = list(sp.stop_token_ids) + ([] if sp.ignore_eos else list(r.eos_token_ids))
                ban_rows += [i] * len(banned)
                ban_ids += banned
            if sp.repetition_penalty != 1.0 or sp.presence_penalty or sp.frequency_penalty:
                if r.token_counts is None:
                    r.token_counts = TokenCounts(r, vocab, dev)
                r.token_counts.update(r)
                counted.append(r)
                counted_pos.append(i)
        if ban_rows:
            logits[ban_rows, ban_ids] = float("-inf")
        if counted:
            out = torch.stack([r.token_counts.output for r in counted]).to(logits.dtype)
            seen = torch.stack([r.token_counts.prompt for r in counted]) | (out > 0)
            rep = torch.tensor([r.sampling_params.repetition_penalty for r in counted], dtype=logits.dtype,
                               device=dev)[:, None]
            freq = torch.tensor([r.sampling_params.frequency_penalty for r in counted], dtype=logits.dtype,
                                device=dev)[:, None]
            pres = torch.tensor([r.sampling_params.presence_penalty for r in counted], dtype=logits.dtype,
                                device=dev)[:, None]
            x = logits[counted_pos]
            x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
            x = x - freq * out - pres * (out > 0).to(x.dtype)
            logits[counted_pos] = x
        return logits

    def _sample(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        probs = filtered_probs(logits, reqs)
        noise = torch.empty_like(probs)
        seeded = [i for i, r in enumerate(reqs) if r.sampling_params.seed is not None]
        if len(seeded) < len(reqs):
            free = [i for i, r in enumerate(reqs) if r.sampling_params.seed is None]
            draw = torch.empty(len(free), probs.shape[-1], dtype=probs.dtype, device=probs.device)
            noise[free] = draw.exponential_(generator=self.generator)
        for i in seeded:
            r = reqs[i]
            if r.generator is None:
                r.generator = torch.Generator(probs.device).manual_seed(r.sampling_params.seed)
            noise[i].exponential_(generator=r.generator)
        return (probs / noise).argmax(dim=-1)


def _penalised(req: Request, sp) -> bool:
    return req.num_output_tokens < sp.min_tokens or sp.repetition_penalty != 1.0 or bool(
        sp.presence_penalty or sp.frequency_penalty)


def filtered_probs(logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
    """Temperature, then top-k and top-p over one descending sort of the rows that need either (top-p over what
    top-k kept; ties at the k-th value kept), then min-p: the distribution each row samples from."""
    dev, vocab = logits.device, logits.shape[-1]
    sps = [r.sampling_params for r in reqs]
    temp = torch.tensor([sp.temperature for sp in sps], device=dev, dtype=logits.dtype)
    logits = logits / temp[:, None]
    rows = [i for i, sp in enumerate(sps) if 0 < sp.top_k < vocab or sp.top_p < 1.0]
    if rows:
        sub = logits[rows]
        srt, order = sub.sort(dim=-1, descending=True)
        k = torch.tensor([sps[i].top_k if 0 < sps[i].top_k < vocab else vocab for i in rows], device=dev)
        srt = srt.masked_fill(srt < srt.gather(1, (k - 1)[:, None]), float("-inf"))
        p = srt.softmax(-1)
        top_p = torch.tensor([sps[i].top_p for i in rows], device=dev, dtype=p.dtype)
        # Keep the smallest prefix whose mass reaches top_p (the token that crosses it included).
        srt = srt.masked_fill((p.cumsum(-1) - p) >= top_p[:, None], float("-inf"))
        logits[rows] = torch.empty_like(sub).scatter_(1, order, srt)
    probs = logits.softmax(dim=-1)
    min_p = torch.tensor([sp.min_p for sp in sps], device=dev, dtype=probs.dtype)
    if bool((min_p > 0).any()):
        probs = probs.masked_fill(probs < min_p[:, None] * probs.max(-1, keepdim=True).values, 0.0)
    return probs


def _logprobs(raw: torch.Tensor, tokens: list[int], top_n: list[int]) -> list[dict[int, Logprob]]:
    lp = raw.float().log_softmax(-1)
    idx = torch.tensor(tokens, device=lp.device)
    chosen = lp.gather(1, idx[:, None])
    ranks = ((lp > chosen).sum(-1) + 1).tolist()
    chosen = chosen[:, 0].tolist()
    n = max(top_n)
    vals, ids = lp.topk(n) if n else (lp[:, :0], idx[:, None][:, :0])
    vals, ids = vals.tolist(), ids.tolist()
    out = []
    for j, tok in enumerate(tokens):
        entry = {tok: Logprob(chosen[j], ranks[j])}
        for rank, (v, t) in enumerate(zip(vals[j][:top_n[j]], ids[j][:top_n[j]]), start=1):
            entry.setdefault(t, Logprob(v, rank))
        out.append(entry)
    return out
