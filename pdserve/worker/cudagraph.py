"""FULL decode steps: one callable per BatchDescriptor whose only per-step inputs are the static input buffers.

On CUDA each callable is captured once at start-up into a `torch.cuda.CUDAGraph` (largest first, one shared memory
pool) and replayed per step. On CPU nothing can be captured: the same callable runs eagerly on the same buffers.
Which block-table widths its attention reads is the attention backend's layout (`full_layout`): the whole table
where the backend reads each row's own length on the device, width groups where it gathers up to the width. Each
(descriptor, layout) callable has fixed shapes.
"""
from __future__ import annotations

import logging
from typing import Callable

import torch

from pdserve.attention.metadata import AttentionMetadata
from pdserve.worker.cudagraph_dispatch import BatchDescriptor
from pdserve.worker.graph_capture import capture_each
from pdserve.worker.input_batch import InputBuffers

logger = logging.getLogger("pdserve.cudagraph")


class FullGraphRunner:
    def __init__(self, model, buffers: InputBuffers, hidden_size: int, dtype: torch.dtype, device: torch.device):
        self.model = model
        self.buffers = buffers
        self.device = device
        self.out = torch.zeros(buffers.np_input_ids.shape[0], hidden_size, dtype=dtype, device=device)
        self._steps: dict[tuple[BatchDescriptor, int], Callable[[], torch.Tensor]] = {}
        self.graphs: dict[BatchDescriptor, "torch.cuda.CUDAGraph"] = {}
        self.pool = None

    def layout_for(self, desc: BatchDescriptor, row_blocks: list[int]) -> tuple:
        """Attention groups ((first row, end row, width), ...) over the descriptor's padded rows, `row_blocks` being
        the real rows' context widths in layout order (ascending)."""
        return self.model.attn_backend.full_layout(desc.num_reqs, row_blocks, self.buffers.max_blocks)

    def step_callable(self, desc: BatchDescriptor, layout: tuple) -> Callable[[], torch.Tensor]:
        key = (desc, layout)
        if key not in self._steps:
            b, t = self.buffers, desc.num_tokens
            meta = AttentionMetadata(b.slot_mapping[:t], b.uniform_groups(layout, desc.uniform_query_len))
            input_ids, positions, out = b.input_ids[:t], b.positions[:t], self.out[:t]
            model = self.model

            def step() -> torch.Tensor:
                out.copy_(model(input_ids, positions, meta))
                return out

            self._steps[key] = step
        return self._steps[key]

    @torch.inference_mode()
    def run(self, desc: BatchDescriptor, layout: tuple) -> torch.Tensor:
        graph = self.graphs.get(desc)
        if graph is not None:
            graph.replay()
            return self.out[:desc.num_tokens]
        return self.step_callable(desc, layout)()

    @torch.inference_mode()
    def capture(self, descriptors: list[BatchDescriptor], pool, stream, progress: bool = True) -> None:
        """CUDA only: capture every FULL descriptor into `pool`, largest first so smaller graphs reuse its memory."""
        if self.device.type != "cuda" or not descriptors:
            return
        self.pool = pool
        order = sorted(descriptors, key=lambda d: d.num_tokens, reverse=True)

        def one(desc: BatchDescriptor, capture) -> None:
            self.graphs[desc] = capture(self.step_callable(desc, self.layout_for(desc, [])), pool)
        capture_each(order, "FULL decode", "graph", stream, progress, one)
        logger.info("captured %d FULL decode graphs (%d..%d tokens)", len(order), order[-1].num_tokens,
                    order[0].num_tokens)
