"""Engine configuration: frozen dataclasses whose fields are also the CLI flags.

Each field's `metadata["help"]` is its `--flag` help text, so the CLI never keeps a second, hand-written list.
"""
from __future__ import annotations

import argparse
import dataclasses
import re
import typing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Optional

from pdserve.kv_transfer_config import KVTransferConfig

if TYPE_CHECKING:
    from pdserve.spec_decode.config import SpeculativeConfig

DType = Literal["auto", "float32", "float64", "bfloat16", "float16"]
AttentionBackendName = Literal["auto", "torch", "triton"]


def _f(default, help: str, **kw):
    return field(default=default, metadata={"help": help, **kw})


@dataclass(frozen=True)
class ModelConfig:
    model: str = _f("", "Path to a local Hugging Face model directory (Qwen3ForCausalLM or LlamaForCausalLM).",
                    cli=False)
    dtype: DType = _f("auto", "Weight and activation dtype; 'auto' takes the checkpoint's (float32 on CPU for "
                               "half-precision checkpoints). float64 exists for exactness tests.")
    max_model_len: Optional[int] = _f(None, "Context length (prompt + output); default: the model's "
                                            "max_position_embeddings, capped at 4096.")
    seed: int = _f(0, "Seed for the engine's global sampling generator (requests with their own seed ignore it).")
    device: str = _f("auto", "Device: 'auto' (cuda if available, else cpu), 'cpu' or 'cuda[:N]'.")
    attention_backend: AttentionBackendName = _f("auto", "Attention kernels: torch (SDPA over gathered K/V), triton "
                                                 "(paged decode kernel reading each row's length; prefill through "
                                                 "SDPA), auto (triton on CUDA when installed, else torch).")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = _f(16, "Tokens per KV cache block.")
    enable_prefix_caching: bool = _f(True, "Reuse KV blocks of identical prompt prefixes (chained block hashes).")
    kv_cache_memory_gb: float = _f(1.0, "Memory for the KV cache in GiB (capped at what max_num_seqs full-length "
                                        "sequences need).")
    num_gpu_blocks_override: Optional[int] = _f(None, "Use exactly this many KV blocks (tests, benchmarks); "
                                                         "unset: sized from memory.")
    gpu_memory_utilization: Optional[float] = _f(None, "CUDA: the fraction of the GPU's memory this engine may use; "
                                                 "the KV cache gets what is left after the weights, a largest-step "
                                                 "forward's activations and the CUDA graphs' pool are measured "
                                                 "(kv_cache_memory_gb is then ignored). Unset: kv_cache_memory_gb.")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = _f(128, "Most requests in one step's batch.")
    max_num_batched_tokens: int = _f(2048, "Most tokens (prefill + decode) in one step.")
    enable_chunked_prefill: bool = _f(True, "Split long prompts over several steps to fit the token budget.")
    long_prefill_token_threshold: int = _f(0, "Most tokens of one request's prefill chunk in one step (0: only the "
                                              "token budget caps it); smaller chunks keep the steps that decoding "
                                              "requests wait on short, at the cost of the prompts' TTFT.")
    async_scheduling: Optional[bool] = _f(None, "Overlap the host work of a step (scheduling the next step, "
                                          "filling its inputs, detokenizing the last step's tokens, building "
                                          "outputs) with the model's forward on a worker thread; the tokens are "
                                          "the same as without. Default: auto, on with CUDA, off on CPU (there the "
                                          "forward is Python op dispatch holding the GIL the host work needs, and "
                                          "a 2-core machine measured steps 0.1-2.2 ms slower with it: "
                                          "benchmarks/results/step_overhead_async.json) except in a server while "
                                          "other processes use half the cores or more (the CPU thread governor's "
                                          "reading), where the overlap kept the steps' pace: "
                                          "docs/cpu-notes.md. Off with --speculative-config (the next drafts need "
                                          "the landed tokens).")

    def use_async_scheduling(self, device_type: str) -> bool:
        """`async_scheduling` resolved for an engine on `device_type` (unset: auto, on for CUDA only)."""
        return device_type == "cuda" if self.async_scheduling is None else self.async_scheduling


CUDAGraphModeName = Literal["NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"]
FullGraphRule = Literal["strict", "prompt-tail", "decode-shaped"]


@dataclass(frozen=True)
class CompilationConfig:
    cudagraph_mode: CUDAGraphModeName = _f("FULL_AND_PIECEWISE", "Graph policy: FULL decode graphs for eligible "
                                           "batches and/or PIECEWISE (non-attention segments) for the rest.")
    cudagraph_capture_sizes: Optional[str] = _f(None, "Comma-separated token counts to capture (default: 1, 2, 4, "
                                                      "multiples of 8 below 256, then multiples of 16).")
    max_cudagraph_capture_size: Optional[int] = _f(None, "Largest capture size (default: min(2 x max_num_seqs, 512)).")
    enforce_eager: bool = _f(False, "Never use graphs (wins over --cudagraph-mode).")
    full_graph_rule: FullGraphRule = _f("decode-shaped", "Which rows may ride a FULL decode graph: strict (no "
                                        "prefill row, vLLM MRv2 before the fix), prompt-tail (the fix: a one-token "
                                        "prompt tail over prior context on a P/D consumer), decode-shaped (every "
                                        "row q tokens over prior context, any role).")
    cudagraph_metrics: bool = _f(False, "Log a table of graph-mode step counts with the reason for every non-FULL "
                                        "step.")
    cudagraph_metrics_interval: float = _f(10.0, "Seconds between --cudagraph-metrics tables.")

    def capture_sizes(self, max_num_seqs: int) -> list[int]:
        if self.cudagraph_capture_sizes:
            try:
                sizes = sorted({int(x) for x in self.cudagraph_capture_sizes.split(",") if x.strip()})
            except ValueError:
                raise ValueError(f"cudagraph_capture_sizes must be comma-separated integers, "
                                 f"got {self.cudagraph_capture_sizes!r}") from None
            if not sizes or sizes[0] < 1:
                raise ValueError("cudagraph_capture_sizes must be positive integers")
            return sizes
        top = self.max_cudagraph_capture_size or min(2 * max_num_seqs, 512)
        ladder = [1, 2, 4] + list(range(8, 256, 8)) + list(range(256, top + 1, 16))
        return [s for s in ladder if s <= top] or [1]


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    compilation: CompilationConfig = CompilationConfig()
    kv_transfer: Optional[KVTransferConfig] = None
    speculative_config: Optional[SpeculativeConfig] = None

    @property
    def num_speculative_tokens(self) -> int:
        return self.speculative_config.num_speculative_tokens if self.speculative_config else 0

    @property
    def is_pd_consumer(self) -> bool:
        return self.kv_transfer is not None and self.kv_transfer.is_pd_consumer

    @classmethod
    def from_kwargs(cls, model: str, **kwargs) -> "EngineConfig":
        """Build from flat vLLM-style engine args (dtype=..., block_size=...); unknown names are an error."""
        parts = {}
        kv = kwargs.pop("kv_transfer_config", None)
        if isinstance(kv, str):
            import json
            try:
                kv = json.loads(kv)
            except json.JSONDecodeError as e:
                raise ValueError(f"kv_transfer_config is not valid JSON: {e}") from None
            if kv is None:  # an explicit `null` is a typo more often than a wish for no connector: leave it out
                raise ValueError("kv_transfer_config must be a JSON object (leave it out for no KV connector)")
        if kv is not None and not isinstance(kv, KVTransferConfig):
            kv = KVTransferConfig.from_dict(kv)
        spec = kwargs.pop("speculative_config", None)
        if spec is not None:
            from pdserve.spec_decode.config import SpeculativeConfig
            spec = SpeculativeConfig.from_json(spec) if isinstance(spec, str) else SpeculativeConfig.from_dict(spec)
        for name, sub in (("model", ModelConfig), ("cache", CacheConfig), ("scheduler", SchedulerConfig),
                          ("compilation", CompilationConfig)):
            names = {f.name for f in dataclasses.fields(sub)}
            parts[name] = sub(**{k: kwargs.pop(k) for k in list(kwargs) if k in names})
        if kwargs:
            raise TypeError(f"unknown engine argument(s): {', '.join(sorted(kwargs))}")
        parts["model"] = dataclasses.replace(parts["model"], model=str(model))
        cfg = cls(**parts, kv_transfer=kv, speculative_config=spec)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        c, s = self.cache, self.scheduler
        if self.model.device.startswith("cuda") and _DEVICE.fullmatch(self.model.device):
            _check_cuda(self.model.device)
        checks = [
            (c.block_size >= 1 and c.block_size & (c.block_size - 1) == 0, "block_size must be a power of two"),
            (s.max_num_seqs >= 1, "max_num_seqs must be >= 1"),
            (s.max_num_batched_tokens >= s.max_num_seqs or s.enable_chunked_prefill,
             "max_num_batched_tokens must be >= max_num_seqs"),
            (s.max_num_batched_tokens >= 1, "max_num_batched_tokens must be >= 1"),
            (s.long_prefill_token_threshold >= 0, "long_prefill_token_threshold must be >= 0"),
            (s.long_prefill_token_threshold == 0 or s.enable_chunked_prefill,
             "long_prefill_token_threshold needs enable_chunked_prefill (a capped prompt is computed in chunks)"),
            (0 < c.kv_cache_memory_gb < float("inf"), "kv_cache_memory_gb must be a positive number of GiB"),
            (-2 ** 63 <= self.model.seed < 2 ** 64, "seed must be in [-2**63, 2**64) (torch's generator seeds)"),
            (_DEVICE.fullmatch(self.model.device) is not None,
             f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {self.model.device!r}"),
            (c.gpu_memory_utilization is None or 0 < c.gpu_memory_utilization <= 1,
             "gpu_memory_utilization must be in (0, 1]"),
            (c.num_gpu_blocks_override is None or c.num_gpu_blocks_override >= 2,
             "num_gpu_blocks_override must be >= 2"),
            (self.model.max_model_len is None or self.model.max_model_len >= 1, "max_model_len must be >= 1"),
            (s.max_num_batched_tokens >= 1 + self.num_speculative_tokens,
             "max_num_batched_tokens must be >= 1 + speculative_config.num_speculative_tokens (a decode row "
             "schedules its last token and all its drafts in one step)"),
            (self.compilation.cudagraph_metrics_interval > 0, "cudagraph_metrics_interval must be > 0"),
            (self.compilation.max_cudagraph_capture_size is None or self.compilation.max_cudagraph_capture_size >= 1,
             "max_cudagraph_capture_size must be >= 1"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ValueError(msg)


ENGINE_SECTIONS = (ModelConfig, CacheConfig, SchedulerConfig, CompilationConfig)
_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")


def _check_cuda(device: str) -> None:
    import torch
    if not torch.cuda.is_available():
        why = "this torch build has no CUDA" if torch.version.cuda is None else \
            "no CUDA device is visible (or the driver is too old)"
        raise ValueError(f"device {device!r}: {why} (use 'cpu' or 'auto')")
    index = int(device.partition(":")[2] or 0)
    if index >= torch.cuda.device_count():
        raise ValueError(f"device {device!r}: only {torch.cuda.device_count()} CUDA device(s) are visible")


def add_dataclass_args(parser: argparse.ArgumentParser, cls) -> None:
    """Add one `--kebab-name` flag per field of `cls` (fields with metadata cli=False are skipped)."""
    hints = typing.get_type_hints(cls)
    group = parser.add_argument_group(cls.__name__)
    for f in dataclasses.fields(cls):
        if not f.metadata.get("cli", True):
            continue
        flag = "--" + f.name.replace("_", "-")
        tp = hints[f.name]
        args = typing.get_args(tp)
        help_text = f.metadata.get("help", "")
        if "default" not in help_text.lower() and "unset" not in help_text.lower():  # a stated default wins
            help_text += f" (default: {f.default})"
        if tp is bool or (tp == Optional[bool] and f.default is None):  # None: --flag / --no-flag not given
            group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=f.default,
                               help=help_text)
        elif typing.get_origin(tp) is Literal:
            group.add_argument(flag, dest=f.name, choices=args, default=f.default, help=help_text)
        else:
            base = next((a for a in args if a is not type(None)), tp) if args else tp
            if typing.get_origin(base) is Literal:
                group.add_argument(flag, dest=f.name, choices=typing.get_args(base), default=f.default,
                                   help=help_text)
            else:
                group.add_argument(flag, dest=f.name, type=base, default=f.default, help=help_text)


def engine_kwargs_from_args(ns: argparse.Namespace) -> dict:
    names = {f.name for cls in ENGINE_SECTIONS for f in dataclasses.fields(cls) if f.metadata.get("cli", True)}
    return {k: v for k, v in vars(ns).items() if k in names}
