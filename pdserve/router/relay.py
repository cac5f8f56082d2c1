"""The router's last leg: D's answer, streamed or whole, relayed to the client unchanged.

A whole answer (not `text/event-stream`) is read to its end before anything goes out, so a D that breaks off is a
clean 502. A stream goes out as D sends it; a D that breaks off once the headers are out gets the stream ended
for it, with an error event and `[DONE]` (unless D had sent its `[DONE]` already). Either way D's node is released
(its in-flight count, the upstream connection) exactly once: from the relay's end, or from the response's
background task when the client left before the relay ran.
"""
from __future__ import annotations

import json
import logging
from typing import Awaitable, Callable, Optional

from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from pdserve.router.nodes import Node
from pdserve.router.upstream import Answer, UpstreamError

logger = logging.getLogger("pdserve.router")
DONE = b"data: [DONE]\n\n"


def error(status: int, message: str, kind: str = "invalid_request_error", param: Optional[str] = None) -> JSONResponse:
    """OpenAI's error shape, as the nodes answer it: `param` names the field at fault (None: none is)."""
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}},
                        status_code=status)


def reason(e: BaseException) -> str:
    """An exception as a log line or error message can say it (one with no text of its own by its type)."""
    return str(e) or type(e).__name__


async def relay_answer(upstream: Answer, node: Node, rid: str,
                       on_first_chunk: Optional[Callable[[], None]],
                       on_break: Optional[Callable[[str], Awaitable[Response]]] = None) -> Response:
    """`upstream` is D's open answer (headers in, body not read); `on_first_chunk` runs when the first body chunk
    of a stream goes out; `on_break(why)` answers a whole answer D broke off (default: a 502)."""
    media = upstream.headers.get("content-type", "application/json")
    if "text/event-stream" not in media:
        try:
            content = await upstream.aread()
        except UpstreamError as e:
            why = f"decode node {node.url} broke off its answer: {reason(e)}"
            logger.warning("[%s] %s", rid, why)
            node.in_flight -= 1
            await upstream.aclose()
            return await on_break(why) if on_break is not None else error(502, why, "bad_gateway")
        node.in_flight -= 1
        await upstream.aclose()
        return Response(content, upstream.status_code, media_type=media, headers={"X-Request-Id": rid})
    released = False
    tail = b"\n\n"  # the stream's last bytes: where the events stand if D breaks off

    async def release():
        nonlocal released
        if not released:
            released = True
            node.in_flight -= 1
            await upstream.aclose()

    async def relay():
        nonlocal tail, on_first_chunk
        try:
            async for chunk in upstream.aiter_raw():
                if on_first_chunk is not None:
                    on_first_chunk, first = None, on_first_chunk
                    first()
                tail = (tail + chunk)[-16:]
                yield chunk
        except UpstreamError as e:  # the headers are out: end the stream cleanly
            logger.warning("[%s] decode node %s broke off its stream: %s", rid, node.url, reason(e))
            if not tail.endswith(DONE):
                err = {"message": f"decode node {node.url} broke off its answer: {reason(e)}", "type": "bad_gateway",
                       "param": None, "code": 502}
                # a chunk may end inside an event: close it first, so the error event parses on its own
                event = f"data: {json.dumps({'error': err})}\n\n".encode()
                yield (b"" if tail.endswith(b"\n\n") else b"\n\n") + event + DONE
        finally:
            await release()

    return StreamingResponse(relay(), status_code=upstream.status_code, media_type=media,
                             headers={"X-Request-Id": rid}, background=BackgroundTask(release))
