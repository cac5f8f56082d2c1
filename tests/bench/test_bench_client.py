"""bench serve's client against scripted streams (an in-process aiohttp server): which chunks are tokens, and where
a request's counts come from. Timings here are lower bounds (sleeps), never upper ones."""
import asyncio
import json

import aiohttp
import pytest
from aiohttp import web

from pdserve.bench.client import RequestSpec, send_request
from pdserve.bench.metrics import RequestResult, compute_metrics, format_metrics


def completion(text, finish=None):
    return {"choices": [{"index": 0, "text": text, "finish_reason": finish}]}


def chat(delta, finish=None):
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def usage(prompt, completion_tokens):
    return {"choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": completion_tokens}}


def run(script, endpoint="/v1/completions", prompt_len=3):
    """script: [(seconds to wait, event), ...] streamed, then [DONE]."""
    async def handler(request):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for wait, event in script:
            await asyncio.sleep(wait)
            await resp.write(b"data: " + json.dumps(event).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def main():
        app = web.Application()
        app.router.add_post(endpoint, handler)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        try:
            async with aiohttp.ClientSession() as s:
                spec = RequestSpec(f"http://127.0.0.1:{port}", endpoint, "m", "p", prompt_len, 8)
                return await send_request(s, spec)
        finally:
            await runner.cleanup()
    return asyncio.run(main())


def test_empty_text_chunks_and_the_finishing_chunk_are_tokens():
    """EOS or a stop token ends a stream with an empty text and its finish_reason; a held-back text is empty too.
    Skipping them cut E2EL short (and so TPOT) and lost ITL gaps."""
    r = run([(0.05, completion("a")), (0.02, completion("")), (0.02, completion("b")), (0.2, completion("", "stop")),
             (0.0, usage(41, 4))])
    assert r.success and len(r.itl) == 3 and r.itl[-1] >= 0.2
    assert r.latency >= 0.29 and r.ttft >= 0.05
    assert r.tpot == pytest.approx((r.latency - r.ttft) / 3)
    assert (r.prompt_len, r.output_tokens) == (41, 4)  # the server's usage: a chat template's tokens included


def test_the_chat_role_delta_is_not_the_first_token():
    r = run([(0.0, chat({"role": "assistant", "content": ""})), (0.1, chat({"content": "a"})),
             (0.02, chat({}, "length")), (0.0, usage(9, 2))], endpoint="/v1/chat/completions")
    assert r.ttft >= 0.1 and len(r.itl) == 1 and r.output_tokens == 2


def test_counts_without_usage_and_a_zero_usage_count():
    r = run([(0.0, completion("a")), (0.0, completion("b", "length")), (0.0, usage(0, 0))], prompt_len=None)
    assert r.output_tokens == 2  # 0 completion tokens after two token chunks: counted here (no tokenizer)
    assert r.prompt_len == 0  # the server's own count wins, even 0
    r = run([(0.0, completion("a")), (0.0, completion("b", "length"))], prompt_len=None)
    assert r.prompt_len is None and r.output_tokens == 2


def test_a_request_without_tokens_fails_and_counts_none():
    r = run([(0.0, usage(5, 3))])
    assert not r.success and r.output_tokens == 0 and "no token chunk" in r.error


def test_peaks_from_a_stream():
    """The client's send time and chunk times feed vLLM's per-second peaks: 5 chunks at once, then 2 a second on."""
    r = run([(0.0, completion("a"))] * 5 + [(1.05, completion("b")), (0.0, completion("", "length")),
                                             (0.0, usage(3, 7))])
    m = compute_metrics([r], r.latency)
    assert r.success and m.max_output_tokens_per_s == 5.0 and m.max_concurrent_requests == 1
    lines = format_metrics(m).splitlines()
    assert "Peak output token throughput (tok/s): 5.00" in [" ".join(x.split()) for x in lines]


def test_unknown_input_lengths_are_na_not_zero():
    ok = RequestResult(success=True, prompt_len=None, output_tokens=4, ttft=0.1, itl=[0.01] * 3, latency=0.13)
    m = compute_metrics([ok, RequestResult(success=True, prompt_len=7, output_tokens=2, ttft=0.1, latency=0.2)], 1.0)
    assert m.total_input_tokens is None and m.total_token_throughput is None and m.output_throughput == 6.0
    text = format_metrics(m)
    assert "Total input tokens:" in text and "n/a" in text
    assert m.vllm_keys()["mean_ttft_ms"] == pytest.approx(100.0) and m.vllm_keys()["duration"] == 1.0
