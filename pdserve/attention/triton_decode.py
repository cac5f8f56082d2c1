"""Paged decode attention in Triton: uniform rows of q = 1..1 + K query tokens over a paged KV cache, GQA, split
over the context (flash-decoding), every length read from device tensors. Capturable in a CUDA graph: no host
syncs, a grid fixed by (rows, KV heads, splits), no autotuning.

Layouts (those of the torch backend): q [rows * q, q_heads, dim]; the layer's cache [2, num_blocks, block_size,
kv_heads, dim]; block_table [rows, width] int64; positions [rows, q] int64, the query tokens' positions in order
(a key at context index j is visible to a query at position p iff j <= p: causal inside the row's query block and
the context bound in one rule). A row's context is positions[r, -1] + 1 tokens, so a FULL graph with the whole
table in its shape reads only each row's own blocks. Padded rows (position 0, null block) read one key of the
zeroed null block: finite.

One program per (row, KV head, split) holds the G x q query vectors of the KV head's G query heads (padded to 16
rows), walks its share of the row's context in tiles of keys with an online softmax, and writes a partial (max,
sum, accumulator); a second kernel combines the splits. A tile's keys find their blocks one by one through the
table, so a tile may span small blocks or cover part of a large one: any power-of-two block size works. float32
dots ask for IEEE precision, so results match the torch backend to rounding. `triton_aot.py` compiles the kernels
for a GPU architecture on any machine: what the interpreter accepts and a GPU compile rejects shows up there.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# A loop step's keys: at least 16 (the K dimension of `p @ v`, which a GPU compile rejects below 16 while the
# interpreter takes any size), at most 64 (a 128-token block of 256-dim fp32 K and V would not fit in shared memory)
MIN_TILE, MAX_TILE = 16, 64


# Triton compiles a variant per integer equal to 1 or divisible by 16 and per pointer alignment. The split count,
# the table width and the group slices' offsets vary from step to step in eager and PIECEWISE steps, so each new
# combination would compile mid-run: they are not specialized (their loads are scalar, nothing to vectorize).
@triton.jit(do_not_specialize=["table_width", "num_splits"], do_not_specialize_on_alignment=["table_ptr", "pos_ptr"])
def _decode_split(q_ptr, kv_ptr, table_ptr, pos_ptr, part_acc, part_ml, scale,
                  stride_kv_kind, stride_kv_block, stride_kv_tok, stride_kv_head, table_width, num_splits,
                  Q: tl.constexpr, G: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                  TILE: tl.constexpr, BLOCK_M: tl.constexpr, IEEE: tl.constexpr):
    row = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    m = tl.arange(0, BLOCK_M)  # query vector: qi = m // G, head h * G + m % G
    qi = m // G
    valid_m = m < Q * G
    d = tl.arange(0, D)
    pos = tl.load(pos_ptr + row * Q + qi, mask=valid_m, other=0)  # [BLOCK_M]
    ctx = tl.load(pos_ptr + row * Q + Q - 1) + 1
    q_off = ((row * Q + qi) * (KVH * G) + h * G + m % G) * D
    q = tl.load(q_ptr + q_off[:, None] + d[None, :], mask=valid_m[:, None], other=0.0)
    num_tiles = tl.cdiv(ctx, TILE)
    per_split = tl.cdiv(num_tiles, num_splits)
    start = split * per_split
    end = tl.minimum(start + per_split, num_tiles)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    n = tl.arange(0, TILE)
    base = kv_ptr + h * stride_kv_head
    for t in range(start, end):
        j = t * TILE + n  # context indices; a tile spans blocks (BS < TILE) or part of one
        # keys past the context read the null block (finite; masked below) and never the table past the row
        blk = tl.load(table_ptr + row * table_width + j // BS, mask=j < ctx, other=0)
        kv_off = blk[:, None] * stride_kv_block + (j % BS)[:, None] * stride_kv_tok + d[None, :]
        k = tl.load(base + kv_off)  # [TILE, D]
        v = tl.load(base + stride_kv_kind + kv_off)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        else:
            s = tl.dot(q.to(k.dtype), tl.trans(k)).to(tl.float32) * scale
        s = tl.where(j[None, :] <= pos[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # rows with nothing visible yet keep -inf: exp(-inf - -inf) would be NaN
        alpha = tl.where(m_new == float("-inf"), 1.0, tl.exp(m_i - m_new))
        p = tl.where(m_new[:, None] == float("-inf"), 0.0, tl.exp(s - m_new[:, None]))
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
        m_i = m_new
    out = ((row * KVH + h) * num_splits + split) * BLOCK_M + m
    tl.store(part_acc + out[:, None] * D + d[None, :], acc)
    tl.store(part_ml + out * 2, m_i)
    tl.store(part_ml + out * 2 + 1, l_i)


@triton.jit(do_not_specialize=["num_splits"])
def _combine(part_acc, part_ml, o_ptr, num_splits, Q: tl.constexpr, G: tl.constexpr, KVH: tl.constexpr,
             D: tl.constexpr, BLOCK_M: tl.constexpr):
    row = tl.program_id(0)
    h = tl.program_id(1)
    m = tl.arange(0, BLOCK_M)
    d = tl.arange(0, D)
    m_all = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for s in range(0, num_splits):
        idx = ((row * KVH + h) * num_splits + s) * BLOCK_M + m
        m_all = tl.maximum(m_all, tl.load(part_ml + idx * 2))
    l_all = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for s in range(0, num_splits):
        idx = ((row * KVH + h) * num_splits + s) * BLOCK_M + m
        ms = tl.load(part_ml + idx * 2)
        w = tl.where(ms == float("-inf"), 0.0, tl.exp(ms - m_all))  # a split with no blocks adds nothing
        l_all += w * tl.load(part_ml + idx * 2 + 1)
        acc += w[:, None] * tl.load(part_acc + idx[:, None] * D + d[None, :])
    qi = m // G
    valid = m < Q * G
    o_off = ((row * Q + qi) * (KVH * G) + h * G + m % G) * D
    res = acc / tl.where(l_all == 0.0, 1.0, l_all)[:, None]
    tl.store(o_ptr + o_off[:, None] + d[None, :], res.to(o_ptr.dtype.element_ty), mask=valid[:, None])


class DecodeWorkspace:
    """The splits' partial results: slices of one buffer that only grows. A grown buffer never frees the old one,
    since a captured graph keeps reading the addresses it was captured with; capture runs the largest
    descriptors first, so in practice it grows during capture only."""

    def __init__(self, device: torch.device):
        self.device = device
        self._acc = torch.empty(0, dtype=torch.float32, device=device)
        self._ml = torch.empty(0, dtype=torch.float32, device=device)
        self._old: list[torch.Tensor] = []

    def get(self, rows: int, kv_heads: int, splits: int, block_m: int, dim: int):
        n = rows * kv_heads * splits * block_m
        if n * dim > self._acc.numel() or 2 * n > self._ml.numel():
            self._old += [self._acc, self._ml]
            self._acc = torch.empty(2 * n * dim, dtype=torch.float32, device=self.device)
            self._ml = torch.empty(4 * n, dtype=torch.float32, device=self.device)
        return self._acc[:n * dim].view(n, dim), self._ml[:2 * n].view(n, 2)


def paged_decode(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, positions: torch.Tensor,
                 scale: float, num_splits: int, workspace: DecodeWorkspace, tile: int = 0, num_warps: int = 4,
                 num_stages: int = 3) -> torch.Tensor:
    """q [rows * qlen, q_heads, dim] -> [rows * qlen, q_heads * dim], as the torch backend's paged_attention.
    `tile`: keys per loop step, a power of two (0: the block size, kept within MIN_TILE..MAX_TILE). `num_warps`,
    `num_stages`: the split kernel's launch (Triton's defaults; the device script times others)."""
    rows, qlen = positions.shape
    _, _, block_size, kv_heads, dim = kv_cache.shape
    q_heads = q.shape[1]
    group = q_heads // kv_heads
    block_m = max(16, triton.next_power_of_2(qlen * group))
    tile = tile or min(max(block_size, MIN_TILE), MAX_TILE)
    acc, ml = workspace.get(rows, kv_heads, num_splits, block_m, dim)
    out = torch.empty(rows * qlen, q_heads * dim, dtype=q.dtype, device=q.device)
    q = q.contiguous()
    table = block_table if block_table.stride(1) == 1 else block_table.contiguous()
    _decode_split[(rows, kv_heads, num_splits)](
        q, kv_cache, table, positions, acc, ml, scale, kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
        kv_cache.stride(3), table.stride(0), num_splits, Q=qlen, G=group, KVH=kv_heads, D=dim, BS=block_size,
        TILE=tile, BLOCK_M=block_m, IEEE=q.dtype == torch.float32, num_warps=num_warps, num_stages=num_stages)
    _combine[(rows, kv_heads)](acc, ml, out, num_splits, Q=qlen, G=group, KVH=kv_heads, D=dim, BLOCK_M=block_m)
    return out
