"""The decoder shared by Qwen3 and Llama (they differ in per-head q/k norms and bias flags).

Q/K/V and gate/up projections are fused at load time: fewer, larger GEMMs per layer.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.model.hf_config import ArchSpec, ModelDims
from pdserve.model.layers import Linear, RMSNorm, RotaryEmbedding
from pdserve.attention.metadata import AttentionMetadata
from pdserve.attention.torch_backend import TorchBackend


class DecoderLayer(nn.Module):
    def __init__(self, d: ModelDims, spec: ArchSpec, dtype: torch.dtype):
        super().__init__()
        self.d = d
        self.input_layernorm = RMSNorm(d.hidden_size, d.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(d.hidden_size, d.rms_norm_eps, dtype)
        self.q_size, self.kv_size = d.num_heads * d.head_dim, d.num_kv_heads * d.head_dim
        self.qkv_proj = Linear(d.hidden_size, self.q_size + 2 * self.kv_size, d.attention_bias, dtype)
        self.o_proj = Linear(self.q_size, d.hidden_size, d.attention_bias, dtype)
        # Qwen3's q_norm and k_norm as one norm over the q and k heads (rows: q_norm's weight, then k_norm's).
        self.qk_norm = RMSNorm((d.num_heads + d.num_kv_heads, d.head_dim), d.rms_norm_eps, dtype) \
            if spec.qk_norm else None
        self.gate_up_proj = Linear(d.hidden_size, 2 * d.intermediate_size, d.mlp_bias, dtype)
        self.down_proj = Linear(d.intermediate_size, d.hidden_size, d.mlp_bias, dtype)
        self.scale = d.head_dim ** -0.5

    def pre_attention(self, x, positions, rope: RotaryEmbedding):
        """The layer up to its attention's inputs: q [t, heads, dim], k and v [t, kv_heads, dim]."""
        d, t = self.d, x.shape[0]
        qkv = self.qkv_proj(self.input_layernorm(x)).view(t, d.num_heads + 2 * d.num_kv_heads, d.head_dim)
        qk, v = qkv[:, :d.num_heads + d.num_kv_heads], qkv[:, d.num_heads + d.num_kv_heads:]
        if self.qk_norm is not None:
            qk = self.qk_norm(qk)
        qk = rope(positions, qk)
        return qk[:, :d.num_heads], qk[:, d.num_heads:], v

    def post_attention(self, x, attn_out):
        """The layer from its attention's output: the residual stream after the MLP."""
        x = x + self.o_proj(attn_out)
        gate, up = self.gate_up_proj(self.post_attention_layernorm(x)).chunk(2, dim=-1)
        return x + self.down_proj(F.silu(gate) * up)

    def forward(self, x, positions, rope: RotaryEmbedding, kv_cache, meta: AttentionMetadata, attn, attn_state):
        q, k, v = self.pre_attention(x, positions, rope)
        return self.post_attention(x, attn.forward(q, k, v, kv_cache, meta, attn_state, self.scale))


class CausalLM(nn.Module):
    def __init__(self, d: ModelDims, spec: ArchSpec, dtype: torch.dtype):
        super().__init__()
        self.dims = d
        self.embed_tokens = nn.Embedding(d.vocab_size, d.hidden_size, dtype=dtype)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(DecoderLayer(d, spec, dtype) for _ in range(d.num_layers))
        self.norm = RMSNorm(d.hidden_size, d.rms_norm_eps, dtype)
        self.lm_head = Linear(d.hidden_size, d.vocab_size, False, dtype)
        self.rope = RotaryEmbedding(d.head_dim, d.max_positions, d.rope, dtype)
        self.kv_caches: list[torch.Tensor] = []  # set by the model runner, one per layer
        self.attn_backend = TorchBackend(torch.device("cpu"))  # the model runner sets the configured one

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        d = self.dims
        attn = self.attn_backend
        state = attn.prepare(meta, self.kv_caches[0].shape[2], d.num_heads // d.num_kv_heads, x.dtype)
        for layer, cache in zip(self.layers, self.kv_caches):
            x = layer(x, positions, self.rope, cache, meta, attn, state)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def pack_for_cpu(self) -> None:
        for m in self.modules():
            if isinstance(m, Linear):
                m.pack_for_cpu()
