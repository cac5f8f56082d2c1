"""Next-token sampling for the rows of a step that produce a token.

Greedy rows take the argmax. Random rows apply penalties, temperature, top-k, top-p and min-p, then sample with the
exponential race (argmax p / E, E ~ Exp(1)), drawing E from the request's own generator when it has a seed, so a
seeded request's tokens do not depend on what else is in the batch. Logprobs are of the raw model distribution.
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


class Sampler:
    def __init__(self, device: torch.device, seed: int):
        self.device = device
        self.generator = torch.Generator(device).manual_seed(seed)

    def __call__(self, logits: torch.Tensor, reqs: list[Request]) -> tuple[list[int], list[Optional[dict]]]:
        raw = logits
        logits = self._apply_penalties(logits.clone(), reqs)
        temps = [r.sampling_params.temperature for r in reqs]
        greedy = [t < GREEDY_EPS for t in temps]
        tokens = logits.argmax(dim=-1)
        if not all(greedy):
            idx = [i for i, g in enumerate(greedy) if not g]
            tokens[idx] = self._sample(logits[idx], [reqs[i] for i in idx])
        token_list = tokens.tolist()
        logprobs = [self._logprobs(raw[i], token_list[i], r.sampling_params.logprobs)
                    if r.sampling_params.logprobs is not None else None for i, r in enumerate(reqs)]
        return token_list, logprobs

    def _apply_penalties(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        for i, r in enumerate(reqs):
            sp = r.sampling_params
            if r.num_output_tokens < sp.min_tokens:
                banned = list(sp.stop_token_ids) + ([] if sp.ignore_eos else list(r.eos_token_ids))
                if banned:
                    logits[i, banned] = float("-inf")
            if sp.repetition_penalty != 1.0:
                seen = torch.tensor(sorted(set(r.all_token_ids)), device=logits.device)
                vals = logits[i, seen]
                logits[i, seen] = torch.where(vals > 0, vals / sp.repetition_penalty, vals * sp.repetition_penalty)
            if (sp.presence_penalty or sp.frequency_penalty) and r.output_token_ids:
                ids, counts = torch.tensor(r.output_token_ids, device=logits.device).unique(return_counts=True)
                logits[i, ids] -= sp.frequency_penalty * counts.to(logits.dtype) + sp.presence_penalty
        return logits

    def _sample(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        dev = logits.device
        temp = torch.tensor([r.sampling_params.temperature for r in reqs], device=dev, dtype=logits.dtype)
        logits = logits / temp[:, None]
        top_k = [r.sampling_params.top_k for r in reqs]
        if any(k > 0 for k in top_k):
            vocab = logits.shape[-1]
            k = torch.tensor([k if 0 < k < vocab else vocab for k in top_k], device=dev)
            kth = logits.sort(dim=-1, descending=True).values.gather(1, (k - 1)[:, None])
            logits = logits.masked_fill(logits < kth, float("-inf"))
        top_p = torch.tensor([r.sampling_params.top_p for r in reqs], device=dev, dtype=logits.dtype)
        if bool((top_p < 1.0).any()):
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            cum = sorted_logits.softmax(-1).cumsum(-1)
            # Keep the smallest prefix whose mass reaches top_p (the token that crosses it included).
            drop_sorted = (cum - sorted_logits.softmax(-1)) >= top_p[:, None]
            drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
            logits = logits.masked_fill(drop, float("-inf"))
        probs = logits.softmax(dim=-1)
        min_p = torch.tensor([r.sampling_params.min_p for r in reqs], device=dev, dtype=probs.dtype)
        if bool((min_p > 0).any()):
            probs = probs.masked_fill(probs < min_p[:, None] * probs.max(-1, keepdim=True).values, 0.0)
        noise = torch.empty_like(probs)
        for i, r in enumerate(reqs):
            seed = r.sampling_params.seed
            if seed is not None and r.generator is None:
                r.generator = torch.Generator(dev).manual_seed(seed)
            noise[i].exponential_(generator=r.generator if seed is not None else self.generator)
        return (probs / noise).argmax(dim=-1)

    @staticmethod
    def _logprobs(raw: torch.Tensor, token: int, top_n: int) -> dict[int, Logprob]:
        lp = raw.float().log_softmax(-1)
        chosen = lp[token]
        out = {token: Logprob(float(chosen), int((lp > chosen).sum()) + 1)}
        if top_n:
            vals, ids = lp.topk(top_n)
            for rank, (v, t) in enumerate(zip(vals.tolist(), ids.tolist()), start=1):
                out.setdefault(t, Logprob(v, rank))
        return out
