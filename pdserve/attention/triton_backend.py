"""The Triton backend: decode-shaped groups (query length up to MAX_KERNEL_Q: decodes and speculative rows of
1 + K) through the paged decode kernel, which reads each row's length from its positions on the device, so a FULL
graph over the whole block table reads only each row's own blocks; longer groups (prefill chunks) through the torch
backend's SDPA over gathered K/V, since a prefill is compute-bound and reads its whole context anyway.
"""
from __future__ import annotations

import torch

from pdserve.attention.metadata import AttentionMetadata
from pdserve.attention.torch_backend import attend, attention_masks, write_kv
from pdserve.attention.triton_decode import DecodeWorkspace, paged_decode

MAX_KERNEL_Q = 16  # 1 + the largest K speculative decoding allows, with room
MAX_SPLITS = 16


def num_splits(rows: int, width: int) -> int:
    """Context splits per (row, KV head): enough programs to fill a GPU at small batches, at least 4 blocks each.
    A function of the group's shape only, so a captured graph's grid is fixed."""
    return max(1, min(MAX_SPLITS, width // 4, 256 // max(1, rows)))


class TritonBackend:
    name = "triton"

    def __init__(self, device: torch.device):
        self.device = device
        self.workspace = DecodeWorkspace(device)

    def full_layout(self, num_reqs: int, row_blocks: list[int], max_blocks: int) -> tuple:
        return ((0, num_reqs, max_blocks),)  # per-row lengths come from the positions: one shape per descriptor

    def prepare(self, meta: AttentionMetadata, block_size: int, q_per_kv: int, dtype: torch.dtype):
        kernel = frozenset(i for i, g in enumerate(meta.groups) if g.positions.shape[1] <= MAX_KERNEL_Q)
        masks = attention_masks(meta, block_size, q_per_kv, dtype, skip=kernel) if len(kernel) < len(meta.groups) \
            else None
        return kernel, masks

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata, state, scale: float) -> torch.Tensor:
        write_kv(kv_cache, meta.slot_mapping, k, v)
        kernel, masks = state
        groups = meta.groups
        if len(groups) == 1 and kernel and groups[0].tokens == slice(0, q.shape[0]):
            g = groups[0]
            return paged_decode(q, kv_cache, g.block_table, g.positions, scale,
                                num_splits(*g.block_table.shape), self.workspace)
        if not kernel:  # prefill chunks only: the torch backend's path, its single-group fast path included
            return attend(q, kv_cache, meta, masks, scale)
        rest = [i for i in range(len(groups)) if i not in kernel]
        out = attend(q, kv_cache, meta, masks, scale, rest) if rest else \
            q.new_zeros(q.shape[0], q.shape[1] * q.shape[2])
        for i in kernel:
            g = groups[i]
            out[g.tokens] = paged_decode(q[g.tokens], kv_cache, g.block_table, g.positions, scale,
                                         num_splits(*g.block_table.shape), self.workspace)
        return out
