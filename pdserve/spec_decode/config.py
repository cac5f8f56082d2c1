"""`--speculative-config`: vLLM's JSON for speculative decoding, of which the n-gram (prompt lookup) method is ours.

The rules are vLLM's `SpeculativeConfig` (vllm/config/speculative.py): the method is "ngram", or implied by
`"model": "ngram"` / `"[ngram]"` (vLLM's older spelling, also normalised when it is the method);
`num_speculative_tokens` is required (an n-gram drafter has no draft config to default it from) and > 0; when
neither lookup bound is given both are 5, when one is given the other copies it, each >= 1, min <= max;
`disable_by_batch_size` is None or > 1. vLLM fields that would change behaviour we do not implement are refused as
"not supported yet" (their vLLM defaults pass); a field vLLM does not have either is unknown. Every error names
the field, so a bad flag fails at start, never mid-serving.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Optional

# Why 8: the verify step scores 1 + K positions per row, so each unit of K costs a row's worth of target compute,
# lookahead KV slots and a [rows, 1 + K, vocab] float32 probability tensor (at Qwen3's 151,936-entry vocabulary and
# 256 rows, K = 8 is already 1.4 GB), and it widens every FULL graph (q x {1, 2, 4, ...} rows). What it buys shrinks
# geometrically: with per-draft acceptance a, the mean tokens per step is (1 - a^(K+1)) / (1 - a), so at a = 0.7
# K = 8 gets 3.20 of the 3.33 an unbounded K could, and prompt lookup rarely drafts long runs that all hold.
MAX_SPECULATIVE_TOKENS = 8

NGRAM_NAMES = ("ngram", "[ngram]")
# Methods vLLM has (any version since V1's) that need a draft model, heads or a suffix tree: not built here yet.
VLLM_METHODS = frozenset({
    "eagle", "eagle3", "medusa", "mlp_speculator", "draft_model", "suffix", "custom_class", "mtp", "deepseek_mtp",
    "ernie_mtp", "qwen3_next_mtp", "mimo_mtp", "glm4_moe_mtp", "longcat_flash_mtp", "ngram_gpu", "dflash", "dspark",
    "extract_hidden_states"})
# vLLM fields for draft models, other verification schemes or features we do not have: accepted at vLLM's default
# only, so a config that asks for one fails at start instead of being silently ignored. disable_logprobs passes at
# False, not V0's default True (which dropped logprobs under speculation): we always return them.
VLLM_FIELD_DEFAULTS: dict[str, Any] = {
    "enforce_eager": None, "draft_tensor_parallel_size": None, "tensor_parallel_size": None, "quantization": None,
    "moe_backend": None, "attention_backend": None, "kv_cache_dtype": None, "max_model_len": None, "revision": None,
    "code_revision": None, "disable_logprobs": False, "disable_mqa_scorer": False,
    "disable_padded_drafter_batch": False, "disable_eagle_block_drop": False, "use_local_argmax_reduction": False,
    "use_heterogeneous_vocab": False, "parallel_drafting": False, "speculative_token_tree": None,
    "num_speculative_tokens_per_batch_size": None, "draft_load_config": None, "rejection_sample_method": "standard",
    "synthetic_acceptance_rates": None, "synthetic_acceptance_length": None, "draft_sample_method": "greedy",
    "posterior_threshold": None, "posterior_alpha": None, "acceptance_method": "rejection_sampler",
    "enable_adaptive_verification": False,
    "suffix_decoding_max_tree_depth": 24, "suffix_decoding_max_cached_requests": 10000,
    "suffix_decoding_max_spec_factor": 1.0, "suffix_decoding_min_token_prob": 0.1, "dspark_draft_topk": None}


def _int(name: str, x: Any) -> int:
    if isinstance(x, bool) or not isinstance(x, int):
        raise ValueError(f"speculative_config.{name} must be an integer, got {x!r}")
    return x


@dataclass(frozen=True)
class SpeculativeConfig:
    num_speculative_tokens: int
    method: str = "ngram"
    prompt_lookup_min: int = 5
    prompt_lookup_max: int = 5
    # vLLM: "Disable speculative decoding for new incoming requests when the number of enqueued requests is larger
    # than this value"; its V0 worker ran a step without speculation when running_queue_size >= this. V1 never
    # implemented it and current vLLM dropped the field; we keep the V0 meaning: a step whose running requests
    # number at least this many schedules no drafts (q = 1).
    disable_by_batch_size: Optional[int] = None

    def __post_init__(self) -> None:
        if self.method != "ngram":
            raise ValueError(f"speculative_config.method must be 'ngram', got {self.method!r}")
        k = _int("num_speculative_tokens", self.num_speculative_tokens)
        if not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config.num_speculative_tokens must be in 1..{MAX_SPECULATIVE_TOKENS}, "
                             f"got {k}")
        for name in ("prompt_lookup_min", "prompt_lookup_max"):
            if _int(name, getattr(self, name)) < 1:
                raise ValueError(f"speculative_config.{name} must be >= 1, got {getattr(self, name)}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config.prompt_lookup_min={self.prompt_lookup_min} must be <= "
                             f"prompt_lookup_max={self.prompt_lookup_max}")
        if self.disable_by_batch_size is not None and _int("disable_by_batch_size", self.disable_by_batch_size) < 2:
            raise ValueError(f"speculative_config.disable_by_batch_size must be > 1 (or null), "
                             f"got {self.disable_by_batch_size}")

    @property
    def num_lookahead_slots(self) -> int:
        """KV slots a decode row needs past its known tokens: one per draft scored (vLLM's name)."""
        return self.num_speculative_tokens

    def speculates(self, num_running: int) -> bool:
        """Whether a step with this many running requests schedules drafts (`disable_by_batch_size`)."""
        return self.disable_by_batch_size is None or num_running < self.disable_by_batch_size

    @classmethod
    def from_dict(cls, d: Any) -> "SpeculativeConfig":
        if isinstance(d, SpeculativeConfig):
            return d
        if not isinstance(d, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {type(d).__name__}")
        d = {k: v for k, v in d.items() if v is not None}  # null is vLLM's "not given" for every optional field
        ours = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(k for k in d if k not in ours and k != "model" and k not in VLLM_FIELD_DEFAULTS)
        if unknown:
            raise ValueError(f"speculative_config: unknown field(s) {', '.join(unknown)}")
        for k in sorted(set(d) & set(VLLM_FIELD_DEFAULTS)):
            if (v := d.pop(k)) != VLLM_FIELD_DEFAULTS[k]:
                raise ValueError(f"speculative_config.{k}={v!r} is not supported yet (n-gram drafting only)")
        model, method = d.pop("model", None), d.get("method")
        if model is not None and model not in NGRAM_NAMES:
            raise ValueError(f"speculative_config.model={model!r}: draft models are not supported yet (only "
                             "'ngram')")
        if method is None:
            if model is None:
                raise ValueError("speculative_config.method is required ('ngram')")
            method = "ngram"
        if method in VLLM_METHODS:
            raise ValueError(f"speculative_config.method={method!r} is not supported yet (only 'ngram')")
        if method not in NGRAM_NAMES:
            raise ValueError(f"speculative_config.method must be 'ngram', got {method!r}")
        d["method"] = "ngram"
        if "num_speculative_tokens" not in d:
            raise ValueError("speculative_config.num_speculative_tokens is required")
        lo, hi = d.get("prompt_lookup_min"), d.get("prompt_lookup_max")
        for name, x in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if x is not None and _int(name, x) < 1:  # the field given, before either bound copies the other
                raise ValueError(f"speculative_config.{name} must be >= 1, got {x}")
        d["prompt_lookup_min"] = lo if lo is not None else hi if hi is not None else 5
        d["prompt_lookup_max"] = hi if hi is not None else d["prompt_lookup_min"]
        return cls(**d)

    @classmethod
    def from_json(cls, s: str) -> "SpeculativeConfig":
        try:
            d = json.loads(s)
        except json.JSONDecodeError as e:
            raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        return cls.from_dict(d)

    @classmethod
    def from_flag(cls, s: str) -> "SpeculativeConfig":
        """`--speculative-config JSON` as the CLIs take it: a refusal names the flag."""
        try:
            return cls.from_json(s)
        except ValueError as e:
            raise ValueError(f"--speculative-config: {e}") from None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
