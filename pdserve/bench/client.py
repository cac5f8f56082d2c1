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
    prompt_len: Optional[int]  # None: not known to the client (a jsonl prompt without a tokenizer)
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


def _token_chunk(chunk: dict) -> Optional[str]:
    """The text of a chunk that carries tokens, "" included, as vLLM's client: a special token, a text the server's
    detokenizer holds back, the last chunk (EOS or a stop token, its finish_reason set) all carry one, and they
    count for TTFT, ITL and E2EL. None for a chunk that carries none: the usage chunk (no choices) and a chat
    stream's opening role delta (vLLM's client counts that one as the first token; it comes before any is made)."""
    choices = chunk.get("choices") or []
    if not choices:
        return None
    c = choices[0]
    if "delta" in c:
        delta = c.get("delta") or {}
        if "role" in delta and not delta.get("content") and c.get("finish_reason") is None:
            return None
        return delta.get("content") or ""
    return c.get("text") or ""


async def send_request(session: aiohttp.ClientSession, spec: RequestSpec, tokenizer=None) -> RequestResult:
    """Streams one request. Output tokens come from the final usage chunk; without one (or a count of 0 after
    tokens came), from the tokenizer, or the number of token chunks when there is no tokenizer either. The prompt's
    length is the usage's `prompt_tokens` when the server gives it (a chat template's tokens included), else the
    client's own count (None when it has no tokenizer)."""
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
                piece = _token_chunk(chunk)
                if piece is None:
                    continue
                now = time.perf_counter()
                if chunks == 0:
                    res.ttft = now - start
                else:
                    res.itl.append(now - last)
                last, chunks = now, chunks + 1
                text.append(piece)
        res.latency = last - start  # vLLM's E2EL: to the last token chunk, not to [DONE]
    except Exception as e:  # one request's failure is counted, never the run's end
        res.error = f"{type(e).__name__}: {e}"
        return res
    res.success = chunks > 0
    if not res.success:
        res.error = "no token chunk received"
        return res
    res.generated_text = "".join(text)
    usage = usage if isinstance(usage, dict) else {}
    if isinstance(usage.get("prompt_tokens"), int):
        res.prompt_len = usage["prompt_tokens"]
    if isinstance(usage.get("completion_tokens"), int) and usage["completion_tokens"] > 0:
        res.output_tokens = usage["completion_tokens"]
    elif tokenizer is not None:
        res.output_tokens = len(tokenizer.encode(res.generated_text, add_special_tokens=False))
    else:
        res.output_tokens = chunks
    return res
