"""Persistent, preallocated input buffers and their filling from a step's scheduled rows.

Rows are laid out decode rows first (query length 1), then the longer rows, each row's tokens contiguous. Buffer
addresses never change after construction: a captured FULL graph reads them in place.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pdserve.core.block_pool import NULL_BLOCK
from pdserve.core.kv_cache_manager import cdiv
from pdserve.worker.attention import AttentionMetadata, AttnGroup


@dataclass
class PreparedBatch:
    order: list[int]  # scheduler row index of each laid-out row
    num_tokens: int  # real tokens
    num_tokens_padded: int
    num_reqs: int
    num_reqs_padded: int
    meta: AttentionMetadata
    logits_rows: list[int]  # laid-out rows that sample, in layout order
    logits_indices: torch.Tensor  # their last-token index in the flattened batch


class InputBuffers:
    def __init__(self, max_tokens: int, max_reqs: int, max_blocks_per_req: int, block_size: int,
                 device: torch.device):
        self.block_size = block_size
        self.device = device
        self.max_blocks = max_blocks_per_req
        pin = device.type == "cuda"
        # Host staging arrays. On CPU the device tensors are views of them, so filling them is the only copy.
        self.np_input_ids = np.zeros(max_tokens, np.int64)
        self.np_positions = np.zeros(max_tokens, np.int64)
        self.np_slots = np.zeros(max_tokens, np.int64)
        self.np_block_table = np.zeros((max_reqs, max_blocks_per_req), np.int64)
        self.np_logits_idx = np.zeros(max_reqs, np.int64)
        names = ("input_ids", "positions", "slot_mapping", "block_table", "logits_idx")
        arrays = (self.np_input_ids, self.np_positions, self.np_slots, self.np_block_table, self.np_logits_idx)
        self.host = {n: torch.from_numpy(a) for n, a in zip(names, arrays)}
        if pin:
            self.host = {n: t.pin_memory() for n, t in self.host.items()}
            self.np_input_ids, self.np_positions, self.np_slots, self.np_block_table, self.np_logits_idx = (
                self.host[n].numpy() for n in names)
            self.dev = {n: torch.zeros_like(t, device=device) for n, t in self.host.items()}
        else:
            self.dev = self.host
        self.input_ids, self.positions, self.slot_mapping, self.block_table, self.logits_idx = (
            self.dev[n] for n in names)

    def prepare(self, rows, blocks_of, num_tokens_padded: int | None = None, num_reqs_padded: int | None = None,
                full_width: int | None = None) -> PreparedBatch:
        """Fill the buffers for `rows` (ScheduledRow). Padded tokens and rows point at the null block, so they
        write and read only it. `full_width` (FULL steps) makes one uniform group over the padded rows that attends
        through that many block-table columns; otherwise each group attends through its widest row's blocks and
        padded tokens belong to no group."""
        bs = self.block_size
        order = sorted(range(len(rows)), key=lambda i: rows[i].num_scheduled_tokens != 1)
        ids, pos, slots, table = self.np_input_ids, self.np_positions, self.np_slots, self.np_block_table
        t = 0
        starts, widths, logits_rows, logits_idx = [], [], [], []
        for r, i in enumerate(order):
            row = rows[i]
            c, n = row.num_computed_tokens, row.num_scheduled_tokens
            blocks = blocks_of(row.request.request_id)
            nb = cdiv(c + n, bs)
            table[r, :nb] = blocks[:nb]
            if n == 1:
                ids[t] = row.request.all_token_ids[c]
                pos[t] = c
                slots[t] = blocks[c // bs] * bs + c % bs
            else:
                ids[t:t + n] = row.request.all_token_ids[c:c + n]
                p = np.arange(c, c + n)
                pos[t:t + n] = p
                slots[t:t + n] = np.asarray(blocks, np.int64)[p // bs] * bs + p % bs
            starts.append(t)
            widths.append(nb)
            t += n
            if row.samples:
                logits_rows.append(r)
                logits_idx.append(t - 1)
        num_reqs = len(rows)
        tp = num_tokens_padded or t
        rp = num_reqs_padded or num_reqs
        ids[t:tp] = 0
        pos[t:tp] = 0
        slots[t:tp] = NULL_BLOCK * bs
        width = full_width or max(widths, default=1)
        table[:num_reqs, :width][np.arange(width)[None, :] >= np.asarray(widths)[:, None]] = NULL_BLOCK
        table[num_reqs:rp, :width] = NULL_BLOCK
        self.np_logits_idx[:len(logits_idx)] = logits_idx
        self._to_device(tp, rp, len(logits_idx))
        if full_width:
            qlen = tp // rp
            groups = [AttnGroup(slice(0, tp), self.block_table[:rp, :width], self.positions[:tp].view(rp, qlen))]
        else:
            groups = self._groups(rows, order, starts, widths, t)
        meta = AttentionMetadata(self.slot_mapping[:tp], groups)
        return PreparedBatch(order, t, tp, num_reqs, rp, meta, logits_rows, self.logits_idx[:len(logits_idx)])

    def _groups(self, rows, order, starts, widths, num_tokens) -> list[AttnGroup]:
        qlens = [rows[i].num_scheduled_tokens for i in order]
        if len(set(qlens)) == 1:  # uniform batch: one group
            n = len(order)
            return [AttnGroup(slice(0, num_tokens), self.block_table[:n, :max(widths)],
                              self.positions[:num_tokens].view(n, qlens[0]))]
        n_dec = qlens.count(1)
        groups = []
        if n_dec:
            w = max(widths[:n_dec])
            groups.append(AttnGroup(slice(0, n_dec), self.block_table[:n_dec, :w],
                                    self.positions[:n_dec].view(n_dec, 1)))
        for r in range(n_dec, len(order)):
            s, n = starts[r], qlens[r]
            groups.append(AttnGroup(slice(s, s + n), self.block_table[r:r + 1, :widths[r]],
                                    self.positions[s:s + n].view(1, n)))
        return groups

    def _to_device(self, num_tokens: int, num_reqs: int, num_logits: int) -> None:
        if self.dev is self.host:
            return
        for name, n in (("input_ids", num_tokens), ("positions", num_tokens), ("slot_mapping", num_tokens),
                        ("block_table", num_reqs), ("logits_idx", num_logits)):
            self.dev[name][:n].copy_(self.host[name][:n], non_blocking=True)
