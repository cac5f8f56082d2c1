"""The simulator's input: requests with an arrival time, a prompt length and an output length.

A trace is JSONL, one request per line:
  {"arrival_time": 0.25, "prompt_len": 512, "output_len": 64, "prefix_group": "sys-a", "prefix_len": 256}
`arrival_time` in seconds from the start (>= 0, any order: requests are taken by time, ties in file order);
`prompt_len` and `output_len` tokens (>= 1); optional `prefix_group` (a string or integer) and `prefix_len`
(0..prompt_len, default 0): requests of one group start with the same `prefix_len` token ids, so the prefix cache
has something to hit; optional `request_id` (a string, unique). Blank lines are skipped; anything else is an error
naming the line and the field.

Or vLLM bench serve's random generator (`random_trace`): its length draws (bench/datasets.py) and its gamma
arrivals (bench/arrivals.py), so a simulated run and a `bench serve` run with the same flags and seed see the same
lengths and arrival times.
"""
from __future__ import annotations

import json
import math
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

import numpy as np

from pdserve.bench.arrivals import arrival_offsets
from pdserve.bench.datasets import _lengths

FIELDS = ("arrival_time", "prompt_len", "output_len", "prefix_group", "prefix_len", "request_id")
FIRST_TOKEN_ID = 10  # below: left to special tokens (EOS, BOS, pad) of the models make-model builds


class TraceError(ValueError):
    pass


@dataclass(frozen=True)
class TraceRequest:
    request_id: str
    arrival_time: float
    prompt_len: int
    output_len: int
    prefix_group: Optional[str] = None
    prefix_len: int = 0


def _int(obj: dict, key: str, where: str, lo: int, default: Optional[int] = None) -> int:
    if key not in obj:
        if default is None:
            raise TraceError(f"{where}: {key}: missing")
        return default
    v = obj[key]
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise TraceError(f"{where}: {key}: must be an integer >= {lo}, got {v!r}"[:200])
    return v


def parse_line(obj, where: str, index: int) -> TraceRequest:
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - set(FIELDS))
    if unknown:
        raise TraceError(f"{where}: {unknown[0]}: unknown field (known: {', '.join(FIELDS)})")
    if "arrival_time" not in obj:
        raise TraceError(f"{where}: arrival_time: missing")
    t = obj["arrival_time"]
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
        raise TraceError(f"{where}: arrival_time: must be a number of seconds >= 0, got {t!r}"[:200])
    prompt_len = _int(obj, "prompt_len", where, 1)
    output_len = _int(obj, "output_len", where, 1)
    group = obj.get("prefix_group")
    if group is not None and (isinstance(group, bool) or not isinstance(group, (str, int))):
        raise TraceError(f"{where}: prefix_group: must be a string or an integer, got {group!r}"[:200])
    prefix_len = _int(obj, "prefix_len", where, 0, default=0)
    if prefix_len > prompt_len:
        raise TraceError(f"{where}: prefix_len: {prefix_len} is longer than prompt_len {prompt_len}")
    if prefix_len and group is None:
        raise TraceError(f"{where}: prefix_len: needs a prefix_group (the requests that share the prefix)")
    rid = obj.get("request_id", f"sim-{index}")
    if not isinstance(rid, str) or not rid:
        raise TraceError(f"{where}: request_id: must be a non-empty string, got {rid!r}"[:200])
    return TraceRequest(rid, float(t), prompt_len, output_len, None if group is None else str(group), prefix_len)


def load_trace(path: Union[str, Path]) -> list[TraceRequest]:
    """The trace's requests by arrival time (ties in file order); TraceError naming the line and field."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise TraceError(f"--trace {path}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise TraceError(f"--trace {path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    reqs, seen = [], {}
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"--trace {path}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise TraceError(f"{where}: not JSON ({e.msg} at column {e.colno})") from None
        r = parse_line(obj, where, len(reqs))
        if r.request_id in seen:
            raise TraceError(f"{where}: request_id: {r.request_id!r} is used by line {seen[r.request_id]} too")
        seen[r.request_id] = lineno
        reqs.append(r)
    if not reqs:
        raise TraceError(f"--trace {path}: no requests")
    return sorted(reqs, key=lambda r: r.arrival_time)  # stable: ties keep file order


def random_trace(num_prompts: int, input_len: int, output_len: int, request_rate: float, range_ratio: float = 0.0,
                 burstiness: float = 1.0, seed: int = 0, prefix_len: int = 0) -> list[TraceRequest]:
    """bench serve's random dataset as lengths: the same draws of input and output lengths for the seed (the prompt
    text itself is not needed), gamma arrivals at `request_rate`; `prefix_len` shared tokens in front of every
    prompt, as --random-prefix-len (which adds to input_len)."""
    if num_prompts < 1 or input_len < 1 or output_len < 1:
        raise TraceError("--num-prompts, --random-input-len and --random-output-len must be >= 1")
    if prefix_len < 0:
        raise TraceError("--random-prefix-len must be >= 0")
    rng = np.random.default_rng(seed)
    ins, outs = _lengths(rng, num_prompts, input_len, range_ratio), _lengths(rng, num_prompts, output_len, range_ratio)
    times = arrival_offsets(num_prompts, request_rate, burstiness, seed)
    group = "random-prefix" if prefix_len else None
    return [TraceRequest(f"sim-{i}", t, prefix_len + int(n), int(m), group, prefix_len)
            for i, (t, n, m) in enumerate(zip(times, ins, outs))]


def prompt_token_ids(r: TraceRequest, vocab_size: int, seed: int = 0) -> list[int]:
    """Token ids for `r`'s prompt: its group's shared prefix, then ids of its own. Deterministic in (seed, group,
    request id), drawn from [FIRST_TOKEN_ID, vocab_size) so a real model (the calibration, the equivalence test)
    can take them; distinct requests share no full block but by their group."""
    def stream(key: str, n: int) -> list[int]:
        rng = np.random.default_rng((seed, zlib.crc32(key.encode())))
        return rng.integers(FIRST_TOKEN_ID, vocab_size, size=n).tolist()
    prefix = stream("group:" + r.prefix_group, r.prefix_len) if r.prefix_group is not None else []
    return prefix + stream("request:" + r.request_id, r.prompt_len - len(prefix))
