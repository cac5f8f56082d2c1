"""Persistent, preallocated input buffers and their filling from a step's scheduled rows.

Rows are laid out decode rows first (query length 1), then the longer rows, each row's tokens contiguous. Buffer
addresses never change after construction: a captured FULL graph reads them in place.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pdserve.attention.metadata import AttentionMetadata, AttnGroup, width_groups
from pdserve.sched_output import NULL_BLOCK, cdiv
from pdserve.worker.staging import CudaStaging


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
    layout: tuple | None = None  # FULL steps: the attention groups the buffers were filled for
    num_drafted: int = 0  # rows with drafts: each has all its positions in logits_rows (repeated), in order
    starts: list[int] | None = None  # each laid-out row's first token in the flattened batch


class InputBuffers:
    def __init__(self, max_tokens: int, max_reqs: int, max_blocks_per_req: int, block_size: int,
                 device: torch.device, staging=None):
        self.block_size = block_size
        self.device = device
        self.max_blocks = max_blocks_per_req
        pin = device.type == "cuda"
        # Host -> device copies and their fence (staging.py). Tests pass one on CPU to get separate device tensors.
        self.staging = staging if staging is not None or not pin else CudaStaging()
        # Host staging arrays. On CPU the device tensors are views of them, so filling them is the only copy.
        self.np_input_ids = np.zeros(max_tokens, np.int64)
        self.np_positions = np.zeros(max_tokens, np.int64)
        self.np_slots = np.zeros(max_tokens, np.int64)
        self.np_block_table = np.zeros((max_reqs, max_blocks_per_req), np.int64)
        self.np_logits_idx = np.zeros(max(max_reqs, max_tokens), np.int64)  # drafting rows score every position
        names = ("input_ids", "positions", "slot_mapping", "block_table", "logits_idx")
        arrays = (self.np_input_ids, self.np_positions, self.np_slots, self.np_block_table, self.np_logits_idx)
        self.host = {n: torch.from_numpy(a) for n, a in zip(names, arrays)}
        if pin:
            self.host = {n: t.pin_memory() for n, t in self.host.items()}
            self.np_input_ids, self.np_positions, self.np_slots, self.np_block_table, self.np_logits_idx = (
                self.host[n].numpy() for n in names)
        if self.staging is not None:
            self.dev = {n: torch.zeros_like(t, device=device) for n, t in self.host.items()}
        else:
            self.dev = self.host
        self.input_ids, self.positions, self.slot_mapping, self.block_table, self.logits_idx = (
            self.dev[n] for n in names)

    def prepare(self, rows, blocks_of, num_tokens_padded: int | None = None, num_reqs_padded: int | None = None,
                layout_fn=None) -> PreparedBatch:
        """Fill the buffers for `rows` (ScheduledRow). Padded tokens and rows point at the null block, so they
        write and read only it. `layout_fn` (FULL steps) maps the rows' context widths, in layout order, to the
        attention groups ((first row, end row, width), ...) over the padded rows; otherwise rows are grouped by query
        length and context width, and padded tokens belong to no group."""
        bs = self.block_size
        if self.staging is not None:
            self.staging.wait()  # the last step's copies read these host arrays until they ran
        # Decode rows first; rows of one query length by context width, so width groups are contiguous.
        order = sorted(range(len(rows)), key=lambda i: (rows[i].num_scheduled_tokens != 1, rows[i].num_scheduled_tokens,
                                                        rows[i].num_computed_tokens))
        ids, pos, slots, table = self.np_input_ids, self.np_positions, self.np_slots, self.np_block_table
        t = 0
        starts, widths, logits_rows, logits_idx = [], [], [], []
        num_drafted = 0
        for r, i in enumerate(order):
            row = rows[i]
            c, n = row.num_computed_tokens, row.num_scheduled_tokens
            blocks = blocks_of(row.request.request_id)
            nb = cdiv(c + n, bs)
            table[r, :nb] = blocks[:nb]
            drafts = row.draft_token_ids
            if n == 1:
                ids[t] = row.request.all_token_ids[c]
                pos[t] = c
                slots[t] = blocks[c // bs] * bs + c % bs
            else:
                if drafts:
                    ids[t] = row.request.all_token_ids[c]
                    # a placeholder's input is any valid id: its KV and logits are never used as a draft's
                    ids[t + 1:t + n] = [max(d, 0) for d in drafts]
                else:
                    ids[t:t + n] = row.request.all_token_ids[c:c + n]
                p = np.arange(c, c + n)
                pos[t:t + n] = p
                slots[t:t + n] = np.asarray(blocks, np.int64)[p // bs] * bs + p % bs
            starts.append(t)
            widths.append(nb)
            t += n
            if drafts:  # every position of a drafting row is scored: the last known token's and each draft's
                logits_rows.extend([r] * n)
                logits_idx.extend(range(t - n, t))
                num_drafted += 1
            elif row.samples:
                logits_rows.append(r)
                logits_idx.append(t - 1)
        num_reqs = len(rows)
        tp = num_tokens_padded or t
        rp = num_reqs_padded or num_reqs
        ids[t:tp] = 0
        pos[t:tp] = 0
        slots[t:tp] = NULL_BLOCK * bs
        layout = layout_fn(widths) if layout_fn else None
        width = max(w for _, _, w in layout) if layout else max(widths, default=1)
        table[:num_reqs, :width][np.arange(width)[None, :] >= np.asarray(widths)[:, None]] = NULL_BLOCK
        table[num_reqs:rp, :width] = NULL_BLOCK
        self.np_logits_idx[:len(logits_idx)] = logits_idx
        self._to_device(tp, rp, len(logits_idx))
        if layout:
            groups = self.uniform_groups(layout, tp // rp)
        else:
            groups = self._groups(rows, order, starts, widths, t)
        meta = AttentionMetadata(self.slot_mapping[:tp], groups)
        return PreparedBatch(order, t, tp, num_reqs, rp, meta, logits_rows, self.logits_idx[:len(logits_idx)], layout,
                             num_drafted, starts)

    def uniform_groups(self, layout, qlen: int) -> list[AttnGroup]:
        return [AttnGroup(slice(r0 * qlen, r1 * qlen), self.block_table[r0:r1, :w],
                          self.positions[r0 * qlen:r1 * qlen].view(r1 - r0, qlen)) for r0, r1, w in layout]

    def _groups(self, rows, order, starts, widths, num_tokens) -> list[AttnGroup]:
        """Rows of one query length are contiguous in the layout (decode rows, drafting rows at 1 + K, equal
        prompt chunks): each such run attends in width groups, batched; a row alone in its length attends alone.
        One attention call per row and layer for a step of many drafting rows and one prefill chunk cost more
        than the step's GEMMs."""
        qlens = [rows[i].num_scheduled_tokens for i in order]
        if len(set(qlens)) == 1:
            return self.uniform_groups(width_groups(widths), qlens[0])
        groups, a = [], 0
        while a < len(order):
            q, b = qlens[a], a + 1
            while b < len(order) and qlens[b] == q:
                b += 1
            for r0, r1, w in width_groups(widths[a:b]) if b - a > 1 else ((0, 1, widths[a]),):
                t0 = starts[a + r0]
                t1 = t0 + (r1 - r0) * q
                groups.append(AttnGroup(slice(t0, t1), self.block_table[a + r0:a + r1, :w],
                                        self.positions[t0:t1].view(r1 - r0, q)))
            a = b
        return groups

    def _to_device(self, num_tokens: int, num_reqs: int, num_logits: int) -> None:
        if self.staging is None:
            return
        for name, n in (("input_ids", num_tokens), ("positions", num_tokens), ("slot_mapping", num_tokens),
                        ("block_table", num_reqs), ("logits_idx", num_logits)):
            self.staging.copy(self.dev[name][:n], self.host[name][:n])
        self.staging.record()
