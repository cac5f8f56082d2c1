"""A null OpenAI streaming endpoint: answers every completion or chat request at once (two content chunks, usage,
[DONE]).

Raw ASGI on uvicorn, no framework, so the server's own cost is as small as it gets: what `bench serve` measures
against it is the client's overhead. Usage: python -m tests.null_server PORT"""
import json
import sys

import uvicorn

USAGE = {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}


def sse(*events: dict) -> bytes:
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"


BODIES = {
    "/v1/completions": sse({"choices": [{"index": 0, "text": "a", "finish_reason": None}]},
                           {"choices": [{"index": 0, "text": "b", "finish_reason": "length"}]},
                           {"choices": [], "usage": USAGE}),
    # chat opens with a role-only delta, as OpenAI and vLLM do: it is not content, so not the first token
    "/v1/chat/completions": sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
                                {"choices": [{"index": 0, "delta": {"content": "a"}}]},
                                {"choices": [{"index": 0, "delta": {"content": "b"}, "finish_reason": "length"}]},
                                {"choices": [], "usage": USAGE}),
}


async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    if scope["path"] == "/health":
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})
        return
    if scope["path"] not in BODIES:
        await send({"type": "http.response.start", "status": 404, "headers": []})
        await send({"type": "http.response.body", "body": b""})
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
    await send({"type": "http.response.body", "body": BODIES[scope["path"]]})


if __name__ == "__main__":
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning", access_log=False)
