"""A request body read as it streams in, never whole past a limit: the server's (`--max-body-bytes` of `pdserve
serve`) and the router's (`--max-body-bytes` of `pdserve router`)."""
from __future__ import annotations

from starlette.requests import ClientDisconnect, Request

from pdserve.serve.errors import APIError

# bytes of an oversized body still read (and dropped) so that the client, still sending, sees the 413 rather than
# a connection reset
DRAIN_SLACK = 2 ** 20 * 8


async def read_body(request: Request, limit: int, who: str = "server") -> bytes:
    """The body, or APIError 413 naming the limit and its flag (a declared length over it is refused unread), or
    499 when the client went away before its body was in."""
    too_big = APIError(413, f"request body is larger than the {who}'s limit of {limit} bytes (--max-body-bytes)")
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit + DRAIN_SLACK:
        raise too_big
    parts, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size <= limit:
                parts.append(chunk)
            elif size > limit + DRAIN_SLACK:
                break
    except ClientDisconnect:  # gone before its body was in: nobody reads the answer, and it is not our fault
        raise APIError(499, "the client went away before its request body was read") from None
    if size > limit:
        raise too_big
    return b"".join(parts)  # one copy: a big body's every copy is event-loop time
