"""The first token from P over HTTP: P, D and a collocated server (float64) behind `pdserve router --pd-first-token
prefill`. Completions and chat, streamed and whole, greedy and seeded, with logprobs, equal the collocated server's
answers; a stop string across the first token's text; a first token that ends the request never reaches D; D's
first step is a decode (no prefill row even under the strict rule, where a replay is one); every pool whole at the
end."""
from __future__ import annotations

import json

import httpx
import pytest

from pdserve.serve.handoff import PROOF_HEADER, handoff_proof
from tests.server_harness import RouterProcess, ServerProcess, free_port, kv_config, metric, \
    wait_pools_whole
from tests.server_harness import F64_COMMON, cleanup_all

COMMON = F64_COMMON
PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n    return"


@pytest.fixture(scope="module")
def dep(qwen3_tiny, reference_f64):
    kv_port = free_port()
    s = {"P": ServerProcess(qwen3_tiny, *COMMON, "--kv-transfer-config", kv_config("kv_producer", kv_port=kv_port)),
         # strict: a replay of the last prompt token would count as a prefill step here, a decode of P's token not
         "D": ServerProcess(qwen3_tiny, *COMMON, "--full-graph-rule", "strict", "--kv-transfer-config",
                            kv_config("kv_consumer", kv_peers=[f"127.0.0.1:{kv_port}"])),
         "C": reference_f64}
    router = None
    try:
        for srv in s.values():
            srv.wait_healthy()
        # early decode: the streamed requests' D is asked while P prefills (test_y_streams_went_...)
        router = RouterProcess([s["P"].url], [s["D"].url], "--pd-first-token", "prefill", "--pd-early-decode")
        router.wait_healthy()
        s["R"] = router
        yield s
    finally:
        cleanup_all(router, *(s[srv] for srv in ("P", "D")))


def ask(url, chat, stream, **extra):
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = {"model": "qwen3-tiny-s0", "max_tokens": 10, "stream": stream, **extra}
    body |= {"messages": [{"role": "user", "content": PROMPT}]} if chat else {"prompt": PROMPT}
    if not stream:
        r = httpx.post(url + path, json=body, timeout=60)
        assert r.status_code == 200, r.text
        c = r.json()["choices"][0]
        text = c["message"]["content"] if chat else c["text"]
        lp = c.get("logprobs")
        entries = (lp or {}).get("content") if chat else (lp or {}).get("token_logprobs")
        return text, c["finish_reason"], entries
    text, fr, entries, roles = "", None, [], 0
    with httpx.stream("POST", url + path, json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            assert "error" not in obj, obj
            for c in obj["choices"]:
                if chat:
                    roles += "role" in c["delta"]
                    text += c["delta"].get("content") or ""
                    entries += (c.get("logprobs") or {}).get("content") or []
                else:
                    text += c["text"]
                    entries += (c.get("logprobs") or {}).get("token_logprobs") or []
                fr = c.get("finish_reason") or fr
    assert roles == (1 if chat else 0)
    return text, fr, entries or None


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=0.9, seed=42, logprobs=2),
                                      dict(temperature=0.8, seed=7, presence_penalty=0.6, min_tokens=3)])
def test_router_first_token_equals_collocated(dep, chat, stream, sampling):
    if chat and "logprobs" in sampling:
        sampling = {**sampling, "logprobs": True, "top_logprobs": 2}
    want = ask(dep["C"].url, chat, False, **sampling)
    got = ask(dep["R"].url, chat, stream, **sampling)
    assert got == want


def test_stop_string_across_the_first_token_streamed(dep):
    tok = httpx.post(dep["C"].url + "/tokenize", json={"model": "qwen3-tiny-s0", "prompt": PROMPT}).json()
    assert tok["tokens"]
    plain = httpx.post(dep["C"].url + "/v1/completions", json={"model": "qwen3-tiny-s0", "prompt": PROMPT,
                                                               "max_tokens": 4, "temperature": 0,
                                                               "return_token_ids": True}, timeout=60).json()
    ids = plain["choices"][0]["token_ids"]
    texts = [httpx.post(dep["C"].url + "/detokenize", json={"model": "qwen3-tiny-s0", "tokens": [t]}).json()["prompt"]
             for t in ids[:2]]
    if not (texts[0] and texts[1]):
        pytest.skip("the first two tokens need text for this oracle")
    stop = texts[0][-1] + texts[1][0]
    want = ask(dep["C"].url, False, False, temperature=0, stop=[stop])
    assert ask(dep["R"].url, False, True, temperature=0, stop=[stop]) == want


def test_first_token_that_ends_it_never_reaches_d(dep):
    before = metric(dep["D"].url, "vllm:request_success_total")
    for stream in (False, True):
        want = ask(dep["C"].url, False, False, temperature=0, max_tokens=1)
        assert ask(dep["R"].url, False, stream, temperature=0, max_tokens=1) == want
    assert metric(dep["D"].url, "vllm:request_success_total") == before


def test_d_observes_queue_and_prompt_sources_of_first_token_requests(dep):
    """D's /metrics for requests that came with P's token: their queue (the KV wait in it) and first step are
    observed once each, at D's first own step, and their prompt is counted as imported or cached, never as computed
    on D (it was not): the admission record, which carries P's token, knows neither."""
    d = dep["D"].url
    names = ("vllm:request_queue_time_seconds_count", "vllm:request_prefill_time_seconds_count")
    before = {n: metric(d, n) for n in names}
    sources = {s: metric(d, "vllm:prompt_tokens_by_source_total", source=s)
               for s in ("local_compute", "local_cache_hit", "external_kv_transfer")}
    tokens = metric(d, "vllm:prompt_tokens_total")
    for stream in (False, True):
        ask(dep["R"].url, False, stream, temperature=0, max_tokens=5)
    n = (metric(d, "vllm:prompt_tokens_total") - tokens) / 2
    assert n > 1
    assert {k: metric(d, k) - v for k, v in before.items()} == {k: 2 for k in names}
    grew = {s: metric(d, "vllm:prompt_tokens_by_source_total", source=s) - v for s, v in sources.items()}
    assert grew["local_compute"] == 0 and grew["local_cache_hit"] + grew["external_kv_transfer"] == 2 * n, grew


def test_y_streams_went_to_a_d_asked_while_p_prefilled(dep):
    """Early decode (serve/handoff.py, router/early_decode.py): every streamed P/D request above was answered by the
    D the router asked while P prefilled; the first tokens that ended their request dropped theirs."""
    streamed = metric(dep["R"].url, "pdserve_router_early_decode_total", outcome="streamed")
    assert streamed >= 7 and metric(dep["R"].url, "pdserve_router_early_decode_total", outcome="replaced") == 0
    assert metric(dep["R"].url, "pdserve_router_early_decode_total", outcome="dropped") >= 1
    # once D learnt P's KV endpoint over HTTP, its engine awaited P's params on P's KV channel (channel/handoffs.py)
    direct = dep["D"].log().count("awaited on its KV channel")
    assert 5 <= direct <= streamed, (direct, streamed)


def test_y_handoff_route_and_await_edges(dep):
    key = "0123456789abcdef0123456789abcdef"
    p, d = dep["P"].url, dep["D"].url
    assert httpx.get(p + "/v1/kv/handoff/XYZ", timeout=10).status_code == 400
    r = httpx.get(p + f"/v1/kv/handoff/{key}", headers={PROOF_HEADER: handoff_proof("another token", key)}, timeout=10)
    assert r.status_code == 403 and PROOF_HEADER in r.json()["error"]["message"]
    body = {"model": "qwen3-tiny-s0", "prompt": PROMPT, "max_tokens": 4, "stream": True}
    far = {**body, "kv_transfer_params": {"await_prefill": {"url": "http://10.1.2.3:9", "key": key}}}
    r = httpx.post(d + "/v1/completions", json=far, timeout=10)  # never dialled: not one of D's kv_peers
    assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer_params"
    assert "10.1.2.3" in r.json()["error"]["message"]
    mine = {**body, "kv_transfer_params": {"await_kv": {"host": "127.0.0.1", "port": 9, "key": key}}}
    r = httpx.post(d + "/v1/completions", json=mine, timeout=10)  # D's server's own, never a client's
    assert r.status_code == 400 and "await_prefill" in r.json()["error"]["message"]
    # P's first token ends its request: P hands nothing over, and the D that waits answers 409 (no KV taken)
    ended = {"model": "qwen3-tiny-s0", "prompt": PROMPT, "max_tokens": 1, "temperature": 0,
             "kv_transfer_params": {"do_remote_decode": True, "first_token": True, "handoff_key": key}}
    r = httpx.post(p + "/v1/completions", json=ended, timeout=60)
    assert r.status_code == 200 and "kv_transfer_params" not in r.json()
    waiting = {**body, "kv_transfer_params": {"await_prefill": {"url": p, "key": key}}}
    r = httpx.post(d + "/v1/completions", json=waiting, timeout=60)
    assert r.status_code == 409 and "handed nothing over" in r.json()["error"]["message"]
    wait_pools_whole(dep["P"], dep["D"])


def test_zz_d_ran_no_prefill_row_and_pools_whole(dep):
    m = httpx.get(dep["D"].url + "/metrics", timeout=10).text
    prefill_rows = [line for line in m.splitlines() if "reason=\"prefill\"" in line and not line.startswith("#")]
    assert all(float(line.rsplit(" ", 1)[1]) == 0 for line in prefill_rows), prefill_rows
    assert metric(dep["D"].url, "pdserve_cudagraph_steps_total", mode="FULL") > 0
    wait_pools_whole(dep["P"], dep["D"], dep["C"])
