"""Parallel sampling (`n` > 1): one client request answered with n choices, as vLLM's server.

1. The body is translated once; n engine requests `<i>_<request id>` are submitted with `params.child(i)` (n = 1,
   a seeded request's child i seeded seed + i), after one check that the queue has room for all n (a 503 refuses
   the whole request, never part of it; n above --max-waiting could never be admitted: a 400 naming `n`).
2. The children run as independent requests; the prefix cache shares their prompt blocks.
3. Their records are merged as they arrive, each into the builder of its choice `index`: a full answer once all n
   finished (any child's error is the answer's error), or one SSE stream whose chunks carry their choice's index,
   the usage (the prompt once, every choice's tokens) and `[DONE]` once at the end.
4. The client going away, or any exit before the end, aborts every child that has not finished.
P/D requests (kv_transfer_params) are n = 1 only: the protocol refuses n > 1 with them.
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
from pdserve.serve.router_timing import server_timing

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


def submit_children(engine: AsyncEngine, greq: GenerationRequest, request_id: str, arrival: float) -> list:
    n = greq.params.n
    if n > engine.max_waiting:
        raise APIError(400, f"n = {n} is more than this server ever queues (--max-waiting {engine.max_waiting})",
                       "n")
    engine.check_accepting(n)
    states = []
    try:
        for i in range(n):
            states.append(engine.submit(f"{i}_{request_id}", greq.prompt_token_ids, greq.params.child(i), arrival))
    except BaseException:  # none of a refused request stays in the engine
        for st in states:
            engine.abort(st)
        raise
    return states


async def create_n(engine: AsyncEngine, greq: GenerationRequest, request: Request, request_id: str, arrival: float,
                   prefix: str, until_disconnected) -> Response:
    states = submit_children(engine, greq, request_id, arrival)
    builders: list[ResponseBuilder] = []
    for i in range(greq.params.n):
        builders.append(ResponseBuilder(greq, prefix + request_id, int(time.time()), i, builders))
    logger.info("%s request: %d prompt tokens, n=%d, max_tokens=%s, stream=%s", greq.kind,
                len(greq.prompt_token_ids), greq.params.n, greq.params.max_tokens, greq.stream)
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
    logger.info("finished: n=%d, %d tokens", len(builders), sum(len(b.token_ids) for b in builders))
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
            logger.info("finished: n=%d, %d tokens (stream)", len(builders), sum(len(b.token_ids) for b in builders))
        except Exception:  # after the headers went out: an error event, then the end
            logger.exception("stream failed")
            yield sse({"error": {"message": "internal server error (see the server log)",
                                 "type": "InternalServerError", "param": None, "code": 500}})
        yield builders[0].final_chunks()
