"""Parallel sampling (`n` > 1) and batched completions prompts: one client request answered with several choices,
as vLLM's server.

1. The body is translated once, into one GenerationRequest per prompt (a completions `prompt` may be a list of
   prompts); for prompt j, n engine requests are submitted with `params.child(i)` (n = 1, a seeded request's child
   i seeded seed + i), named as vLLM's: `<i>_<request id>` for one prompt, `<request id>-<j>` for a batch with
   n = 1, `<i>_<request id>-<j>` for both. One check comes first that the queue has room for them all (a 503
   refuses the whole request, never part of it; more than --max-waiting could never be admitted: a 400 naming
   `n`, or `prompt` for a batch).
2. The children run as independent requests; the prefix cache shares their prompt blocks.
3. Their records are merged as they arrive, each into the builder of its choice, `index` = j * n + i: a full
   answer once all finished (any child's error is the answer's error), or one SSE stream whose chunks carry their
   choice's index, the usage (each prompt once, every choice's tokens) and `[DONE]` once at the end.
4. The client going away, or any exit before the end, aborts every child that has not finished.
P/D requests (kv_transfer_params) are one prompt and n = 1 only: the protocol refuses the rest with them.
"""
from __future__ import annotations

import asyncio
import logging
import time
from contextlib import aclosing
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pdserve.serve.async_engine import AsyncEngine
from pdserve.serve.errors import APIError
from pdserve.serve.protocol import GenerationRequest
from pdserve.serve.responses import ResponseBuilder, sse
from pdserve.serve.server_timing import server_timing

logger = logging.getLogger("pdserve.serve")


async def merged(engine: AsyncEngine, states: list) -> AsyncIterator[tuple[int, list]]:
    """(choice index, records) as they arrive from n children's streams; leaving early aborts the unfinished."""
    gens = [engine.stream(st) for st in states]
    pending = {asyncio.ensure_future(g.__anext__()): i for i, g in enumerate(gens)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for fut in done:
                i = pending.pop(fut)
                recs = fut.result()  # a child's stream ends after its finished record: never StopAsyncIteration
                yield i, recs
                if not recs[-1].finished:
                    pending[asyncio.ensure_future(gens[i].__anext__())] = i
    finally:
        for fut in pending:  # a cancelled read runs its stream's exit, which aborts that child
            fut.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for g in gens:
            await g.aclose()


def child_id(request_id: str, i: int, n: int, j: int, num_prompts: int) -> str:
    rid = request_id if num_prompts == 1 else f"{request_id}-{j}"
    return rid if n == 1 else f"{i}_{rid}"


def submit_children(engine: AsyncEngine, greqs: list[GenerationRequest], request_id: str, arrival: float) -> list:
    """Every choice's engine request, in choice order (j * n + i), or none of them."""
    n, total = greqs[0].params.n, len(greqs) * greqs[0].params.n
    if total > engine.max_waiting:
        what = f"n = {n}" if len(greqs) == 1 else f"{len(greqs)} prompts x n = {n} ({total} requests)"
        raise APIError(400, f"{what} is more than this server ever queues (--max-waiting {engine.max_waiting})",
                       "n" if len(greqs) == 1 else "prompt")
    engine.check_accepting(total)
    states = []
    try:
        for j, greq in enumerate(greqs):
            for i in range(n):
                states.append(engine.submit(child_id(request_id, i, n, j, len(greqs)), greq.prompt_token_ids,
                                            greq.params.child(i), arrival, cache_salt=greq.cache_salt))
    except BaseException:  # none of a refused request stays in the engine
        for st in states:
            engine.abort(st)
        raise
    return states


async def create_n(engine: AsyncEngine, greqs: list[GenerationRequest], request: Request, request_id: str,
                   arrival: float, prefix: str, until_disconnected) -> Response:
    states = submit_children(engine, greqs, request_id, arrival)
    greq, n = greqs[0], greqs[0].params.n
    builders: list[ResponseBuilder] = []
    for k in range(len(states)):
        builders.append(ResponseBuilder(greqs[k // n], prefix + request_id, int(time.time()), k, builders))
    logger.info("%s request: %d prompt(s), %d prompt tokens, n=%d, max_tokens=%s, stream=%s", greq.kind,
                len(greqs), sum(len(g.prompt_token_ids) for g in greqs), n, greq.params.max_tokens, greq.stream)
    gen = merged(engine, states)
    if greq.stream:
        return StreamingResponse(_stream(gen, builders), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def run():
        async with aclosing(gen):
            async for i, recs in gen:
                for rec in recs:
                    builders[i].add(rec)

    task = await until_disconnected(run(), request)
    if task.cancelled():
        return Response(status_code=499)
    task.result()
    failed = next((b for b in builders if b.finish_reason == "error"), None)
    if failed is not None:
        raise APIError(500, f"the request failed: {failed.error or 'engine error'}")
    logger.info("finished: %d choices, %d tokens", len(builders), sum(len(b.token_ids) for b in builders))
    return JSONResponse(builders[0].full(), headers=server_timing(builders[0].timing))


async def _stream(gen, builders: list[ResponseBuilder]):
    async with aclosing(gen):
        try:
            first = "".join(b.first_chunks() for b in builders)
            if first:
                yield first
            async for i, recs in gen:
                out = builders[i].chunks(recs)
                if out:
                    yield out
            logger.info("finished: %d choices, %d tokens (stream)", len(builders),
                        sum(len(b.token_ids) for b in builders))
        except Exception:  # after the headers went out: an error event, then the end
            logger.exception("stream failed")
            yield sse({"error": {"message": "internal server error (see the server log)",
                                 "type": "InternalServerError", "param": None, "code": 500}})
        yield builders[0].final_chunks()
