"""Shrinks a failing Case to a small one that fails the same way (same Failure.signature): drop requests (halves,
then one at a time), then simplify what is left (no abort, local, greedy, fewer tokens, shorter prompts, arrival at
step 0) and the config (fewer seats, no caching or chunking, default graph mode, shorter max_model_len), keeping
each change only while the failure stays. Every try is one engine run of milliseconds."""
from __future__ import annotations

import copy
import time
from typing import Callable

from pdserve.sched_output import cdiv


def _request_edits(q: dict):
    if q["abort"] is not None:
        yield {**q, "abort": None}
    if q["kind"] != "local":
        yield {**q, "kind": "local", "lease": None}
    sp = q["sp"]
    if sp.get("temperature") or sp.get("seed") is not None:
        yield {**q, "sp": {**sp, "temperature": 0.0, "seed": None}}
    for k in ("stop", "stop_token_ids", "min_tokens", "ignore_eos", "include_stop_str_in_output"):
        if k in sp:
            yield {**q, "sp": {n: v for n, v in sp.items() if n != k}}
    if sp.get("max_tokens") and sp["max_tokens"] > 1:
        for m in (1, sp["max_tokens"] // 2, sp["max_tokens"] - 1):
            if m >= max(1, sp.get("min_tokens", 0)):
                yield {**q, "sp": {**sp, "max_tokens": m}}
    n = len(q["prompt"])
    for m in (1, 2, n // 2, n - 1):
        if 1 <= m < n and not (q["kind"] != "local" and m < 2):
            yield {**q, "prompt": q["prompt"][:m]}
    if q["at"]:
        yield {**q, "at": 0, "abort": None if q["abort"] is None else q["abort"] - q["at"]}


def _config_edits(case: dict):
    cfg = case["cfg"]
    need = max([len(q["prompt"]) + (q["sp"].get("max_tokens") or 1) for q in case["reqs"]] + [17])
    for k, v in (("max_num_seqs", 1), ("max_num_seqs", max(1, cfg["max_num_seqs"] // 2)), ("prefix_caching", False),
                 ("mode", "FULL_AND_PIECEWISE"), ("eager", False), ("capture_max", None), ("rule", "decode-shaped")):
        if cfg[k] != v:
            yield {**cfg, k: v}
    if cfg.get("long_prefill"):
        yield {**cfg, "long_prefill": 0}
    if cfg["chunked_prefill"]:
        yield {**cfg, "chunked_prefill": False, "long_prefill": 0,
               "max_num_batched_tokens": max(cfg["max_model_len"], cfg["max_num_seqs"], 2048)}
    extra = cfg["num_blocks"] - 1 - cdiv(cfg["max_model_len"], cfg["block_size"])
    for mml in (need, cfg["max_model_len"] // 2, cfg["max_model_len"] - 1):
        if need <= mml < cfg["max_model_len"]:
            yield {**cfg, "max_model_len": mml, "num_blocks": cdiv(mml, cfg["block_size"]) + 1 + extra}
    if extra > 0:
        for e in (0, extra // 2):
            yield {**cfg, "num_blocks": cdiv(cfg["max_model_len"], cfg["block_size"]) + 1 + e}
    if cfg.get("kv") and not any(q["kind"] == "remote" for q in case["reqs"]):
        yield {**cfg, "kv": None}


def shrink(case: dict, still_fails: Callable[[dict], bool], budget_s: float = 20.0) -> tuple[dict, int]:
    """(the smallest failing case found, tries)."""
    best, tries, t_end = copy.deepcopy(case), 0, time.monotonic() + budget_s

    def attempt(c) -> bool:
        nonlocal best, tries
        if time.monotonic() > t_end:
            return False
        tries += 1
        if still_fails(c):
            best = c
            return True
        return False

    changed = True
    while changed and time.monotonic() < t_end:
        changed = False
        chunk = max(1, len(best["reqs"]) // 2)
        while chunk >= 1 and time.monotonic() < t_end:  # drop runs of requests
            i = 0
            while i < len(best["reqs"]):
                reqs = best["reqs"][:i] + best["reqs"][i + chunk:]
                if reqs and attempt({**best, "reqs": reqs}):
                    changed = True
                else:
                    i += chunk
            chunk //= 2
        for i in range(len(best["reqs"])):
            progress = True
            while progress:
                progress = False
                for q in _request_edits(best["reqs"][i]):
                    if attempt({**best, "reqs": best["reqs"][:i] + [q] + best["reqs"][i + 1:]}):
                        changed = progress = True
                        break
        for cfg in _config_edits(best):
            if attempt({**best, "cfg": cfg}):
                changed = True
    return best, tries
