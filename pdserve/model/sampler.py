"""Next-token sampling for the positions of a step that produce a token.

A row (one request) may sample several positions (speculative decoding verifies 1 + K of them); `row_of[i]` names
the request of position i. Greedy positions take the argmax and are never sorted. Random ones apply penalties,
then temperature, top-k, top-p and min-p, and sample by the inverse CDF (both in `probs.py`) with one uniform per
row: for unseeded rows drawn together from the engine's generator, for a seeded request from its own generator, so
its tokens do not depend on what else is in the batch. Logprobs are of the raw model distribution, for all the
rows that ask in one pass.

What the sampler keeps of a request between steps (its seeded generator, its penalty counts, its allowed ids on the
device) is its own `SamplerState`, not the request's: the `Request` is the scheduler's record.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from pdserve.model.probs import argmax, filtered_probs, inverse_cdf, select_rows
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


@dataclass(eq=False)
class SamplerState:
    """The sampler's per-request state, each part made on first use and kept for the request's life."""
    generator: Optional[torch.Generator] = None  # a seeded request's own stream (`Sampler.generator_for`)
    token_counts: Optional[TokenCounts] = None  # its tokens for the penalties
    allowed_idx: Optional[torch.Tensor] = None  # sampling_params.allowed_token_ids on the logits' device


class Sampler:
    def __init__(self, device: torch.device, seed: int):
        self.device = device
        self.generator = torch.Generator(device).manual_seed(seed)  # the unseeded rows' stream
        # Keyed weakly by the Request object, so a request's state dies with it and nothing has to free it: the
        # sampler never learns when a request finishes (a stop, an abort, a failed step or load end it in the
        # scheduler and the engine), and a dict by request id would keep what no call dropped and could hand it to
        # a later request reusing the id (or to one named like the start-up profile's). A preempted request is the
        # same object when it resumes, so its seeded stream goes on where it was.
        self._states: weakref.WeakKeyDictionary[Request, SamplerState] = weakref.WeakKeyDictionary()

    def state(self, req: Request) -> SamplerState:
        st = self._states.get(req)
        if st is None:
            st = self._states[req] = SamplerState()
        return st

    def generator_for(self, req: Request) -> torch.Generator:
        """A seeded request's own generator (from sampling_params.seed, on the sampler's device): the plain sampler
        and the speculative verifier draw from it alike, so the two share one stream per request."""
        st = self.state(req)
        if st.generator is None:
            st.generator = torch.Generator(self.device).manual_seed(req.sampling_params.seed)
            # Tokens it has before its first draw here were drawn elsewhere, one draw each (a prefill node's first
            # token): the stream goes on where that node left it, so seeded P/D output equals collocated.
            for _ in range(req.num_output_tokens):
                torch.rand(1, generator=st.generator, dtype=torch.float64, device=self.device)
        return st.generator

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
                tokens[plain] = argmax(select_rows(logits, plain))
        if work:
            sub = logits.clone() if len(work) == n else select_rows(logits, work)
            local = [j for j, i in enumerate(work) if i in penal]
            if local:
                sub = self._apply_penalties(sub, [reqs[row_of[work[j]]] for j in local], local)
            greedy = [j for j, i in enumerate(work) if i not in rand]
            if greedy:
                tokens[[work[j] for j in greedy]] = argmax(select_rows(sub, greedy))
            sampled = [j for j, i in enumerate(work) if i in rand]
            if sampled:
                tokens[[work[j] for j in sampled]] = self._sample(
                    sub if len(sampled) == len(work) else select_rows(sub, sampled),
                    [reqs[row_of[work[j]]] for j in sampled])
        token_list = tokens.tolist()
        want = [i for i, sp in enumerate(params) if sp.logprobs is not None]
        logprobs: list[Optional[dict]] = [None] * len(token_list)
        if want:
            for i, lp in zip(want, logprobs_of(select_rows(logits, want), [token_list[i] for i in want],
                                             [params[i].logprobs for i in want])):
                logprobs[i] = lp
        return token_list, logprobs

    def _apply_penalties(self, logits: torch.Tensor, reqs: list[Request], pos: list[int],
                         extras: Optional[list[list[int]]] = None) -> torch.Tensor:
        """allowed_token_ids, min_tokens masking, logit bias, then penalties (vLLM's order) at rows `pos` of
        `logits`, row pos[i] for reqs[i]; `extras[i]`: tokens taken as already emitted at that row (a speculative
        position's earlier drafts; never placeholders)."""
        ban_rows, ban_ids = [], []
        biased = []
        counted, counted_pos, counted_extra = [], [], []
        for j, (i, r) in enumerate(zip(pos, reqs)):
            sp = r.sampling_params
            extra = extras[j] if extras is not None else []
            if sp.allowed_token_ids is not None:  # before the bans and the bias below, which all rows get at once
                self._keep_only(logits, i, r)
            if r.num_output_tokens + len(extra) < sp.min_tokens:
                banned = list(sp.stop_token_ids) + ([] if sp.ignore_eos else list(r.eos_token_ids))
                ban_rows += [i] * len(banned)
                ban_ids += banned
            if r.bad_words_token_ids:
                banned = _bad_word_ends(r.bad_words_token_ids, r.output_token_ids, extra)
                ban_rows += [i] * len(banned)
                ban_ids += banned
            if sp.logit_bias is not None:
                biased.append((i, sp.logit_bias))
            if sp.repetition_penalty != 1.0 or sp.presence_penalty or sp.frequency_penalty:
                st = self.state(r)
                if st.token_counts is None:
                    st.token_counts = TokenCounts(r)
                st.token_counts.update(r)
                counted.append((st.token_counts, sp))
                counted_pos.append(i)
                counted_extra.append(extra)
        if ban_rows:
            logits[ban_rows, ban_ids] = float("-inf")
        if biased:
            self._add_bias(logits, biased)
        if counted:
            views = [c.with_extra(e) for (c, _), e in zip(counted, counted_extra)]
            sps = [sp for _, sp in counted]
            self._penalise(logits, counted_pos, [v[0] for v in views], None,
                           [sp.repetition_penalty for sp in sps], None)
            self._penalise(logits, counted_pos, [v[1] for v in views], [v[2] for v in views],
                           [sp.frequency_penalty for sp in sps], [sp.presence_penalty for sp in sps])
        return logits

    def _keep_only(self, logits: torch.Tensor, row: int, req: Request) -> None:
        """Every logit of `row` but those of the request's allowed ids set to -inf (one vocabulary-wide write); the
        ids' tensor is made once per request (a copy to the device per step and position otherwise)."""
        st = self.state(req)
        idx = st.allowed_idx
        if idx is None or idx.device != logits.device:
            idx = st.allowed_idx = torch.tensor(req.sampling_params.allowed_token_ids, device=logits.device)
        keep = logits[row, idx]
        logits[row] = float("-inf")
        logits[row, idx] = keep

    @staticmethod
    def _add_bias(logits, biased: list[tuple[int, dict]]) -> None:
        """Each (row, {id: bias}) added at its ids, all rows in one gather and one scatter (ids are unique within a
        row, so a plain indexed add is exact)."""
        rows = np.repeat(np.asarray([i for i, _ in biased], np.int64), [len(b) for _, b in biased])
        ids = np.fromiter((t for _, b in biased for t in b), np.int64, len(rows))
        vals = np.fromiter((v for _, b in biased for v in b.values()), np.float64, len(rows))
        x = _flat_cpu(logits)
        if x is not None:
            x[rows * logits.shape[1] + ids] += vals.astype(x.dtype)
            return
        dev = logits.device
        logits[torch.from_numpy(rows).to(dev), torch.from_numpy(ids).to(dev)] += \
            torch.from_numpy(vals).to(dev, logits.dtype)

    @staticmethod
    def _penalise(logits, rows, ids, counts, a, b) -> None:
        """Repetition (counts None: divide positive logits by a, multiply negative ones) or frequency and presence
        (subtract a x count + b) at each row's ids, all rows in one gather and one scatter."""
        lens = [len(x) for x in ids]
        if not sum(lens) or (counts is not None and not any(a) and not any(b)) or (counts is None and
                                                                                  all(x == 1.0 for x in a)):
            return
        x = _flat_cpu(logits)
        if x is not None:
            flat = np.repeat(np.asarray(rows, np.int64) * logits.shape[1], lens) + np.concatenate(ids)
            ea = np.repeat(np.asarray(a, x.dtype), lens)
            v = x[flat]
            if counts is None:
                x[flat] = np.where(v > 0, v / ea, v * ea)
            else:
                x[flat] = v - ea * np.concatenate(counts).astype(x.dtype) - np.repeat(np.asarray(b, x.dtype), lens)
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
        u = [0.0] * len(reqs)  # float64 either way; one tensor at the end, not a write per row
        free = [i for i, r in enumerate(reqs) if r.sampling_params.seed is None]
        if free:
            draws = torch.rand(len(free), generator=self.generator, dtype=torch.float64, device=self.device)
            for i, x in zip(free, draws.tolist()):
                u[i] = x
        for i, r in enumerate(reqs):
            if r.sampling_params.seed is not None:
                u[i] = torch.rand(1, generator=self.generator_for(r), dtype=torch.float64, device=self.device).item()
        return inverse_cdf(probs, torch.tensor(u, dtype=torch.float64))


def _flat_cpu(logits: torch.Tensor) -> Optional[np.ndarray]:
    """The logits as one flat numpy view when they are a contiguous float CPU tensor, else None: numpy does the
    same arithmetic in a handful of ~1 us calls instead of ~10 torch ones."""
    if logits.device.type == "cpu" and logits.is_contiguous() and logits.dtype in (torch.float32, torch.float64):
        return logits.numpy().reshape(-1)
    return None


def penalised(req: Request, sp) -> bool:
    """Whether a row's logits change before sampling: min_tokens, a logit bias, allowed ids, bad words or a
    penalty."""
    return req.num_output_tokens < sp.min_tokens or sp.repetition_penalty != 1.0 or bool(
        sp.presence_penalty or sp.frequency_penalty) or sp.logit_bias is not None or sp.allowed_token_ids is not None \
        or sp.bad_words is not None


def _bad_word_ends(words: list[list[int]], output: list[int], extra: list[int]) -> list[int]:
    """The last token of each bad word whose other tokens the output (then `extra`, a position's earlier drafts)
    ends with: vLLM's rule, over the output only."""
    out = []
    for w in words:
        k = len(w) - 1
        if k > len(output) + len(extra):
            continue
        tail = extra[len(extra) - k:] if k <= len(extra) else output[len(output) - (k - len(extra)):] + extra
        if k == 0 or tail == w[:-1]:
            out.append(w[-1])
    return out


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
