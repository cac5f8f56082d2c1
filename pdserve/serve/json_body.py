"""Request bodies as JSON, parsed off the event loop when they are big.

json.loads holds the GIL for its whole run, so parsing on a thread would stall the event loop (every stream the
server is sending) just the same: a body of `OFFLOAD_BYTES` or more is parsed in a worker process. A dense body is
the costly kind (a 100k-item list: ~30 ms of parsing per MiB, and as much again to unpickle what comes back), so
the worker also refuses a body holding more than `MAX_ITEMS` values in all, before anything crosses back: only
what a request may hold reaches the loop. What must stay true: the same body gives the same dict, or the same 400,
on either path.
"""
from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import re
from concurrent.futures import ProcessPoolExecutor
from typing import Optional

# below this, parsing takes well under a millisecond: not worth the hop (PDSERVE_JSON_OFFLOAD_BYTES; 0: never offload)
OFFLOAD_BYTES = int(os.environ.get("PDSERVE_JSON_OFFLOAD_BYTES", 256 * 1024))
# values in one body, all containers together: far above any request's needs (a token-id prompt of a 1M context)
MAX_ITEMS = 1 << 20
WORKER_NICE = 10  # the worker's niceness above the server's
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_pool: Optional[ProcessPoolExecutor] = None
_users = 0


def parse(body: bytes) -> tuple[Optional[dict], Optional[str]]:
    """(the body's JSON object, None) or (None, why it is refused). Runs in the worker for big bodies."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        return None, f"request body is not valid JSON: {e}"
    except RecursionError:
        return None, "request body is not valid JSON: nested too deeply"
    # JSON may escape a lone UTF-16 surrogate ("\ud800"), which no tokenizer or response encoder takes; only a
    # body holding a surrogate escape (pairs too) pays for the check
    if _SURROGATE_ESCAPE.search(body):
        try:
            json.dumps(data, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            return None, "request body is not valid unicode: it holds a lone UTF-16 surrogate"
    if not isinstance(data, dict):
        return None, f"request body must be a JSON object, got {type(data).__name__}"
    if (n := _num_items(data)) > MAX_ITEMS:
        return None, f"request body holds {n} values, more than the {MAX_ITEMS} one request may hold"
    return data, None


def _num_items(data) -> int:
    n, stack = 0, [data]
    while stack:
        x = stack.pop()
        if isinstance(x, dict):
            n += len(x)
            stack.extend(v for v in x.values() if isinstance(v, (dict, list)))
        elif isinstance(x, list):
            n += len(x)
            stack.extend(v for v in x if isinstance(v, (dict, list)))
        if n > MAX_ITEMS:
            break
    return n


def _worker_pid() -> int:
    return os.getpid()


def start() -> None:
    """Make the worker's pool (a spawned process: the server has threads, so no fork). The process starts with the
    first big body (most servers never get one, so its ~0.4 s of CPU is not spent at every start); that body waits
    for it, the event loop does not. One per process, shared by the servers in it (tests run several): each
    `start` is matched by a `stop`, and the last stop ends it."""
    global _pool, _users
    _users += 1
    if _pool is None and OFFLOAD_BYTES > 0:
        # niced: its CPU is a big body's, and must not slow the engine's steps on a node with few cores
        _pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"), initializer=os.nice,
                                    initargs=(WORKER_NICE,))


def stop() -> None:
    global _pool, _users
    _users = max(0, _users - 1)
    if _pool is not None and _users == 0:
        _pool.shutdown(wait=False, cancel_futures=True)
        _pool = None


async def parse_off_loop(body: bytes) -> tuple[Optional[dict], Optional[str]]:
    """`parse(body)`, in the worker when the body is big and the worker runs (else here)."""
    if _pool is None or OFFLOAD_BYTES <= 0 or len(body) < OFFLOAD_BYTES:
        return parse(body)
    return await asyncio.get_running_loop().run_in_executor(_pool, parse, body)
