"""Next-token sampling for the positions of a step that produce a token.

A row (one request) may sample several positions (speculative decoding verifies 1 + K of them); `row_of[i]` names
the request of position i. Greedy positions take the argmax and are never sorted. Random ones apply penalties,
temperature, top-k, top-p (one sort of values over the rows that filter) and min-p, then sample by the inverse CDF
with one uniform per row: for unseeded rows drawn together from the engine's generator, for a seeded request from
its own generator, so its tokens do not depend on what else is in the batch. Logprobs are of the raw model
distribution, for all the rows that ask in one pass.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from pdserve.request import Request

GREEDY_EPS = 1e-5


@dataclass
class Logprob:
    logprob: float
    rank: int
    decoded_token: Optional[str] = None


class _Grow:
    """An int64 array that grows by appending, with room to spare (amortised O(1) per append)."""

    def __init__(self, init=()):
        self.a = np.zeros(max(16, 2 * len(init)), np.int64)
        self.n = len(init)
        self.a[:self.n] = init

    def append(self, x: int) -> None:
        if self.n == len(self.a):
            self.a = np.concatenate([self.a, np.zeros(len(self.a), np.int64)])
        self.a[self.n] = x
        self.n += 1

    @property
    def view(self) -> np.ndarray:
        return self.a[:self.n]


class TokenCounts:
    """A request's tokens for its penalties, kept across steps: the ids seen (prompt and output, each once) and the
    output ids with their counts. Each step adds only the tokens appended since the last, and a penalty touches only
    these ids, never the whole vocabulary."""

    def __init__(self, req: Request):
        self._seen = set(req.prompt_token_ids)
        self.seen = _Grow(list(self._seen))
        self._slot: dict[int, int] = {}  # output id -> its index in out_ids / out_counts
        self.out_ids, self.out_counts = _Grow(), _Grow()
        self.counted = 0

    def update(self, req: Request) -> None:
        for t in req.output_token_ids[self.counted:]:
            if t not in self._seen:
                self._seen.add(t)
                self.seen.append(t)
            slot = self._slot.get(t)
            if slot is None:
                self._slot[t] = self.out_ids.n
                self.out_ids.append(t)
                self.out_counts.append(1)
            else:
                self.out_counts.a[slot] += 1
        self.counted = req.num_output_tokens

    def with_extra(self, extra: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(seen ids, output ids, their counts) as if `extra` had been emitted after the counted output: what a
        speculative position's penalties read (its earlier drafts counted as output). `update` first."""
        seen, out_ids, counts = self.seen.view, self.out_ids.view, self.out_counts.view
        if not extra:
            return seen, out_ids, counts
        new_seen = [t for t in dict.fromkeys(extra) if t not in self._seen]
        counts = counts.copy()
        added: dict[int, int] = {}
        for t in extra:
            slot = self._slot.get(t)
            if slot is not None:
                counts[slot] += 1
            else:
                added[t] = added.get(t, 0) + 1
        if new_seen:
            seen = np.concatenate([seen, np.asarray(new_seen, np.int64)])
        if added:
            out_ids = np.concatenate([out_ids, np.fromiter(added, np.int64, len(added))])
            counts = np.concatenate([counts, np.fromiter(added.values(), np.int64, len(added))])
        return seen, out_ids, counts


class Sampler:
    def __init__(self, device: torch.device, seed: int):
        self.device = device
        self.generator = torch.Generator(device).manual_seed(seed)

    def __call__(self, logits: torch.Tensor, reqs: list[Request], row_of: Optional[list[int]] = None
                 ) -> tuple[list[int], list[Optional[dict]]]:
        """logits [positions, vocab]; `reqs` the rows; `row_of` each position's row (default: one each)."""
        row_of = list(range(len(reqs))) if row_of is None else row_of
        params = [reqs[r].sampling_params for r in row_of]
        n = len(row_of)
        penal = {i for i, (r, sp) in enumerate(zip(row_of, params)) if penalised(reqs[r], sp)}
        rand = {i for i, sp in enumerate(params) if sp.temperature >= GREEDY_EPS}
        # Only the rows that change their logits (penalties) or sample are copied; plain greedy rows take the
        # argmax of the raw logits, which also stay as they are for logprobs.
        work = sorted(penal | rand)
        plain = [i for i in range(n) if i not in penal and i not in rand]
        if len(plain) == n:
            tokens = argmax(logits)
        else:
            tokens = torch.empty(n, dtype=torch.long, device=logits.device)
            if plain:
                tokens[plain] = argmax(_rows(logits, plain))
        if work:
            sub = logits.clone() if len(work) == n else _rows(logits, work)
            local = [j for j, i in enumerate(work) if i in penal]
            if local:
                sub = self._apply_penalties(sub, [reqs[row_of[work[j]]] for j in local], local)
            greedy = [j for j, i in enumerate(work) if i not in rand]
            if greedy:
                tokens[[work[j] for j in greedy]] = argmax(_rows(sub, greedy))
            sampled = [j for j, i in enumerate(work) if i in rand]
            if sampled:
                tokens[[work[j] for j in sampled]] = self._sample(
                    sub if len(sampled) == len(work) else _rows(sub, sampled), [reqs[row_of[work[j]]] for j in sampled])
        token_list = tokens.tolist()
        want = [i for i, sp in enumerate(params) if sp.logprobs is not None]
        logprobs: list[Optional[dict]] = [None] * len(token_list)
        if want:
            for i, lp in zip(want, logprobs_of(_rows(logits, want), [token_list[i] for i in want],
                                             [params[i].logprobs for i in want])):
                logprobs[i] = lp
        return token_list, logprobs

    def _apply_penalties(self, logits: torch.Tensor, reqs: list[Request], pos: list[int],
                         extras: Optional[list[list[int]]] = None) -> torch.Tensor:
        """Penalties and min_tokens masking at rows `pos` of `logits`, row pos[i] for reqs[i]; `extras[i]`: tokens
        taken as already emitted at that row (a speculative position's earlier drafts; never placeholders)."""
        ban_rows, ban_ids = [], []
        counted, counted_pos, counted_extra = [], [], []
        for j, (i, r) in enumerate(zip(pos, reqs)):
            sp = r.sampling_params
            extra = extras[j] if extras is not None else []
            if r.num_output_tokens + len(extra) < sp.min_tokens:
                banned = list(sp.stop_token_ids) + ([] if sp.ignore_eos else list(r.eos_token_ids))
                ban_rows += [i] * len(banned)
                ban_ids += banned
            if sp.repetition_penalty != 1.0 or sp.presence_penalty or sp.frequency_penalty:
                if r.token_counts is None:
                    r.token_counts = TokenCounts(r)
                r.token_counts.update(r)
                counted.append(r)
                counted_pos.append(i)
                counted_extra.append(extra)
        if ban_rows:
            logits[ban_rows, ban_ids] = float("-inf")
        if counted:
            views = [r.token_counts.with_extra(e) for r, e in zip(counted, counted_extra)]
            sps = [r.sampling_params for r in counted]
            self._penalise(logits, counted_pos, [v[0] for v in views], None,
                           [sp.repetition_penalty for sp in sps], None)
            self._penalise(logits, counted_pos, [v[1] for v in views], [v[2] for v in views],
                           [sp.frequency_penalty for sp in sps], [sp.presence_penalty for sp in sps])
        return logits

    @staticmethod
    def _penalise(logits, rows, ids, counts, a, b) -> None:
        """Repetition (counts None: divide positive logits by a, multiply negative ones) or frequency and presence
        (subtract a x count + b) at each row's ids, all rows in one gather and one scatter."""
        lens = [len(x) for x in ids]
        if not sum(lens) or (counts is not None and not any(a) and not any(b)) or (counts is None and
                                                                                  all(x == 1.0 for x in a)):
            return
        dev, dt = logits.device, logits.dtype
        r = torch.from_numpy(np.repeat(rows, lens)).to(dev)
        t = torch.from_numpy(np.concatenate(ids)).to(dev)
        ea = torch.from_numpy(np.repeat(np.asarray(a, np.float64), lens)).to(dev, dt)
        v = logits[r, t]
        if counts is None:
            logits[r, t] = torch.where(v > 0, v / ea, v * ea)
        else:
            c = torch.from_numpy(np.concatenate(counts)).to(dev, dt)
            eb = torch.from_numpy(np.repeat(np.asarray(b, np.float64), lens)).to(dev, dt)
            logits[r, t] = v - ea * c - eb

    def _sample(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        """One uniform draw per row, through the inverse of its distribution's CDF (float64 running sums, so a
        token's chance is its probability to ~1e-16): unseeded rows draw together from the engine's generator, a
        seeded request from its own, so its tokens do not depend on what else is in the batch. One draw per row,
        not one per token as an exponential race needs: vocabulary-wide noise and its log were most of the
        sampler's time on CPU."""
        probs = filtered_probs(logits, reqs)
        u = torch.empty(len(reqs), dtype=torch.float64)
        free = [i for i, r in enumerate(reqs) if r.sampling_params.seed is None]
        if free:
            u[free] = torch.rand(len(free), generator=self.generator, dtype=torch.float64, device=self.device).cpu()
        for i, r in enumerate(reqs):
            if r.sampling_params.seed is not None:
                if r.generator is None:
                    r.generator = torch.Generator(self.device).manual_seed(r.sampling_params.seed)
                u[i] = torch.rand(1, generator=r.generator, dtype=torch.float64, device=self.device).item()
        return inverse_cdf(probs, u)


CDF_CHUNK = 128


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """For each row, the first token whose running sum of `probs` passes u x the row's total, u in [0, 1): a token
    of probability 0 is never taken. Two levels, so no vocabulary-wide running sum (slow on CPU): chunk sums find
    the chunk, a running sum inside it the token; float64 throughout. A row with no mass (all zero, NaN) takes its
    argmax."""
    n, vocab = probs.shape
    p = probs.double()
    if vocab % CDF_CHUNK:
        p = torch.nn.functional.pad(p, (0, CDF_CHUNK - vocab % CDF_CHUNK))
    chunks = p.view(n, -1, CDF_CHUNK)
    ends = chunks.sum(-1).cumsum(-1)  # [n, chunks]: the running sum at each chunk's end
    total = ends[:, -1]
    target = u.to(p.device) * total
    j = torch.searchsorted(ends, target[:, None], right=True)[:, 0].clamp_(max=ends.shape[1] - 1)
    start = torch.where(j > 0, ends.gather(1, (j - 1).clamp(min=0)[:, None])[:, 0], torch.zeros_like(total))
    inner = chunks[torch.arange(n, device=p.device), j].cumsum(-1)  # [n, CDF_CHUNK]
    k = torch.searchsorted(inner, (target - start)[:, None], right=True)[:, 0]
    # rounding between the two levels may point past the chunk's last token with mass: take that one
    k = torch.minimum(k, (inner < inner[:, -1:]).sum(-1))
    bad = ~(total > 0)
    idx = j * CDF_CHUNK + k
    return torch.where(bad, argmax(probs), idx) if bool(bad.any()) else idx


def penalised(req: Request, sp) -> bool:
    return req.num_output_tokens < sp.min_tokens or sp.repetition_penalty != 1.0 or bool(
        sp.presence_penalty or sp.frequency_penalty)


def filtered_probs(logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
    """Temperature, then top-k and top-p, then min-p: the distribution each row samples from. Top-k and top-p keep
    the logits at or above a per-row threshold read off one descending sort of the values (no indices needed) of
    the rows that ask for either: top-k's k-th value, then top-p's value where the mass of what top-k kept first
    reaches top_p (that token included). Ties at a threshold are kept."""
    dev, vocab = logits.device, logits.shape[-1]
    sps = [r.sampling_params for r in reqs]
    temp = torch.tensor([sp.temperature for sp in sps], device=dev, dtype=logits.dtype)
    logits = logits / temp[:, None]
    rows = [i for i, sp in enumerate(sps) if 0 < sp.top_k < vocab or sp.top_p < 1.0]
    if rows:
        every = len(rows) == len(sps)  # the common case: no row indexing, the cut in place
        asc = _sort_asc(logits if every else _rows(logits, rows))
        ks = [sps[i].top_k if 0 < sps[i].top_k < vocab else vocab for i in rows]
        at_k = torch.tensor([vocab - k for k in ks], device=dev)[:, None]  # the k-th largest value's index
        kth = asc.gather(1, at_k)
        if min(ks) < vocab:  # a pass over the sorted rows only when some row has a top-k to cut
            asc = _cut_below_(asc, kth)
        p = asc.softmax(-1)
        c = p.cumsum(-1)
        top_p = torch.tensor([sps[i].top_p for i in rows], device=dev, dtype=p.dtype)[:, None]
        # Kept: every token whose mass above it (the total less the running sum up to it) is short of top_p,
        # i.e. from the first index whose running sum passes total - top_p; the largest always stays.
        first = torch.searchsorted(c, c[:, -1:] - top_p, right=True).clamp_(max=vocab - 1)
        first = torch.where(top_p >= 1.0, at_k, first)  # top-k only: no float cumsum cuts its tail
        threshold = torch.maximum(kth, asc.gather(1, first))  # top-p past what top-k kept reads -inf
        if every:
            logits = _cut_below_(logits, threshold)
        else:
            logits[rows] = _cut_below_(_rows(logits, rows), threshold)
    probs = logits.softmax(dim=-1)
    min_p = torch.tensor([sp.min_p for sp in sps], device=dev, dtype=probs.dtype)
    if bool((min_p > 0).any()):
        probs = probs.masked_fill(probs < min_p[:, None] * probs.amax(-1, keepdim=True), 0.0)
    return probs


def argmax(x: torch.Tensor) -> torch.Tensor:
    """Each row's argmax (first of ties; NaN counts as largest, as torch's). On CPU through numpy: torch's argmax
    over a vocabulary-wide last axis ran ~10x slower here (0.15 vs 0.014 ms at 32 x 8192)."""
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64):
        return torch.from_numpy(x.detach().numpy().argmax(-1))
    return x.argmax(dim=-1)


def _rows(x: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """x[rows] by index_select (a list index took ~4x as long on CPU)."""
    return x.index_select(0, torch.tensor(rows, device=x.device))


def _cut_below_(x: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """`x` (a tensor the caller owns) with each value below its row's threshold set, in place, to the dtype's lowest
    finite value (its probability is exactly 0, as for -inf; kept values are unchanged). On CPU through numpy:
    torch's compare-and-fill ran ~5x slower here."""
    low = torch.finfo(x.dtype).min
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64) and x.is_contiguous():
        a = x.detach().numpy()
        np.putmask(a, a < threshold.numpy(), low)
        return x
    return x.masked_fill_(x < threshold, low)


def _sort_asc(x: torch.Tensor) -> torch.Tensor:
    """Each row's values, smallest first. On CPU numpy's sort of values alone is ~15x torch's sort (which also
    builds the indices) for a vocabulary-wide row."""
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64):
        return torch.from_numpy(np.sort(x.detach().numpy(), axis=-1))
    return x.sort(dim=-1).values


def logprobs_of(raw: torch.Tensor, tokens: list[int], top_n: list[int]) -> list[dict[int, Logprob]]:
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
