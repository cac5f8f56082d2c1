"""Benchmark prompts: `random` (token ids decoded with the model's tokenizer, as vLLM does) or `jsonl` (a file)."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np


@dataclass(frozen=True)
class SampleRequest:
    prompt: str
    prompt_len: Optional[int]  # None: unknown here (a jsonl prompt without a tokenizer; the server's usage says)
    output_len: int


def _lengths(rng, n: int, mean: int, ratio: float) -> np.ndarray:
    if not 0 <= ratio < 1:
        raise ValueError("--random-range-ratio must be in [0, 1)")
    # floor and ceil, as vLLM: truncating both ends drew a mean below the one asked for (9.5 for 10 at 0.25)
    lo, hi = max(1, math.floor(mean * (1 - ratio))), max(1, math.ceil(mean * (1 + ratio)))
    return rng.integers(lo, hi + 1, size=n)


def _vocab(tokenizer) -> np.ndarray:
    special = set(tokenizer.all_special_ids)
    return np.array([i for i in range(len(tokenizer)) if i not in special])


def _fit(tokenizer, ids: list[int], target: int) -> tuple[str, list[int]]:
    """Decoding then re-encoding can merge tokens, so the text is re-encoded, cut to its target length and decoded
    again; the ids returned are that final text's encoding."""
    ids = tokenizer.encode(tokenizer.decode(ids), add_special_tokens=False)[:target]
    text = tokenizer.decode(ids)
    return text, tokenizer.encode(text, add_special_tokens=False)


def random_prefix(tokenizer, prefix_len: int, seed: int = 0) -> list[int]:
    """The token ids every prompt of a run starts with (--random-prefix-len), so a prefix cache has something to
    hit. Its own stream of the seed: the measured and warm-up prompts share it, and a prefix of 0 leaves the
    prompts as they were."""
    if prefix_len < 0:
        raise ValueError("--random-prefix-len must be >= 0")
    if prefix_len == 0:
        return []
    vocab = _vocab(tokenizer)
    return _fit(tokenizer, vocab[np.random.default_rng((seed, 1)).integers(0, len(vocab), size=prefix_len)].tolist(),
                prefix_len)[1]


def random_dataset(tokenizer, num_prompts: int, input_len: int, output_len: int, range_ratio: float = 0.0,
                   seed: int = 0, prefix: list[int] = ()) -> list[SampleRequest]:
    """Prompts of `prefix` (the same ids in every prompt) then ~input_len tokens drawn uniformly from the vocabulary
    (special tokens excluded), each a distinct sequence: as vLLM's, the prefix adds to input_len. prompt_len is the
    length of the final text's encoding."""
    if input_len < 1 or output_len < 1:
        raise ValueError("--random-input-len and --random-output-len must be >= 1")
    rng = np.random.default_rng(seed)
    in_lens, out_lens = _lengths(rng, num_prompts, input_len, range_ratio), _lengths(rng, num_prompts, output_len,
                                                                                       range_ratio)
    vocab, prefix = _vocab(tokenizer), list(prefix)
    samples = []
    for i in range(num_prompts):
        ids = prefix + vocab[rng.integers(0, len(vocab), size=int(in_lens[i]))].tolist()
        text, ids = _fit(tokenizer, ids, len(prefix) + int(in_lens[i]))
        samples.append(SampleRequest(text, len(ids), int(out_lens[i])))
    return samples


def jsonl_dataset(path: str, num_prompts: int, output_len: int, tokenizer=None) -> list[SampleRequest]:
    """One JSON object per line with a `prompt` (or `text`) string and optionally `output_len`; cycled up to
    num_prompts. Without a tokenizer prompt_len is None: the server's usage gives it, else the totals say n/a."""
    rows = []
    with Path(path).open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                prompt = obj["prompt"] if "prompt" in obj else obj["text"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"--dataset-path {path}:{lineno}: expected a JSON object with 'prompt' ({e})")
            if not isinstance(prompt, str):
                raise ValueError(f"--dataset-path {path}:{lineno}: 'prompt' must be a string")
            n = len(tokenizer.encode(prompt, add_special_tokens=False)) if tokenizer is not None else None
            rows.append(SampleRequest(prompt, n, int(obj.get("output_len", output_len))))
    if not rows:
        raise ValueError(f"--dataset-path {path}: no prompts")
    return [rows[i % len(rows)] for i in range(num_prompts)]
