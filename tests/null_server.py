"""A null OpenAI streaming endpoint: answers every completion at once (two content chunks, usage, [DONE]).

Raw ASGI on uvicorn, no framework, so the server's own cost is as small as it gets: what `bench serve` measures
against it is the client's overhead. Usage: python -m tests.null_server PORT"""
import json
import sys

import uvicorn

CHUNKS = [b"data: " + json.dumps(c).encode() + b"\n\n" for c in (
    {"id": "cmpl-null", "object": "text_completion", "choices": [{"index": 0, "text": "a", "finish_reason": None}]},
    {"id": "cmpl-null", "object": "text_completion", "choices": [{"index": 0, "text": "b", "finish_reason": "length"}]},
    {"id": "cmpl-null", "object": "text_completion", "choices": [],
     "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}})] + [b"data: [DONE]\n\n"]


async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    if scope["path"] == "/health":
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})
        return
    if scope["path"] != "/v1/completions":
        await send({"type": "http.response.start", "status": 404, "headers": []})
        await send({"type": "http.response.body", "body": b""})
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
    await send({"type": "http.response.body", "body": b"".join(CHUNKS)})


if __name__ == "__main__":
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning", access_log=False)
