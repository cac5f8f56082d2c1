"""One streamed OpenAI request, timed chunk by chunk (aiohttp, as vLLM's benchmark client)."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Literal, Optional

import aiohttp

from pdserve.bench.metrics import RequestResult

Endpoint = Literal["/v1/completions", "/v1/chat/completions"]


@dataclass(frozen=True)
class RequestSpec:
    url: str
    endpoint: Endpoint
    model: str
    prompt: str
    prompt_len: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    api_key: Optional[str] = None


def build_payload(spec: RequestSpec) -> dict:
    body = {"model": spec.model, "max_tokens": spec.max_tokens, "temperature": spec.temperature, "stream": True,
            "stream_options": {"include_usage": True}}
    if spec.ignore_eos:
        body["ignore_eos"] = True
    if spec.endpoint == "/v1/chat/completions":
        body["messages"] = [{"role": "user", "content": spec.prompt}]
    else:
        body["prompt"] = spec.prompt
    return body


def _content(chunk: dict) -> str:
    """The text a chunk carries. Chunks without any (a chat role delta, the usage chunk, an empty text held back
    by the server's detokenizer) are not tokens for TTFT and ITL."""
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    c = choices[0]
    return c.get("text") or (c.get("delta") or {}).get("content") or ""


async def send_request(session: aiohttp.ClientSession, spec: RequestSpec, tokenizer=None) -> RequestResult:
    """Streams one request. Output tokens come from the final usage chunk; without one, from the tokenizer (or the
    number of content chunks when there is no tokenizer either)."""
    res = RequestResult(prompt_len=spec.prompt_len)
    headers = {"Authorization": f"Bearer {spec.api_key}"} if spec.api_key else {}
    text, usage, chunks = [], None, 0
    start = last = res.start = time.perf_counter()
    try:
        async with session.post(spec.url + spec.endpoint, json=build_payload(spec), headers=headers) as resp:
            if resp.status != 200:
                body = await resp.text()
                try:
                    body = json.loads(body)["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    pass
                res.error = f"HTTP {resp.status}: {str(body)[:200]}"
                return res
            async for raw in resp.content:  # SSE: one `data: ...` line per event, blank lines between
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if not isinstance(chunk, dict):
                    raise ValueError(f"not a JSON object: {data[:80]!r}")
                if "error" in chunk:
                    err = chunk["error"]
                    res.error = f"stream error: {err.get('message', err) if isinstance(err, dict) else err}"
                    return res
                usage = chunk.get("usage") or usage
                piece = _content(chunk)
                if not piece:
                    continue
                now = time.perf_counter()
                if chunks == 0:
                    res.ttft = now - start
                else:
                    res.itl.append(now - last)
                last, chunks = now, chunks + 1
                text.append(piece)
        res.latency = last - start  # vLLM's E2EL: to the last content chunk, not to [DONE]
    except Exception as e:  # one request's failure is counted, never the run's end
        res.error = f"{type(e).__name__}: {e}"
        return res
    res.generated_text = "".join(text)
    if usage and usage.get("completion_tokens") is not None:
        res.output_tokens = int(usage["completion_tokens"])
    elif tokenizer is not None:
        res.output_tokens = len(tokenizer.encode(res.generated_text, add_special_tokens=False))
    else:
        res.output_tokens = chunks
    res.success = chunks > 0
    if not res.success:
        res.error = "no content chunk received"
    return res
