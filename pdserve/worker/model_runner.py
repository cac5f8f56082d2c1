"""Runs one scheduled step on the model: fills the input buffers, runs the forward pass, samples."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from pdserve.attention import make_backend
from pdserve.config import EngineConfig
from pdserve.model.loader import load_model
from pdserve.model.transformer import CausalLM
from pdserve.model.sampler import Sampler
from pdserve.sched_output import NULL_BLOCK, ModelRunnerOutput, ScheduledRow, cdiv
from pdserve.spec_decode.verifier import SpecDecodeStats, verify
from pdserve.worker.host_memory import keep_freed_host_memory
from pdserve.worker.cudagraph import FullGraphRunner
from pdserve.worker.cudagraph_dispatch import CUDAGraphMode, choose_graph, dispatcher_for
from pdserve.worker.graph_metrics import GraphStats
from pdserve.worker.input_batch import InputBuffers, PreparedBatch
from pdserve.worker.piecewise import PiecewiseRunner
from pdserve.worker.prompt_logprobs import PromptLogprobs


@dataclass
class PreparedStep:
    """A step whose inputs are in the buffers (`ModelRunner.prepare`), ready for `ModelRunner.run`."""
    rows: list
    batch: PreparedBatch
    mode: CUDAGraphMode
    desc: object  # the dispatcher's padded descriptor
    # called by `run` once the forward and the LM head are enqueued (on CPU: done), before sampling
    launched: Optional[Callable[[], None]] = None


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
        if device.type == "cpu":
            keep_freed_host_memory()  # page faults on fresh intermediates were a quarter of a CPU prefill chunk
        self.model = load_model(config.model.model, dtype, device, max_positions=max_model_len)
        if device.type == "cpu":
            self.model.pack_for_cpu()
        d = self.model.dims
        self.model.attn_backend = make_backend(config.model.attention_backend, device, dtype, d.head_dim)
        self.kv_caches = self._new_kv(num_blocks)
        self.model.kv_caches = self.kv_caches
        sched, comp = config.scheduler, config.compilation
        # A drafting step's rows are decode-shaped at q = 1 + K; steps that draft nothing keep q = 1.
        self.uniform_query_len = 1 + config.num_speculative_tokens
        self.is_pd_consumer = config.is_pd_consumer
        self.dispatcher = dispatcher_for(config)
        self.buffers = InputBuffers(max_tokens=max(self.max_num_tokens(), self.dispatcher.max_size),
                                    max_reqs=max(sched.max_num_seqs, self.dispatcher.max_size),
                                    max_blocks_per_req=cdiv(max_model_len, self.block_size),
                                    block_size=self.block_size, device=device)
        self.sampler = Sampler(device, config.model.seed)
        # the most positions one step scores (each row's 1 + K): the start-up profile's sampler pass, and so the
        # most a prompt-logprobs LM-head pass may take at once
        self.max_scored = sched.max_num_seqs * self.uniform_query_len
        self.prompt_logprobs = PromptLogprobs()
        self.spec_stats = SpecDecodeStats()
        self.logits_hook = None  # tests: called as hook(requests, logits) for every sampling step
        self.full_graphs = FullGraphRunner(self.model, self.buffers, d.hidden_size, dtype, device)
        # Segments need the decoder's layer structure; a stand-in model (the fuzzer's) runs PIECEWISE steps whole.
        self._capture_stream = None
        self.piecewise = PiecewiseRunner(self.model, self.buffers, dtype, device) \
            if isinstance(self.model, CausalLM) else None
        self.graph_stats = GraphStats(device.type, captured=False,
                                      log_interval=comp.cudagraph_metrics_interval if comp.cudagraph_metrics else None)
        # CPU, in a server's engine: small steps on one thread (worker/cpu_threads.py SmallSteps)
        self.small_steps = None

    @property
    def num_params(self) -> int:
        """The model's parameters (the small-step rule's weight of a token)."""
        return sum(p.numel() for p in self.model.parameters())

    def capture_graphs(self, progress: bool = True) -> None:
        """CUDA: capture the FULL decode graphs, then the PIECEWISE segments, into one memory pool. CPU: nothing to
        capture (both run the same callables eagerly)."""
        if self.device.type == "cuda":
            pool, stream = torch.cuda.graph_pool_handle(), self.capture_stream()
            self.full_graphs.capture(self.dispatcher.full_descriptors(), pool, stream, progress)
            if self.piecewise is not None:
                self.piecewise.capture([dsc.num_tokens for dsc in self.dispatcher.piecewise_descriptors()], pool,
                                       stream, progress)
            # the warm-ups' temporaries stay cached on the capture stream, where no step can reuse them; the
            # live graphs hold their pool, which this leaves alone (the KV sizing counted both, so this only frees)
            torch.cuda.empty_cache()
            self.graph_stats.captured = self._any_graphs()

    def _any_graphs(self) -> bool:
        return bool(self.full_graphs.graphs or self.piecewise is not None and self.piecewise.graphs)

    def capture_stream(self) -> "torch.cuda.Stream":
        """The one side stream every capture runs on: the caching allocator reuses a freed block only on the stream
        that allocated it, so FULL and PIECEWISE graphs share their pool's memory only on one stream."""
        if self._capture_stream is None:
            self._capture_stream = torch.cuda.Stream()
        return self._capture_stream

    def resize_kv(self, num_blocks: int) -> None:
        """A new KV cache of `num_blocks` (before any graph is captured: graphs bake in its addresses)."""
        assert not self._any_graphs(), "KV cache resized under captured graphs"
        self.kv_caches.clear()  # the model holds this list: it must see the new tensors
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.kv_caches.extend(self._new_kv(num_blocks))

    def _new_kv(self, num_blocks: int) -> list[torch.Tensor]:
        d = self.model.dims
        # Zeroed, so the null block and never-written slots hold finite values (masked keys are still multiplied).
        return [torch.zeros(2, num_blocks, self.block_size, d.num_kv_heads, d.head_dim, dtype=self.dtype,
                            device=self.device) for _ in range(d.num_layers)]

    @torch.inference_mode()
    def profile_run(self) -> None:
        """The largest steps the scheduler can make, every token on the null block (memory.py): the whole token
        budget as the last chunks of max_model_len prompts (the most context a chunk can attend), then max_num_seqs
        decode rows at max_model_len; after each, the sampler over every position a step can score (each row's
        1 + K with speculative decoding) with every filter and the most logprobs on."""
        from pdserve.request import Request
        from pdserve.sampling_params import SamplingParams
        n_max, seqs = self.max_model_len, self.config.scheduler.max_num_seqs
        sp = SamplingParams(max_tokens=1, temperature=1.0, top_k=50, top_p=0.9, min_p=0.01, logprobs=20,
                            repetition_penalty=1.1)
        null = [NULL_BLOCK] * cdiv(n_max, self.block_size)
        budget = min(self.max_num_tokens(), self.buffers.np_input_ids.shape[0])
        lens = [min(n_max, budget - i) for i in range(0, budget, n_max)][:seqs]
        prefill = [ScheduledRow(Request(f"profile{i}", [0] * n_max, sp), n_max - n, n) for i, n in enumerate(lens)]
        decode = [ScheduledRow(Request(f"profile{i}", [0] * n_max, sp), n_max - 1, 1) for i in range(seqs)]
        # the sampler's memory does not grow with the prompt (penalties touch each row's distinct ids): one token
        scored = [Request(f"profile{i}", [0], sp) for i in range(self.max_scored)]
        for rows in (prefill, decode):
            hidden = self.forward(self.buffers.prepare(rows, lambda _: null))
            self.sampler(self.model.compute_logits(hidden[:1].expand(len(scored), -1)), scored)

    @torch.inference_mode()
    def probe_graphs(self) -> list:
        """The largest FULL graph and the largest PIECEWISE size captured into a scratch pool (memory.py);
        returned for the caller to drop."""
        pool, stream = torch.cuda.graph_pool_handle(), self.capture_stream()
        full = sorted(self.dispatcher.full_descriptors(), key=lambda dsc: dsc.num_tokens)[-1:]
        pw = [dsc.num_tokens for dsc in self.dispatcher.piecewise_descriptors()][-1:]
        self.full_graphs.capture(full, pool, stream, progress=False)
        scratch = [self.full_graphs.graphs]
        self.full_graphs.graphs = {}
        if self.piecewise is not None:
            self.piecewise.capture(pw, pool, stream, progress=False)
            scratch.append(self.piecewise.graphs)
            self.piecewise.graphs = {}
        return scratch

    def max_num_tokens(self) -> int:
        return max(self.config.scheduler.max_num_batched_tokens, self.config.scheduler.max_num_seqs)

    @torch.inference_mode()
    def forward(self, batch: PreparedBatch) -> torch.Tensor:
        """Hidden states of the sampling rows' last tokens."""
        return self.forward_all(batch)[batch.logits_indices]

    def forward_all(self, batch: PreparedBatch) -> torch.Tensor:
        b = self.buffers
        n = batch.num_tokens_padded
        return self.model(b.input_ids[:n], b.positions[:n], batch.meta)

    @torch.inference_mode()
    def prefill_kv(self, req, start: int, end: int, blocks_of) -> None:
        """Write real KV for tokens [start, end) of `req` with eager prefill chunks: no sampling, no graph step.
        The D-side arrival driver uses it in place of a transfer from a prefill node."""
        chunk = self.max_num_tokens()
        for c in range(start, end, chunk):
            batch = self.buffers.prepare([ScheduledRow(req, c, min(chunk, end - c))], blocks_of)
            self.forward(batch)

    def choose_graph(self, rows):
        """(runtime mode, padded descriptor, reason, unpadded tokens) for a step's rows."""
        return choose_graph(self.dispatcher, rows, self.uniform_query_len, self.config.compilation.full_graph_rule,
                            self.is_pd_consumer)

    @torch.inference_mode()
    def execute(self, rows, blocks_of) -> ModelRunnerOutput:
        return self.run(self.prepare(rows, blocks_of))

    def prepare(self, rows, blocks_of) -> PreparedStep:
        """The half of a step that reads request and scheduler state (the rows' tokens, positions, prefill_len, the
        block tables): the graph choice and the input buffers. On the engine thread, with no step running (on CPU
        the buffers are the forward's own inputs)."""
        mode, desc, reason, num_tokens = self.choose_graph(rows)
        if mode == CUDAGraphMode.FULL:
            batch = self.buffers.prepare(rows, blocks_of, desc.num_tokens, desc.num_reqs,
                                         layout_fn=lambda widths: self.full_graphs.layout_for(desc, widths))
        else:
            batch = self.buffers.prepare(rows, blocks_of, desc.num_tokens if mode == CUDAGraphMode.PIECEWISE else None)
        # here, on the thread that also flushes the counts (the engine loop), never on the worker thread
        self.graph_stats.record(mode.value, num_tokens, desc.num_tokens, len(rows), reason)
        return PreparedStep(rows, batch, mode, desc)

    @torch.inference_mode()
    def run(self, step: PreparedStep) -> ModelRunnerOutput:
        """The half that may run on a worker thread: forward, LM head, prompt logprobs, sampling. Of the requests it
        reads only what the engine thread leaves alone while it runs (params, prompt and output token ids). Sampled
        tokens are read back, so a step that samples has done its device work when this returns; one that does not
        is ordered before the next on the stream."""
        if self.small_steps is not None and self.small_steps.small(step.desc.num_tokens):
            with self.small_steps.one_thread():
                return self._run(step)
        return self._run(step)

    def _run(self, step: PreparedStep) -> ModelRunnerOutput:
        rows, batch, mode, desc = step.rows, step.batch, step.mode, step.desc
        if mode == CUDAGraphMode.FULL:
            hidden_all = self.full_graphs.run(desc, batch.layout)
        elif mode == CUDAGraphMode.PIECEWISE and self.piecewise is not None:
            hidden_all = self.piecewise.run(desc.num_tokens, batch.meta)
        else:
            hidden_all = self.forward_all(batch)
        hidden = hidden_all[batch.logits_indices]
        prompt_lps = self.prompt_logprobs.add(self.model, hidden_all, rows, batch.starts, batch.order,
                                              self.max_scored) if self.prompt_logprobs.wanted(rows) else {}
        out = self.sample(rows, batch, hidden, step.launched)
        out.prompt_logprobs = prompt_lps
        return out

    def sample(self, rows, batch: PreparedBatch, hidden: torch.Tensor,
               launched: Optional[Callable[[], None]] = None) -> ModelRunnerOutput:
        sampled: list = [None] * len(rows)
        logprobs: list = [None] * len(rows)
        if batch.logits_rows:
            logits = self.model.compute_logits(hidden)
            if launched is not None:
                launched()
            reqs = [rows[batch.order[r]].request for r in batch.logits_rows]
            if self.logits_hook is not None:
                self.logits_hook(reqs, logits)
            if batch.num_drafted:
                self._verify(rows, batch, logits, sampled, logprobs)
                return ModelRunnerOutput(sampled, logprobs)
            tokens, lps = self.sampler(logits, reqs)
            for r, tok, lp in zip(batch.logits_rows, tokens, lps):
                sampled[batch.order[r]] = tok
                logprobs[batch.order[r]] = lp
        return ModelRunnerOutput(sampled, logprobs)

    def _verify(self, rows, batch: PreparedBatch, logits: torch.Tensor, sampled: list, logprobs: list) -> None:
        """A step with drafting rows: each gets its emitted tokens (a list) and per-token logprobs; other sampling
        rows one token from the plain sampler. Drafting rows are grouped by K (a row clipped by max_model_len has
        fewer drafts)."""
        plain, by_k = [], {}
        i = 0
        while i < len(batch.logits_rows):
            r = batch.logits_rows[i]
            row = rows[batch.order[r]]
            k = len(row.draft_token_ids)
            (plain if not k else by_k.setdefault(k, [])).append((i, r))
            i += k + 1
        if plain:
            tokens, lps = self.sampler(logits[[i for i, _ in plain]], [rows[batch.order[r]].request for _, r in plain])
            for (_, r), tok, lp in zip(plain, tokens, lps):
                sampled[batch.order[r]], logprobs[batch.order[r]] = tok, lp
        for k, group in by_k.items():
            idx = [i + j for i, _ in group for j in range(k + 1)]
            grp_rows = [rows[batch.order[r]] for _, r in group]
            emitted, lps = verify(self.sampler, logits[idx], [row.request for row in grp_rows],
                                  [list(row.draft_token_ids) for row in grp_rows], self.spec_stats)
            for (_, r), toks, lp in zip(group, emitted, lps):
                sampled[batch.order[r]], logprobs[batch.order[r]] = toks, lp
