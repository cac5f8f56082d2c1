"""The rope table survives MKL's first-call race: a process's first threaded float32 cos (or sin) on 2 cores
sometimes returns one thread's half about 1e-4 off (torch 2.13 CPU; NOTES.md session 14). The race cannot be forced,
so a cos and sin whose first call is that wrong stand in for it: the table must still be exact."""
from __future__ import annotations

import torch

from pdserve.model.layers import RotaryEmbedding, _inv_freq


def _first_call_wrong(monkeypatch, name: str) -> None:
    real, calls = getattr(torch.Tensor, name), []

    def racy(self):
        out = real(self)
        calls.append(1)
        if len(calls) == 1:
            out.flatten()[out.numel() // 2:] += 1e-4
        return out
    monkeypatch.setattr(torch.Tensor, name, racy)


def test_the_table_is_exact_when_the_first_cos_and_sin_are_not(monkeypatch):
    head_dim, positions = 32, 93  # odd, so the bad half starts mid-row
    _first_call_wrong(monkeypatch, "cos")
    _first_call_wrong(monkeypatch, "sin")
    rope = RotaryEmbedding(head_dim, positions, {"rope_theta": 1e6}, torch.float32)
    inv, _ = _inv_freq(head_dim, {"rope_theta": 1e6})
    freqs = (torch.arange(positions, dtype=torch.float32)[:, None] * inv[None, :]).double()
    emb = torch.cat((freqs, freqs), -1)
    cos, sin = rope.cos_sin[:, 0, 0].double(), rope.cos_sin[:, 1, 0].double()
    assert (cos - emb.cos()).abs().max() < 1e-6
    assert (sin.abs() - emb.sin().abs()).abs().max() < 1e-6
