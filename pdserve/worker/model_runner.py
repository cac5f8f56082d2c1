"""Runs one scheduled step on the model: fills the input buffers, runs the forward pass, samples."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from pdserve.config import EngineConfig
from pdserve.core.kv_cache_manager import cdiv
from pdserve.model.loader import load_model
from pdserve.model.sampler import Sampler
from pdserve.worker.input_batch import InputBuffers, PreparedBatch


@dataclass
class StepResult:
    sampled: list[Optional[int]]  # per scheduler row: the new token, or None for a prompt chunk that is not last
    logprobs: list[Optional[dict]]


def kv_bytes_per_block(dims, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * dims.num_layers * block_size * dims.num_kv_heads * dims.head_dim * elem


class ModelRunner:
    def __init__(self, config: EngineConfig, device: torch.device, dtype: torch.dtype, max_model_len: int,
                 num_blocks: int):
        self.config = config
        self.device = device
        self.dtype = dtype
        self.max_model_len = max_model_len
        self.block_size = config.cache.block_size
        self.model = load_model(config.model.model, dtype, device, max_positions=max_model_len)
        if device.type == "cpu":
            self.model.pack_for_cpu()
        d = self.model.dims
        # Zeroed, so the null block and never-written slots hold finite values (masked keys are still multiplied).
        self.kv_caches = [torch.zeros(2, num_blocks, self.block_size, d.num_kv_heads, d.head_dim, dtype=dtype,
                                      device=device) for _ in range(d.num_layers)]
        self.model.kv_caches = self.kv_caches
        sched = config.scheduler
        self.buffers = InputBuffers(max_tokens=self.max_num_tokens(), max_reqs=sched.max_num_seqs,
                                    max_blocks_per_req=cdiv(max_model_len, self.block_size),
                                    block_size=self.block_size, device=device)
        self.sampler = Sampler(device, config.model.seed)
        self.logits_hook = None  # tests: called as hook(requests, logits) for every sampling step

    def max_num_tokens(self) -> int:
        return max(self.config.scheduler.max_num_batched_tokens, self.config.scheduler.max_num_seqs)

    @torch.inference_mode()
    def forward(self, batch: PreparedBatch) -> torch.Tensor:
        """Hidden states of the sampling rows' last tokens."""
        b = self.buffers
        n = batch.num_tokens_padded
        hidden = self.model(b.input_ids[:n], b.positions[:n], batch.meta)
        return hidden[batch.logits_indices]

    @torch.inference_mode()
    def execute(self, rows, blocks_of) -> StepResult:
        batch = self.buffers.prepare(rows, blocks_of)
        hidden = self.forward(batch)
        return self.sample(rows, batch, hidden)

    def sample(self, rows, batch: PreparedBatch, hidden: torch.Tensor) -> StepResult:
        sampled: list[Optional[int]] = [None] * len(rows)
        logprobs: list[Optional[dict]] = [None] * len(rows)
        if batch.logits_rows:
            logits = self.model.compute_logits(hidden)
            reqs = [rows[batch.order[r]].request for r in batch.logits_rows]
            if self.logits_hook is not None:
                self.logits_hook(reqs, logits)
            tokens, lps = self.sampler(logits, reqs)
            for r, tok, lp in zip(batch.logits_rows, tokens, lps):
                sampled[batch.order[r]] = tok
                logprobs[batch.order[r]] = lp
        return StepResult(sampled, logprobs)
