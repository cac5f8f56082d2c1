"""What a sampling row draws from, and the draw: temperature, top-k, top-p and min-p (`filtered_probs`), then one
uniform per row through the inverse CDF (`inverse_cdf`).

Both run as numpy on CPU and as torch elsewhere, with the same arithmetic in the same order (tests hold each against
a row-by-row reference and the two against each other). On CPU a step pays per operation more than per byte: the
forward has just evicted the sampler's code and data from cache, a torch call costs several microseconds there and a
numpy call about one, and the filtered rows' work is a few dozen calls. The speculative verifier and the rejection
sampler call the same two functions, so plain and speculative decoding draw the same token from the same uniform.
"""
from __future__ import annotations

import numpy as np
import torch

CDF_CHUNK = 128
TOP_CANDIDATES = 64
_MIN_INV_T = float(np.finfo(np.float32).tiny)


def _on_host(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64)


def filtered_probs(logits: torch.Tensor, reqs: list, device_path: bool = False) -> torch.Tensor:
    """Temperature, then top-k and top-p, then min-p: the distribution each row samples from. Top-k and top-p keep
    the tokens at or above a per-row threshold: top-k's k-th largest value, then top-p's value where the mass of
    what top-k kept, from the top, reaches top_p (that token included). Ties at a threshold are kept. One
    exponential per token, and no normalisation: thresholds, the cut and min-p work on exp((x - max) / T), the
    largest exactly 1, and each row comes back up to its own factor (inverse_cdf, and so the rejection sampler,
    read a row's total; divide by the row sum for probabilities). `device_path`: the torch arithmetic even on CPU
    (tests)."""
    sps = [r.sampling_params for r in reqs]
    vocab = logits.shape[-1]
    # 1/T kept a normal float32: one that underflows to 0 makes a banned token's -inf x 0 = NaN, which the draw
    # could take; at the floor every allowed token rounds to the same value, T's limit (uniform over them)
    inv_t = [max(1.0 / sp.temperature, _MIN_INV_T) for sp in sps]
    rows = [i for i, sp in enumerate(sps) if 0 < sp.top_k < vocab or sp.top_p < 1.0]
    ks = [sps[i].top_k if 0 < sps[i].top_k < vocab else vocab for i in rows]
    tps = [sps[i].top_p for i in rows]
    min_p = [sp.min_p for sp in sps]
    if _on_host(logits) and not device_path:
        return torch.from_numpy(_filtered_np(logits.detach().numpy(), inv_t, rows, ks, tps, min_p))
    return _filtered_torch(logits, inv_t, rows, ks, tps, min_p)


def _filtered_np(logits: np.ndarray, inv_t, rows, ks, tps, min_p) -> np.ndarray:
    n, vocab = logits.shape
    with np.errstate(invalid="ignore"):  # a row without a finite logit turns NaN, as under torch; inverse_cdf copes
        e = logits - logits.max(-1, keepdims=True)
    e *= np.asarray(inv_t, e.dtype)[:, None]
    np.exp(e, out=e)
    if rows:
        every = len(rows) == n  # the common case: no row indexing, the cut in place
        sub = e if every else e[rows]
        ks_a, tps_a = np.asarray(ks), np.asarray(tps, e.dtype)
        threshold, rest = _top_thresholds_np(sub, ks_a, tps_a)
        if len(rest):
            threshold[rest] = _sorted_thresholds_np(sub[rest], ks_a[rest], tps_a[rest])
        np.multiply(sub, sub >= threshold[:, None], out=sub)
        if not every:
            e[rows] = sub
    if any(m > 0 for m in min_p):  # relative to the largest, which is 1 (or, cut, still 1)
        np.multiply(e, e >= np.asarray(min_p, e.dtype)[:, None], out=e)
    return e


def _top_thresholds_np(e: np.ndarray, ks: np.ndarray, tps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Thresholds read off each row's TOP_CANDIDATES largest values, exact wherever the threshold lies among them:
    a top-k of at most that many, and a top-p whose mass is reached inside them (real models put it in a few
    tokens; a partition costs about half a full sort). The other rows' indices come back for the full sort."""
    n, vocab = e.shape
    m = min(TOP_CANDIDATES, vocab)
    desc = np.sort(np.partition(e, vocab - m, axis=-1)[:, vocab - m:], axis=-1)[:, ::-1]
    ar = np.arange(n)
    has_k = ks < vocab
    kth = np.where(has_k, desc[ar, np.minimum(ks, m) - 1], 0).astype(e.dtype)
    kept = desc * (desc >= kth[:, None])  # top-k's candidates (all of its mass when k <= m)
    total = np.where(has_k, kept.sum(-1), e.sum(-1))
    target = tps * total
    c = np.cumsum(kept, -1)
    # Kept: every token whose mass above it is short of top_p of the total: up to the first whose running sum,
    # from the top, reaches top_p x the total (running sums of non-negative values never decrease).
    last = np.minimum((c < target[:, None]).sum(-1), m - 1)
    threshold = np.where(tps >= 1.0, kth, np.maximum(kth, desc[ar, last]))
    exact = ((tps >= 1.0) | (c[:, -1] >= target)) & (~has_k | (ks <= m))
    return threshold, np.flatnonzero(~exact)


def _sorted_thresholds_np(e: np.ndarray, ks: np.ndarray, tps: np.ndarray) -> np.ndarray:
    """The same thresholds off one ascending sort of each row's values, for any top-k and top-p."""
    n, vocab = e.shape
    asc = np.sort(e, axis=-1)
    ar = np.arange(n)
    at_k = vocab - ks  # the k-th largest value's index
    kth = asc[ar, at_k]
    if (ks < vocab).any():
        np.multiply(asc, asc >= kth[:, None], out=asc)
    # Kept: from the first index whose running sum passes (1 - top_p) x the total; the largest always stays.
    first = np.where(tps >= 1.0, at_k, _first_past_np(asc, 1.0 - tps))  # top-k only: no float sum cuts its tail
    return np.maximum(kth, asc[ar, first])  # top-p past what top-k kept reads 0


def _chunked(p, n: int, vocab: int, pad):
    return (p if vocab % CDF_CHUNK == 0 else pad(p, CDF_CHUNK - vocab % CDF_CHUNK)).reshape(n, -1, CDF_CHUNK)


def _first_past_np(asc: np.ndarray, frac: np.ndarray) -> np.ndarray:
    """Per row of non-negative `asc`, the first index whose running sum exceeds frac x the row's total (clamped to
    the last index), in two levels as inverse_cdf (a vocabulary-wide running sum is slow on CPU)."""
    n, vocab = asc.shape
    chunks = _chunked(asc, n, vocab, lambda p, w: np.pad(p, ((0, 0), (0, w))))
    ends = np.cumsum(chunks.sum(-1), -1)
    target = frac * ends[:, -1]
    ar = np.arange(n)
    j = np.minimum((ends <= target[:, None]).sum(-1), ends.shape[1] - 1)
    start = np.where(j > 0, ends[ar, j - 1], 0)
    inner = np.cumsum(chunks[ar, j], -1)
    k = np.minimum((inner <= (target - start)[:, None]).sum(-1), CDF_CHUNK - 1)
    return np.minimum(j * CDF_CHUNK + k, vocab - 1)


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor, device_path: bool = False) -> torch.Tensor:
    """For each row, the first token whose running sum of `probs` passes u x the row's total, u in [0, 1): a token
    of probability 0 is never taken. Two levels, so no vocabulary-wide running sum (slow on CPU): float64 chunk sums
    find the chunk, a float64 running sum inside it the token. A row with no mass (all zero, NaN) takes its
    argmax. `device_path`: the torch arithmetic even on CPU (tests)."""
    if _on_host(probs) and not device_path:
        return torch.from_numpy(_inverse_cdf_np(probs.detach().numpy(), u.detach().cpu().numpy()))
    n, vocab = probs.shape
    chunks = _chunked(probs, n, vocab, lambda p, w: torch.nn.functional.pad(p, (0, w)))
    ends = chunks.sum(-1, dtype=torch.float64).cumsum(-1)  # [n, chunks]: the running sum at each chunk's end
    total = ends[:, -1]
    target = u.to(probs.device) * total
    j = torch.searchsorted(ends, target[:, None], right=True)[:, 0].clamp_(max=ends.shape[1] - 1)
    start = torch.where(j > 0, ends.gather(1, (j - 1).clamp(min=0)[:, None])[:, 0], torch.zeros_like(total))
    inner = chunks[torch.arange(n, device=probs.device), j].double().cumsum(-1)  # [n, CDF_CHUNK]
    k = torch.searchsorted(inner, (target - start)[:, None], right=True)[:, 0]
    # rounding between the two levels may point past the chunk's last token with mass: take that one
    k = torch.minimum(k, (inner < inner[:, -1:]).sum(-1))
    bad = ~(total > 0)
    idx = j * CDF_CHUNK + k
    return torch.where(bad, probs.argmax(-1), idx) if bool(bad.any()) else idx


def _inverse_cdf_np(probs: np.ndarray, u: np.ndarray) -> np.ndarray:
    n, vocab = probs.shape
    chunks = _chunked(probs, n, vocab, lambda p, w: np.pad(p, ((0, 0), (0, w))))
    ends = np.cumsum(chunks.sum(-1, dtype=np.float64), -1)
    total = ends[:, -1]
    target = u * total
    ar = np.arange(n)
    j = np.minimum((ends <= target[:, None]).sum(-1), ends.shape[1] - 1)  # searchsorted, right=True
    start = np.where(j > 0, ends[ar, j - 1], 0.0)
    inner = np.cumsum(chunks[ar, j].astype(np.float64), -1)
    k = (inner <= (target - start)[:, None]).sum(-1)
    k = np.minimum(k, (inner < inner[:, -1:]).sum(-1))  # as above: never past the chunk's last token with mass
    idx = j * CDF_CHUNK + k
    bad = ~(total > 0)
    return np.where(bad, probs.argmax(-1), idx) if bad.any() else idx


def _filtered_torch(logits: torch.Tensor, inv_t, rows, ks, tps, min_p) -> torch.Tensor:
    dev, dt = logits.device, logits.dtype
    t = torch.tensor(inv_t, device=dev, dtype=dt)[:, None]
    e = (logits - logits.amax(-1, keepdim=True)).mul_(t).exp_()
    if rows:
        every = len(rows) == len(inv_t)
        sub = e if every else select_rows(e, rows)
        threshold, rest = _top_thresholds_torch(sub, ks, tps)
        if rest:
            threshold[rest] = _sorted_thresholds_torch(select_rows(sub, rest), [ks[i] for i in rest],
                                                       [tps[i] for i in rest])
        sub.mul_(sub >= threshold)
        if not every:
            e[rows] = sub
    if any(m > 0 for m in min_p):
        m = torch.tensor(min_p, device=dev, dtype=dt)[:, None]
        e.mul_(e >= m)
    return e


def _top_thresholds_torch(e: torch.Tensor, ks: list[int], tps: list[float]) -> tuple[torch.Tensor, list[int]]:
    n, vocab = e.shape
    m = min(TOP_CANDIDATES, vocab)
    desc = e.topk(m, dim=-1).values
    dev = e.device
    k = torch.tensor(ks, device=dev)
    top_p = torch.tensor(tps, device=dev, dtype=e.dtype)[:, None]
    has_k = (k < vocab)[:, None]
    kth = torch.where(has_k, desc.gather(1, (k.clamp(max=m) - 1)[:, None]), torch.zeros_like(desc[:, :1]))
    kept = desc.mul(desc >= kth)
    total = torch.where(has_k, kept.sum(-1, keepdim=True), e.sum(-1, keepdim=True))
    c = kept.cumsum(-1)
    last = torch.searchsorted(c, top_p * total).clamp_(max=m - 1)
    threshold = torch.where(top_p >= 1.0, kth, torch.maximum(kth, desc.gather(1, last)))
    exact = (top_p >= 1.0) | (c[:, -1:] >= top_p * total)
    exact &= ~has_k | (k <= m)[:, None]
    return threshold, [i for i, ok in enumerate(exact[:, 0].tolist()) if not ok]


def _sorted_thresholds_torch(e: torch.Tensor, ks: list[int], tps: list[float]) -> torch.Tensor:
    vocab, dev = e.shape[1], e.device
    asc = e.sort(dim=-1).values
    at_k = torch.tensor([vocab - k for k in ks], device=dev)[:, None]
    kth = asc.gather(1, at_k)
    if min(ks) < vocab:
        asc.mul_(asc >= kth)
    top_p = torch.tensor(tps, device=dev, dtype=asc.dtype)
    first = torch.where(top_p[:, None] >= 1.0, at_k, _first_past_torch(asc, 1.0 - top_p)[:, None])
    return torch.maximum(kth, asc.gather(1, first))


def _first_past_torch(asc: torch.Tensor, frac: torch.Tensor) -> torch.Tensor:
    n, vocab = asc.shape
    chunks = _chunked(asc, n, vocab, lambda p, w: torch.nn.functional.pad(p, (0, w)))
    ends = chunks.sum(-1).cumsum(-1)
    target = frac * ends[:, -1]
    j = torch.searchsorted(ends, target[:, None], right=True)[:, 0].clamp_(max=ends.shape[1] - 1)
    start = torch.where(j > 0, ends.gather(1, (j - 1).clamp(min=0)[:, None])[:, 0], torch.zeros_like(target))
    inner = chunks[torch.arange(n, device=asc.device), j].cumsum(-1)
    k = torch.searchsorted(inner, (target - start)[:, None], right=True)[:, 0].clamp_(max=CDF_CHUNK - 1)
    return (j * CDF_CHUNK + k).clamp_(max=vocab - 1)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """Each row's argmax (first of ties; NaN counts as largest, as torch's). On CPU through numpy: torch's argmax
    over a vocabulary-wide last axis ran ~10x slower here (0.15 vs 0.014 ms at 32 x 8192)."""
    if _on_host(x):
        return torch.from_numpy(x.detach().numpy().argmax(-1))
    return x.argmax(dim=-1)


def select_rows(x: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """x[rows] by index_select (a list index took ~4x as long on CPU)."""
    return x.index_select(0, torch.tensor(rows, device=x.device))
