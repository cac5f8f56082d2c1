"""vLLM-compatible sampling parameters (pure Python, no torch)."""
from __future__ import annotations

import enum
import hashlib
import json
import math
from dataclasses import dataclass, field, fields, replace
from typing import Any, Optional, Union

# vLLM treats anything below this as temperature 0 (exact 0 would divide by zero).
_SAMPLING_EPS = 1e-5
_MAX_LOGPROBS = 20
_MAX_LOGIT_BIAS = 100.0  # vLLM clamps each bias to [-100, 100], as OpenAI documents
# Request lists, capped: each is checked for every token (stop strings, stop ids) or step (logit_bias) of the request,
# a cost every request of the node pays, not only the sender (100k stop strings added 20.6 ms a token). vLLM's caps
# on bad_words (VLLM_MAX_NUM_BAD_WORDS, VLLM_MAX_BAD_WORDS_TOTAL_TOKENS); the others are pdserve's.
_MAX_BAD_WORDS, _MAX_BAD_WORD_TOKENS = 128, 1024
# bad_words' characters in all, checked before they are tokenized: 32 a token (the server's --max-prompt-chars
# default ratio), so no list that could pass the token cap is refused, and none makes the tokenizer work long
_MAX_BAD_WORD_CHARS = 32 * _MAX_BAD_WORD_TOKENS
_MAX_STOP, _MAX_STOP_CHARS = 128, 16384  # stop strings, and their characters in all
_MAX_STOP_TOKEN_IDS = 1024
_MAX_LOGIT_BIAS_ENTRIES = 1024  # more: allowed_token_ids says "only these" at one cost
# Keys vLLM copies from a model's generation_config.json into the default params.
_GEN_CFG_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _float(name: str, x: Any) -> float:
    # Python's json reads Infinity: an infinite temperature would sample from NaN
    try:
        finite = not isinstance(x, bool) and isinstance(x, (int, float)) and math.isfinite(x)
    except OverflowError:  # an int past float's range
        finite = False
    if not finite:
        raise ValueError(f"{name} must be a finite number, got {x!r}"[:200])
    return float(x)


def _int(name: str, x: Any, allow_none: bool = False) -> Optional[int]:
    if x is None and allow_none:
        return None
    if not _is_int(x):
        raise ValueError(f"{name} must be an int{' or None' if allow_none else ''}, got {x!r}")
    return x


def _logit_bias(bias: Any) -> Optional[dict[int, float]]:
    """{token id: bias} with int keys (JSON's are strings), each bias clamped to [-100, 100]; empty is None."""
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must be a mapping of token ids to numbers, got {type(bias).__name__}")
    if len(bias) > _MAX_LOGIT_BIAS_ENTRIES:
        raise ValueError(f"logit_bias takes at most {_MAX_LOGIT_BIAS_ENTRIES} tokens, got {len(bias)} (to sample "
                         "from a few tokens only, use allowed_token_ids)")
    out = {}
    for k, v in bias.items():
        try:
            tok = k if _is_int(k) else int(k) if isinstance(k, str) else None
        except ValueError:
            tok = None
        if tok is None or tok < 0:
            raise ValueError(f"logit_bias keys must be non-negative token ids, got {k!r}"[:200])
        out[tok] = min(_MAX_LOGIT_BIAS, max(-_MAX_LOGIT_BIAS, _float(f"logit_bias (token {k})", v)))
    return out or None


class RequestOutputKind(enum.IntEnum):
    """What each RequestOutput of a request carries, as vLLM: everything so far, only what this step added (streams:
    per-step work proportional to the new tokens), or one output when it finishes (offline batches)."""
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1 on input) disables top-k
    min_p: float = 0.0
    seed: Optional[int] = None
    max_tokens: Optional[int] = 16  # None = up to the context limit
    min_tokens: int = 0
    stop: Union[str, list[str], None] = field(default_factory=list)
    stop_token_ids: Optional[list[int]] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: Optional[int] = None  # top-N; 0 = only the sampled token's logprob
    prompt_logprobs: Optional[int] = None  # top-N of each prompt token after the first; 0 = its own logprob only
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Optional[dict[int, float]] = None  # token id -> added to its logit (keys may be int strings)
    allowed_token_ids: Optional[list[int]] = None  # only these may be sampled (vLLM's); None: any
    bad_words: Optional[list[str]] = None  # vLLM's: a word's last token is banned where the output would complete it
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        self.n = _int("n", self.n)
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")

        self.temperature = _float("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        self.top_p = _float("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        self.top_k = 0 if self.top_k is None else _int("top_k", self.top_k)
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disable), 0 (disable) or positive, got {self.top_k}")
        self.top_k = max(self.top_k, 0)
        self.min_p = _float("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        self.seed = _int("seed", self.seed, allow_none=True)
        if self.seed is not None and not -2 ** 63 <= self.seed < 2 ** 63:  # vLLM's bound: torch seeds are 64-bit
            raise ValueError(f"seed must be a 64-bit signed integer, got {self.seed}")

        self.max_tokens = _int("max_tokens", self.max_tokens, allow_none=True)
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1 or None, got {self.max_tokens}")
        self.min_tokens = _int("min_tokens", self.min_tokens)
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be non-negative, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens={self.max_tokens}, got {self.min_tokens}")

        stop = [] if self.stop is None else [self.stop] if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
            raise ValueError(f"stop must be a str or a list of str, got {self.stop!r}")
        if any(s == "" for s in stop):
            raise ValueError("stop must not contain empty strings")
        chars = sum(map(len, stop))
        if len(stop) > _MAX_STOP or chars > _MAX_STOP_CHARS:
            raise ValueError(f"stop takes at most {_MAX_STOP} strings of {_MAX_STOP_CHARS} characters in all, got "
                             f"{len(stop)} of {chars}")
        self.stop = list(stop)
        ids = [] if self.stop_token_ids is None else self.stop_token_ids
        if isinstance(ids, (list, tuple)) and len(ids) > _MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids takes at most {_MAX_STOP_TOKEN_IDS} ids, got {len(ids)}")
        if not isinstance(ids, (list, tuple)) or not all(_is_int(t) and t >= 0 for t in ids):
            raise ValueError(f"stop_token_ids must be a list of non-negative ints, got {self.stop_token_ids!r}"[:200])
        self.stop_token_ids = list(ids)

        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens",
                     "spaces_between_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        self.logprobs = _int("logprobs", self.logprobs, allow_none=True)
        if self.logprobs is not None and not 0 <= self.logprobs <= _MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {_MAX_LOGPROBS}] or None, got {self.logprobs}")
        self.prompt_logprobs = _int("prompt_logprobs", self.prompt_logprobs, allow_none=True)
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= _MAX_LOGPROBS:
            raise ValueError(f"prompt_logprobs must be in [0, {_MAX_LOGPROBS}] or None, got {self.prompt_logprobs}")

        for name in ("presence_penalty", "frequency_penalty"):
            v = _float(name, getattr(self, name))
            if not -2.0 <= v <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {v}")
            setattr(self, name, v)
        self.repetition_penalty = _float("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be positive, got {self.repetition_penalty}")

        self.logit_bias = _logit_bias(self.logit_bias)
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if not isinstance(ids, (list, tuple)) or not ids or not all(_is_int(t) and t >= 0 for t in ids):
                raise ValueError(f"allowed_token_ids must be a non-empty list of non-negative ints, got {ids!r}"[:200])
            self.allowed_token_ids = sorted(set(ids))
        if self.bad_words is not None:
            if not isinstance(self.bad_words, (list, tuple)) or not all(isinstance(w, str) for w in self.bad_words):
                raise ValueError(f"bad_words must be a list of str, got {self.bad_words!r}"[:200])
            chars = sum(map(len, self.bad_words))
            if chars > _MAX_BAD_WORD_CHARS:
                raise ValueError(f"bad_words takes at most {_MAX_BAD_WORD_CHARS} characters in all, got {chars}")
            self.bad_words = list(self.bad_words) or None

        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")

        # Like vLLM: under greedy the truncation knobs are meaningless, so neutralise them
        # and the sampler never has to special-case them.
        if self.temperature < _SAMPLING_EPS:
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    def bad_words_token_ids(self, tokenizer) -> Optional[list[list[int]]]:
        """As vLLM's: each bad word as it tokenizes alone and, when that is another word of as many tokens, after a
        space (so it is banned at the start of the text and inside it). Kept on the params (and their clones): the
        server checks them, the engine then uses them, with the one model's tokenizer."""
        if not self.bad_words:
            return None
        cached = getattr(self, "_bad_words_ids", None)
        if cached is not None:
            return cached
        out: list[list[int]] = []
        for word in self.bad_words:
            if len(out) > _MAX_BAD_WORDS or sum(map(len, out)) > _MAX_BAD_WORD_TOKENS:  # refused below; the rest
                break  # of a huge list is never tokenized
            bare = tokenizer.encode(word.lstrip(), add_special_tokens=False)
            if not bare:
                raise ValueError(f"bad_words: {word!r} tokenizes to no token")
            out.append(bare)
            spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
                out.append(spaced)
        if len(out) > _MAX_BAD_WORDS or sum(map(len, out)) > _MAX_BAD_WORD_TOKENS:
            raise ValueError(f"bad_words: at most {_MAX_BAD_WORDS} words ({_MAX_BAD_WORD_TOKENS} tokens) after "
                             "tokenization, as vLLM's")
        self._bad_words_ids = out
        return out

    @property
    def sampling_type(self) -> str:
        if self.temperature < _SAMPLING_EPS:
            return "greedy"
        return "random_seed" if self.seed is not None else "random"

    def first_token_key(self) -> str:
        """What decides a request's first token (and the logprobs it comes with), as a short digest: a decode node
        takes the first token a prefill node sampled only for a request whose key matches its own, since a router
        may send P other params (vllm-router sends max_tokens 1, no stops). EOS and the stop ids count only while
        min_tokens masks them (vllm-router sends P min_tokens 1: with ignore_eos and no stop ids that masks nothing);
        max_tokens and stop strings decide when to stop, not what is drawn."""
        masks = self.min_tokens > 0
        banned = [sorted(self.stop_token_ids), not self.ignore_eos] if masks else [[], False]
        key = [self.temperature, self.top_p, self.top_k, self.min_p, self.seed, self.presence_penalty,
               self.frequency_penalty, self.repetition_penalty, sorted((self.logit_bias or {}).items()),
               self.allowed_token_ids, self.bad_words, banned, self.logprobs]
        return hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]

    def clone(self) -> "SamplingParams":
        c = replace(self, stop=list(self.stop), stop_token_ids=list(self.stop_token_ids),
                    logit_bias=None if self.logit_bias is None else dict(self.logit_bias),
                    allowed_token_ids=None if self.allowed_token_ids is None else list(self.allowed_token_ids),
                    bad_words=None if self.bad_words is None else list(self.bad_words))
        return self._keeps_tokenized(c)

    def _keeps_tokenized(self, c: "SamplingParams") -> "SamplingParams":
        """`c` (a copy with the same bad words) keeps their tokenization: never tokenized again."""
        if getattr(self, "_bad_words_ids", None) is not None:
            c._bad_words_ids = self._bad_words_ids
        return c

    def child(self, index: int) -> "SamplingParams":
        """Parallel sampling (n > 1) runs n requests of n = 1; as vLLM's, child i of a seeded request has seed +
        i (wrapped into the 64-bit range), so the n samples differ and each is reproducible."""
        seed = None if self.seed is None else (self.seed + index + 2 ** 63) % 2 ** 64 - 2 ** 63
        return self._keeps_tokenized(replace(self.clone(), n=1, seed=seed))

    @classmethod
    def from_generation_config(cls, gen_cfg: Any, **overrides: Any) -> "SamplingParams":
        """Model defaults from generation_config.json (dict or object with to_dict()), then
        the caller's explicit overrides. Keys that are absent or None are not applied."""
        if gen_cfg is not None and not isinstance(gen_cfg, dict):
            gen_cfg = gen_cfg.to_dict()
        gen_cfg = gen_cfg or {}
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s): {', '.join(unknown)}")
        kwargs = {k: gen_cfg[k] for k in _GEN_CFG_KEYS if gen_cfg.get(k) is not None}
        if gen_cfg.get("max_new_tokens") is not None:
            kwargs["max_tokens"] = gen_cfg["max_new_tokens"]
        kwargs.update(overrides)
        return cls(**kwargs)
