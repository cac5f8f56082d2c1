"""What a backend's attention reads per step: the KV write slots and groups of rows with one query length each.

A group's rows are contiguous in the flattened token dimension; it attends through its block table `[rows, width]`
and its positions `[rows, query_len]` (a key at context index j is visible to a query at position p iff j <= p).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import torch


@dataclass
class AttnGroup:
    tokens: Union[slice, torch.Tensor]  # this group's rows in the flattened token dimension, row-major
    block_table: torch.Tensor  # [rows, width] int64
    positions: torch.Tensor  # [rows, query_len] int64


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64; where each token's K/V is written
    groups: list[AttnGroup]


def width_groups(widths: list[int], num_rows: int | None = None, max_groups: int = 4, round_to: int = 1,
                 max_width: int | None = None) -> tuple[tuple[int, int, int], ...]:
    """Split rows sorted by context width into up to `max_groups` contiguous groups of near-equal size, each
    attending through its own widest row (rounded up to `round_to` blocks, never past `max_width`, the table's
    width). The K/V gather is most of a CPU decode step, and one width for all rows makes every short row pay for
    the longest. Adjacent groups of one width are one group. Rows past len(widths) (padding) join the last group."""
    n = len(widths)
    k = max(1, min(max_groups, n))
    bounds = [round(i * n / k) for i in range(k + 1)]
    out = []
    for i in range(k):
        r0, r1 = bounds[i], bounds[i + 1]
        if r1 > r0:
            w = max(widths[r0:r1])
            w = -(-w // round_to) * round_to
            w = w if max_width is None else min(w, max_width)
            if out and out[-1][2] == w:  # as wide as the group before: one group (one gather, one attention call)
                out[-1][1] = r1
            else:
                out.append([r0, r1, w])
    out[-1][1] = num_rows or n
    return tuple(tuple(g) for g in out)
