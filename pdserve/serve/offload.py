"""Request handling's CPU work (chat templating, tokenization, the checks between) on worker threads, off the
event loop, so a long one delays its own request only; the Rust tokenizer lets the GIL go while it encodes.

Two pools, by the size of the request's body: small bodies never queue behind big ones, whose work grows with
them (a 16 MiB batch of prompts is seconds of tokenizing), so a client sending big bodies holds up other big bodies
at most. Each call keeps the request's context (its id on every log line).
"""
from __future__ import annotations

import asyncio
import contextvars
import functools
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from starlette.requests import Request

BULK_BYTES = 64 * 1024  # a body this big or bigger is handled on the bulk pool (~40 ms of tokenizing at most below)
_SMALL = ThreadPoolExecutor(4, thread_name_prefix="pdserve-request")
_BULK = ThreadPoolExecutor(2, thread_name_prefix="pdserve-request-bulk")  # 2: more would not tokenize faster here


async def off_loop(request: Request, fn: Callable[..., Any], *args) -> Any:
    """fn(*args) on the pool for `request`'s body size (`request.state.body_bytes`, set where it was read)."""
    pool = _BULK if getattr(request.state, "body_bytes", 0) >= BULK_BYTES else _SMALL
    call = functools.partial(contextvars.copy_context().run, fn, *args)
    return await asyncio.get_running_loop().run_in_executor(pool, call)
