"""Prompt-lookup (n-gram) drafting: the tokens that followed the longest earlier occurrence of the sequence's suffix.

Semantics are exactly vLLM V1's `_find_longest_matched_ngram_and_propose_tokens` (vllm/v1/spec_decode/
ngram_proposer.py, a KMP scan of the reversed sequence with the border capped at max_n): among all earlier
occurrences of a suffix n-gram (n <= n_max, the occurrence ending before the last token, overlap with the suffix
allowed), take the largest n; if n < n_min there is no draft; among the occurrences of that n the EARLIEST wins
(vLLM updates its position on `>=` while scanning the reversed tokens, so the last hit there is the first one
here); the draft is what follows it, up to k tokens, fewer where the sequence ends. A sequence shorter than n_min
drafts nothing.

Here it is numpy, not numba: one vectorised compare of every token with the last one, then at most n_max - 1
compares over the surviving candidates only (each step filters the earlier occurrences of a one-longer suffix). No
Python loop over tokens; O(context) plus O(candidates x n_max).
"""
from __future__ import annotations

import weakref
from typing import Optional, Sequence, Union

import numpy as np

from pdserve.spec_decode.config import SpeculativeConfig
from pdserve.spec_decode.rejection_sampler import PLACEHOLDER_TOKEN_ID


def propose(tokens: np.ndarray, k: int, n_min: int, n_max: int) -> np.ndarray:
    """Up to k draft tokens for one request from its token ids (prompt + output so far); empty when nothing
    matches. The result is a copy: the caller's token buffer may grow or be rewritten after."""
    t = np.asarray(tokens)
    n = t.shape[0]
    if k <= 0 or n < n_min:
        return t[:0].copy()
    # ends: where an earlier occurrence of the current suffix ends (strictly before the last token, so at least
    # one token follows it); after step j they are the occurrences of the (j+1)-token suffix, still ascending.
    ends = np.flatnonzero(t[:n - 1] == t[n - 1])
    best, length = ends, int(ends.size > 0)
    for j in range(1, n_max):
        ends = ends[ends >= j]  # the occurrence must start at or after position 0
        ends = ends[t[ends - j] == t[n - 1 - j]]
        if not ends.size:
            break
        best, length = ends, j + 1
    if length < n_min:
        return t[:0].copy()
    start = int(best[0]) + 1
    return t[start:start + k].copy()


def propose_batch(seqs: Sequence[np.ndarray], k: Union[int, Sequence[int]], n_min: int, n_max: int
                  ) -> list[np.ndarray]:
    """`propose` for several requests; `k` one for all or one per request (a row near its context limit asks for
    fewer)."""
    ks = [k] * len(seqs) if isinstance(k, int) else list(k)
    return [propose(s, kk, n_min, n_max) for s, kk in zip(seqs, ks)]


def pad_drafts(drafts: Sequence[np.ndarray], k: int) -> np.ndarray:
    """[rows, k] int64 drafts, each row's missing tail filled with PLACEHOLDER_TOKEN_ID so a decode batch stays
    uniform at q = 1 + k (a placeholder is always rejected and never emitted)."""
    out = np.full((len(drafts), k), PLACEHOLDER_TOKEN_ID, np.int64)
    for i, d in enumerate(drafts):
        out[i, :min(len(d), k)] = d[:k]
    return out


class NgramProposer:
    """The engine's n-gram drafter: the config's K and lookup bounds, and (as vLLM) no draft past max_model_len:
    a sequence of n tokens drafts at most max_model_len - n."""

    def __init__(self, cfg: SpeculativeConfig, max_model_len: Optional[int] = None):
        self.k, self.n_min, self.n_max = cfg.num_speculative_tokens, cfg.prompt_lookup_min, cfg.prompt_lookup_max
        self.max_model_len = max_model_len
        # Each request's tokens mirrored as int64 ([array, entries filled]), keyed weakly by the Request object: the
        # mirror dies with its request, with no call on finish (the proposer, the scheduler's, is never told of one),
        # and a later request reusing an id never reads an old mirror. A preempted request keeps its tokens, so its
        # mirror stays valid.
        self._buffers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def _k(self, n: int, k: Optional[int]) -> int:
        k = self.k if k is None else min(k, self.k)
        return k if self.max_model_len is None else min(k, self.max_model_len - n)

    def propose(self, tokens: np.ndarray, k: Optional[int] = None) -> np.ndarray:
        return propose(tokens, self._k(len(tokens), k), self.n_min, self.n_max)

    def propose_batch(self, seqs: Sequence[np.ndarray], ks: Optional[Sequence[int]] = None) -> list[np.ndarray]:
        ks = [None] * len(seqs) if ks is None else ks
        return [self.propose(s, k) for s, k in zip(seqs, ks)]

    def propose_padded(self, seqs: Sequence[np.ndarray], ks: Optional[Sequence[int]] = None) -> np.ndarray:
        return pad_drafts(self.propose_batch(seqs, ks), self.k)

    def propose_padded_for(self, req, k: int) -> list[int]:
        """`k` drafts for a request's next step from its prompt and output so far, placeholders after the real
        ones. The request's tokens are mirrored in an int64 array that only grows by what was appended since the
        last call: converting the whole Python list every step would cost O(context) per row."""
        buf = self._buffers.get(req)
        n = req.num_tokens
        if buf is None or len(buf[0]) < n:
            arr = np.empty(max(64, 2 * n), np.int64)
            filled = 0 if buf is None else buf[1]
            if filled:
                arr[:filled] = buf[0][:filled]
            buf = self._buffers[req] = [arr, filled]
        arr, filled = buf
        if filled < n:
            arr[filled:n] = req.all_token_ids[filled:n]
            buf[1] = n
        real = propose(arr[:n], min(k, self.k), self.n_min, self.n_max).tolist()
        return real + [PLACEHOLDER_TOKEN_ID] * (k - len(real))
