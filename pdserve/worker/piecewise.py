"""PIECEWISE steps: the model's non-attention segments as graphs per padded token count, attention eager between.

A model of L layers has L + 1 segments: segment 0 is the embedding and layer 0 up to its attention's inputs;
segment i (1..L-1) is layer i-1 from its attention's output through layer i up to its attention's inputs; segment L
is the last layer's rest and the final norm. Each segment reads and writes static buffers sliced to the step's
padded token count (the residual stream, q, k, v, the attention output), so a segment captured for a size replays
on any step of that size; attention runs eagerly between segments on the same buffers, which is what lets a mixed
batch (prefill chunks beside decodes, any block-table widths) use graphs at all.

On CUDA each (size, segment) is captured once (largest size first) into the pool the FULL graphs use. Only the
static buffers outlive a segment: every temporary dies inside its graph, so graphs of every size share the pool's
memory, which is safe because steps replay one at a time. On CPU nothing is captured and the same segment callables
run eagerly: the path the tests compare with the unsegmented forward.
"""
from __future__ import annotations

import logging
from typing import Callable

import torch

from pdserve.attention.metadata import AttentionMetadata
from pdserve.worker.graph_capture import capture_each
from pdserve.worker.input_batch import InputBuffers

logger = logging.getLogger("pdserve.cudagraph")


class PiecewiseRunner:
    def __init__(self, model, buffers: InputBuffers, dtype: torch.dtype, device: torch.device):
        d = model.dims
        t = buffers.np_input_ids.shape[0]
        self.model = model
        self.buffers = buffers
        self.device = device
        self.x = torch.zeros(t, d.hidden_size, dtype=dtype, device=device)
        self.q = torch.zeros(t, d.num_heads, d.head_dim, dtype=dtype, device=device)
        self.k = torch.zeros(t, d.num_kv_heads, d.head_dim, dtype=dtype, device=device)
        self.v = torch.zeros(t, d.num_kv_heads, d.head_dim, dtype=dtype, device=device)
        self.attn_out = torch.zeros(t, d.num_heads * d.head_dim, dtype=dtype, device=device)
        self._segments: dict[int, list[Callable[[], None]]] = {}
        self.graphs: dict[int, list["torch.cuda.CUDAGraph"]] = {}

    def segments(self, n: int) -> list[Callable[[], None]]:
        """The L + 1 segment callables for a padded token count."""
        if n not in self._segments:
            m, b = self.model, self.buffers
            x, q, k, v, attn_out = self.x[:n], self.q[:n], self.k[:n], self.v[:n], self.attn_out[:n]
            input_ids, positions = b.input_ids[:n], b.positions[:n]
            layers = list(m.layers)

            def emit(h, layer) -> None:
                x.copy_(h)
                for dst, src in zip((q, k, v), layer.pre_attention(h, positions, m.rope)):
                    dst.copy_(src)

            def first() -> None:
                emit(m.embed_tokens(input_ids), layers[0])

            def between(i: int) -> Callable[[], None]:
                return lambda: emit(layers[i - 1].post_attention(x, attn_out), layers[i])

            def last() -> None:
                x.copy_(m.norm(layers[-1].post_attention(x, attn_out)))

            self._segments[n] = [first, *(between(i) for i in range(1, len(layers))), last]
        return self._segments[n]

    @torch.inference_mode()
    def run(self, n: int, meta: AttentionMetadata) -> torch.Tensor:
        """Final hidden states [n, hidden] of a step filled into the buffers with `n` padded tokens."""
        m, d = self.model, self.model.dims
        graphs = self.graphs.get(n)
        steps = [g.replay for g in graphs] if graphs is not None else self.segments(n)
        attn = m.attn_backend
        state = attn.prepare(meta, m.kv_caches[0].shape[2], d.num_heads // d.num_kv_heads, self.x.dtype)
        q, k, v, attn_out = self.q[:n], self.k[:n], self.v[:n], self.attn_out[:n]
        steps[0]()
        for step, layer, cache in zip(steps[1:], m.layers, m.kv_caches):
            attn_out.copy_(attn.forward(q, k, v, cache, meta, state, layer.scale))
            step()
        return self.x[:n]

    @torch.inference_mode()
    def capture(self, sizes: list[int], pool, stream, progress: bool = True) -> None:
        """CUDA only: capture every segment of every size, largest size first, into `pool`."""
        if self.device.type != "cuda" or not sizes:
            return
        order = sorted(sizes, reverse=True)

        def one(n: int, capture) -> None:
            self.graphs[n] = [capture(seg, pool) for seg in self.segments(n)]
        capture_each(order, "PIECEWISE", "size", stream, progress, one)
        logger.info("captured PIECEWISE graphs for %d sizes (%d..%d tokens), %d segments each", len(order),
                    order[-1], order[0], len(self.model.layers) + 1)
