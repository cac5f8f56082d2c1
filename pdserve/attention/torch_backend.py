"""Torch-native paged attention over per-layer KV tensors `[2, num_blocks, block_size, kv_heads, head_dim]`.

A batch is split into groups of rows with one query length each. A group attends through its block table
`[rows, width]`; a key at context index j is visible to a query at position p iff j <= p. That one rule is the causal
mask for prefill chunks, the context bound for decodes, and it hides the tail of the last block and any null-block
padding of the table. It gathers each group's K/V up to the table's width, so its FULL layouts on CPU split the rows
into width groups (a FULL step must not pay for max_model_len keys per row) and on CUDA, where a captured graph
freezes shapes, attend through the whole table (the Triton backend reads each row's own length instead).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.attention.metadata import AttentionMetadata, width_groups


def write_kv(kv_cache: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    _, num_blocks, block_size, heads, dim = kv_cache.shape
    kv_cache[0].view(num_blocks * block_size, heads, dim).index_copy_(0, slot_mapping, k)
    kv_cache[1].view(num_blocks * block_size, heads, dim).index_copy_(0, slot_mapping, v)


def attention_masks(meta: AttentionMetadata, block_size: int, q_per_kv: int, dtype: torch.dtype,
                    skip: frozenset = frozenset()) -> list:
    """Per group, the additive mask [rows, 1, q_per_kv * query_len, ctx] that every layer shares: built once per
    forward, not once per layer (the query heads of a KV head are folded into the query axis, see below). None for
    the groups in `skip` (another kernel attends them)."""
    out = []
    for i, g in enumerate(meta.groups):
        if i in skip:
            out.append(None)
            continue
        rows, width = g.block_table.shape
        qlen, ctx = g.positions.shape[1], width * block_size
        visible = torch.arange(ctx, device=g.positions.device)[None, None, :] <= g.positions[:, :, None]
        hidden = ~visible[:, None].expand(rows, q_per_kv, qlen, ctx).reshape(rows, 1, q_per_kv * qlen, ctx)
        out.append(torch.zeros(hidden.shape, dtype=dtype, device=hidden.device).masked_fill_(hidden, float("-inf")))
    return out


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, positions: torch.Tensor,
                    mask: torch.Tensor, scale: float) -> torch.Tensor:
    """q: [rows * query_len, q_heads, dim] -> [rows * query_len, q_heads * dim]."""
    rows, width = block_table.shape
    qlen = positions.shape[1]
    _, _, block_size, kv_heads, dim = kv_cache.shape
    q_heads = q.shape[1]
    group = q_heads // kv_heads
    ctx = width * block_size
    # index_select copies whole blocks (one contiguous [block_size, kv_heads, dim] slab each): ~2x advanced
    # indexing's elementwise gather on CPU.
    k, v = kv_cache.index_select(1, block_table.reshape(-1)).view(2, rows, ctx, kv_heads, dim).transpose(2, 3) \
        .unbind(0)
    # Query heads sharing a KV head are folded into the query axis, so K/V are never repeated.
    qh = q.view(rows, qlen, kv_heads, group, dim).permute(0, 2, 3, 1, 4).reshape(rows, kv_heads, group * qlen, dim)
    out = F.scaled_dot_product_attention(qh, k, v, attn_mask=mask, scale=scale)
    return out.view(rows, kv_heads, group, qlen, dim).permute(0, 3, 1, 2, 4).reshape(rows * qlen, q_heads * dim)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
              masks: list, scale: float) -> torch.Tensor:
    write_kv(kv_cache, meta.slot_mapping, k, v)
    return attend(q, kv_cache, meta, masks, scale)


def attend(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, masks: list, scale: float,
           groups=None) -> torch.Tensor:
    """Every group (or only `groups`, indices into meta.groups) through paged_attention."""
    first = meta.groups[0].tokens
    if groups is None and len(meta.groups) == 1 and isinstance(first, slice) and first.start == 0 and \
            first.stop == q.shape[0]:
        g = meta.groups[0]
        return paged_attention(q[g.tokens], kv_cache, g.block_table, g.positions, masks[0], scale)
    # Zeros, not empty: padded tokens outside every group must stay finite, since their K/V land in the null
    # block and a masked NaN still poisons softmax(QK)V.
    out = q.new_zeros(q.shape[0], q.shape[1] * q.shape[2])
    for i in (range(len(meta.groups)) if groups is None else groups):
        g = meta.groups[i]
        out[g.tokens] = paged_attention(q[g.tokens], kv_cache, g.block_table, g.positions, masks[i], scale)
    return out


class TorchBackend:
    """The torch-native backend: per-forward masks, SDPA over each group's gathered K/V."""
    name = "torch"

    def __init__(self, device: torch.device):
        self.device = device

    def full_layout(self, num_reqs: int, row_blocks: list[int], max_blocks: int) -> tuple:
        """A FULL step's attention groups ((first row, end row, width), ...) over its padded rows, `row_blocks`
        being the real rows' context widths in layout order (ascending)."""
        if self.device.type == "cuda":
            return ((0, num_reqs, max_blocks),)
        return width_groups(row_blocks, num_reqs, max_width=max_blocks)

    def prepare(self, meta: AttentionMetadata, block_size: int, q_per_kv: int, dtype: torch.dtype):
        """Per forward, shared by every layer: the masks."""
        return attention_masks(meta, block_size, q_per_kv, dtype)

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata, state, scale: float) -> torch.Tensor:
        return attention(q, k, v, kv_cache, meta, state, scale)
