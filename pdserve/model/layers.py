"""Building blocks with the numerics of Hugging Face's Qwen3/Llama code, so greedy outputs match it exactly."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Like transformers: normalise in float32 (even for float64 input), scale in the input dtype.
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class Linear(nn.Module):
    """y = x W^T + b. On CPU in float32 the weight is also kept in oneDNN's packed layout: MKL's small-M GEMM is
    2-4x slower on these machines (CPU-NOTES.md), and decode steps are all small M; the packed GEMM measured as
    fast or faster at every M from 1 to 512 here."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False) if bias else None
        self.packed = None

    def pack_for_cpu(self) -> None:
        w = self.weight
        if w.device.type != "cpu" or w.dtype != torch.float32 or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
            return
        try:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), 8)
        except (RuntimeError, AttributeError):  # torch built without oneDNN
            self.packed = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
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


class RotaryEmbedding(nn.Module):
    """cos/sin table over all positions, computed in float32 like transformers, then cast to the model dtype."""

    def __init__(self, head_dim: int, max_positions: int, rope: dict, dtype: torch.dtype):
        super().__init__()
        inv, scaling = _inv_freq(head_dim, rope)
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", (emb.cos() * scaling).to(dtype), persistent=False)
        self.register_buffer("sin", (emb.sin() * scaling).to(dtype), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
