"""Building blocks with the numerics of Hugging Face's Qwen3/Llama code, so greedy outputs match it exactly."""
from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """Normalises over the last dim; `shape` is the weight's (a [heads, head_dim] weight norms several heads' q and
    k at once)."""

    def __init__(self, shape, eps: float, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(shape, dtype=dtype), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # the same arithmetic as below, without the casts' op calls
            return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))
        # Like transformers: normalise in float32 (even for float64 input), scale in the input dtype.
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def _packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN's packed GEMM serves this dtype on this CPU. float32: MKL's small-M GEMM is 2-4x slower on
    these machines (CPU-NOTES.md) and the packed one was as fast or faster at every M from 1 to 512, but for one row
    on a small weight (`PLAIN_ONE_ROW_MAX`). bfloat16:
    F.linear's unpacked bf16 GEMM made a decode step slower than packed float32's (a scratch run, NOTES.md session
    9), packed bf16 reads half the bytes (forward_profile.py --dtype bfloat16); only where oneDNN has bf16 kernels
    (AVX512-BF16, AMX or its AVX-512 emulation). float64 has no oneDNN GEMM and stays on F.linear (the exactness
    tests' dtype)."""
    if not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return False
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


# A one-row call (a lone decode) on a weight of at most this many elements goes to F.linear: there oneDNN's fixed
# cost (~15 us a call here) is more than F.linear's whole call, and a tiny model's one-row decode step ran 25% faster
# unpacked; at two rows and more, or on larger weights, packed was as fast or faster (benchmarks/linear_pack.py).
# One row only: a FULL step is never padded from or to one row, so FULL and eager take the same kernel for every
# row count (tests/worker/test_graphs.py's FULL == eager bound holds). PDSERVE_PLAIN_ONE_ROW_MAX sets it (0: every
# call packed, as before the rule) for A/B runs.
PLAIN_ONE_ROW_MAX = int(os.environ.get("PDSERVE_PLAIN_ONE_ROW_MAX", "320000"))


class Linear(nn.Module):
    """y = x W^T + b. On CPU in float32 and bfloat16 the weight is also kept in oneDNN's packed layout (`_packs`
    says why), which decode steps' small M gains most from, except for one row on a small weight
    (`PLAIN_ONE_ROW_MAX`)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False) if bias else None
        self.packed = None
        self.packed_min_rows = 1  # rows from which the packed GEMM is used: 1 or 2 (set by pack_for_cpu)

    def pack_for_cpu(self) -> None:
        w = self.weight
        if w.device.type != "cpu" or not _packs(w.dtype):
            return
        try:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), 8)
        except (RuntimeError, AttributeError):  # torch built without oneDNN
            self.packed = None
        # float32 only: bfloat16's unpacked GEMM is the slow one at every size (`_packs`)
        self.packed_min_rows = 2 if w.dtype == torch.float32 and w.numel() <= PLAIN_ONE_ROW_MAX else 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None and x.numel() // x.shape[-1] >= self.packed_min_rows:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def _inv_freq(head_dim: int, rope: dict) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (float32, as transformers computes them) and the attention scaling factor."""
    base = float(rope.get("rope_theta", 10000.0))
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return inv, 1.0
    if kind == "linear":
        return inv / float(rope["factor"]), 1.0
    if kind == "llama3":
        factor, lo, hi = float(rope["factor"]), float(rope["low_freq_factor"]), float(rope["high_freq_factor"])
        old_len = float(rope["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old_len / lo, inv / factor, inv)
        smooth = (old_len / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / hi) & ~(wavelen > old_len / lo)
        return torch.where(medium, smoothed, scaled), 1.0
    raise ValueError(f"unsupported rope_type {kind!r}; supported: default, linear, llama3")


def _warm_vml() -> None:
    """A process's first threaded MKL vector-math call (cos, exp, ...: torch's float32 CPU kernels for them) can
    return the second thread's half at low accuracy (~1e-4 relative; about 1 process in 35 on 2 cores, torch 2.13
    CPU, an init race: NOTES.md sessions 14-15); later calls, of any of them, are exact. Calls big enough to be split
    over threads, thrown away, before the rope table and anything after it (the sampler, transformers' rope)."""
    x = torch.full((2048 * max(8, torch.get_num_threads()),), 0.5, dtype=torch.float32, device="cpu")
    x.cos(), x.sin()  # not exp/log: a warm exp made tiny-model decode ~10% slower in a noisy A/B (NOTES.md)


class RotaryEmbedding(nn.Module):
    """cos/sin over all positions, computed in float32 like transformers, then cast to the model dtype, in one table
    [positions, 2, 1, head_dim] read by index once per forward. transformers' x * cos + rotate_half(x) * sin, with
    rotate_half(x) = [-x2, x1], is computed as x * cos + [x2, x1] * [-sin1, sin2]: the same products (negation is
    exact), in three fewer op calls."""

    def __init__(self, head_dim: int, max_positions: int, rope: dict, dtype: torch.dtype):
        super().__init__()
        inv, scaling = _inv_freq(head_dim, rope)
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        _warm_vml()
        cos, sin = (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)
        sin[:, :head_dim // 2] *= -1
        self.register_buffer("cos_sin", torch.stack((cos, sin), 1)[:, :, None], persistent=False)
        self.half = head_dim // 2

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x: [tokens, heads, head_dim] (q and k heads together)."""
        cos, sin = self.cos_sin[positions].unbind(1)
        swapped = x.unflatten(-1, (2, self.half)).flip(-2).flatten(-2)
        return x * cos + swapped * sin
