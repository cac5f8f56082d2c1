"""Benchmark prompts: `random` (token ids decoded with the model's tokenizer, as vLLM does) or `jsonl` (a file)."""
from __future__ import annotations

import functools
import json
import math
import warnings
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


# rounds of re-encoding: on the tiny tokenizer 1 or 2, at most 16 over 27k prompts (a prefix whose last token
# merges with most first tokens, redrawn each round); vLLM gives up after 10
_TRIES = 50


@functools.lru_cache(maxsize=4)  # a 150k vocabulary takes a second or so to decode; a run asks three times
def _vocab(tokenizer) -> np.ndarray:
    """The ids a random prompt is drawn from: not special, and text on their own. A lone byte of a multi-byte
    character decodes to U+FFFD, which re-encodes as three bytes, so a prompt that ended in one never fit its
    length (cut back to it, it decoded to U+FFFD again)."""
    special = set(tokenizer.all_special_ids)
    texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
    return np.array([i for i, t in enumerate(texts) if i not in special and t and "\ufffd" not in t])


def _fit(tokenizer, ids: list[int], target: int, draw, keep: list[int] = ()) -> tuple[str, list[int]]:
    """A text whose encoding is `target` ids, made from `ids`. Decoding then re-encoding random ids can merge or
    split them, so, as vLLM, re-encode, cut what is over or draw (`draw(k)`: k more ids) what is short, and again
    until the count holds. `keep`, the shared prefix, must stay the encoding's first ids: a merge across its end
    redraws what follows it. The ids returned are the text's encoding (on target unless every round missed)."""
    keep, n = list(keep), len(keep)
    for _ in range(_TRIES):
        text = tokenizer.decode(ids)
        enc = tokenizer.encode(text, add_special_tokens=False)
        if len(enc) == target and enc[:n] == keep:
            break
        ids = (keep + draw(target - n) if enc[:n] != keep else enc[:target] if len(enc) > target
               else enc + draw(target - len(enc)))
    else:  # never seen on the tokenizers tried; prompt_len still says what the prompt is
        warnings.warn(f"a random prompt encodes to {len(enc)} tokens after {_TRIES} rounds, not {target}"
                      + ("" if enc[:n] == keep else ", and does not start with the shared prefix"), stacklevel=2)
    return text, enc


def _drawer(rng, vocab: np.ndarray):
    return lambda k: vocab[rng.integers(0, len(vocab), size=k)].tolist()


def random_prefix(tokenizer, prefix_len: int, seed: int = 0) -> list[int]:
    """The token ids every prompt of a run starts with (--random-prefix-len), so a prefix cache has something to
    hit. Its own stream of the seed, so the measured and warm-up prompts share it."""
    if prefix_len < 0:
        raise ValueError("--random-prefix-len must be >= 0")
    if prefix_len == 0:
        return []
    draw = _drawer(np.random.default_rng((seed, 1)), _vocab(tokenizer))
    return _fit(tokenizer, draw(prefix_len), prefix_len, draw)[1]


def random_dataset(tokenizer, num_prompts: int, input_len: int, output_len: int, range_ratio: float = 0.0,
                   seed: int = 0, prefix: list[int] = ()) -> list[SampleRequest]:
    """Prompts of `prefix` (the same ids in every prompt) then ~input_len tokens drawn uniformly from the vocabulary
    (special tokens excluded), each a distinct sequence: as vLLM's, the prefix adds to input_len, and the tokens a
    completions server adds itself (a BOS) count in input_len. Each prompt encodes to exactly its drawn length;
    prompt_len is that, the server's count."""
    if input_len < 1 or output_len < 1:
        raise ValueError("--random-input-len and --random-output-len must be >= 1")
    added = tokenizer.num_special_tokens_to_add()  # as vLLM: a BOS is a prompt token, so fewer are drawn
    rng = np.random.default_rng(seed)
    in_lens, out_lens = (_lengths(rng, num_prompts, max(1, input_len - added), range_ratio),
                         _lengths(rng, num_prompts, output_len, range_ratio))
    draw, prefix = _drawer(rng, _vocab(tokenizer)), list(prefix)
    samples = []
    for i in range(num_prompts):
        text, ids = _fit(tokenizer, prefix + draw(int(in_lens[i])), len(prefix) + int(in_lens[i]), draw, prefix)
        samples.append(SampleRequest(text, len(ids) + added, int(out_lens[i])))
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
            n = len(tokenizer.encode(prompt)) if tokenizer is not None else None  # a BOS too, as the server
            rows.append(SampleRequest(prompt, n, int(obj.get("output_len", output_len))))
    if not rows:
        raise ValueError(f"--dataset-path {path}: no prompts")
    return [rows[i % len(rows)] for i in range(num_prompts)]
