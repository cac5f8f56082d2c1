"""A decode node killed mid-stream (SIGKILL, real processes): the router resumes the stream on another node from the
tokens the client has, and the client's stream completes with no token repeated or lost, equal to a collocated
server's (float64: greedy and seeded identical). Behind `pdserve router` with P's first token off (replay) and on
(`--pd-first-token prefill`); the second kill leaves no D, so a prefill node resumes it. The surviving nodes'
pools are whole at the end. (Issue 37's migration, issue 35's "D killed after the first token was streamed".)"""
from __future__ import annotations

import json
import time

import httpx
import pytest

from tests.server_harness import RouterProcess, ServerProcess, free_port, kv_config, metric, wait_pools_whole
from tests.server_harness import F64_COMMON, cleanup_all

COMMON = F64_COMMON
PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n    return"
MAX_TOKENS = 420  # long enough that the node is still generating when it is killed


@pytest.fixture(scope="module")
def dep(qwen3_tiny, reference_f64):
    kv_port = free_port()
    d_kv = kv_config("kv_consumer", kv_peers=[f"127.0.0.1:{kv_port}"])
    s = {"P": ServerProcess(qwen3_tiny, *COMMON, "--kv-transfer-config", kv_config("kv_producer", kv_port=kv_port)),
         "D1": ServerProcess(qwen3_tiny, *COMMON, "--kv-transfer-config", d_kv),
         "D2": ServerProcess(qwen3_tiny, *COMMON, "--kv-transfer-config", d_kv),
         "C": reference_f64}
    routers = []
    try:
        for srv in s.values():
            srv.wait_healthy()
        for mode in ("replay", "prefill"):
            routers.append(RouterProcess([s["P"].url], [s["D1"].url, s["D2"].url], "--pd-first-token", mode))
            routers[-1].wait_healthy()
        s["replay"], s["prefill"] = routers
        yield s
    finally:
        cleanup_all(*routers, *(s[srv] for srv in ("P", "D1", "D2")))


def body_of(sampling: dict) -> dict:
    return {"model": "qwen3-tiny-s0", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, **sampling}


def read_stream(url: str, body: dict, on_tokens=None) -> tuple[str, list]:
    """(text, events); `on_tokens()` runs once, after the stream's fifth event with text."""
    text, evs, seen = "", [], 0
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            evs.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
            if isinstance(evs[-1], dict) and evs[-1].get("choices"):
                text += evs[-1]["choices"][0]["text"]
                seen += 1
                if seen == 5 and on_tokens is not None:
                    on_tokens()
    return text, evs


def serving_decode_node(router_url: str) -> str:
    nodes = httpx.get(router_url + "/nodes", timeout=5).json()["decode"]
    busy = [n["url"] for n in nodes if n["in_flight"]]
    assert len(busy) == 1, nodes
    return busy[0]


@pytest.mark.parametrize("stream", [True, False])
def test_a_resumed_request_on_a_collocated_server_goes_on_as_the_whole_run(dep, stream):
    """What the router sends the next node, straight to a node without a KV connector: the answer holds the resumed
    tokens' text and ids, then the same tokens as the unbroken run."""
    body = {"model": "qwen3-tiny-s0", "prompt": PROMPT, "max_tokens": 12, "ignore_eos": True, "temperature": 0.8,
            "seed": 5, "return_token_ids": True}
    whole = httpx.post(dep["C"].url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    resumed = {**body, "stream": stream, "kv_transfer_params": {"resume_token_ids": whole["token_ids"][:4]}}
    if stream:
        text, evs = read_stream(dep["C"].url, resumed)
        ids = [t for e in evs if isinstance(e, dict) and e.get("choices") for t in e["choices"][0]["token_ids"]]
    else:
        r = httpx.post(dep["C"].url + "/v1/completions", json=resumed, timeout=60)
        assert r.status_code == 200, r.text
        text, ids = r.json()["choices"][0]["text"], r.json()["choices"][0]["token_ids"]
    assert ids == whole["token_ids"] and text == whole["text"]


@pytest.mark.parametrize("extra,param", [({"resume_token_ids": [1, -2]}, "kv_transfer_params"),
                                         ({"resume_token_ids": [1] * 12}, "kv_transfer_params")])
def test_bad_resume_token_ids_are_a_400(dep, extra, param):
    r = httpx.post(dep["D1"].url + "/v1/completions", timeout=60, json={
        "model": "qwen3-tiny-s0", "prompt": PROMPT, "max_tokens": 12, "kv_transfer_params": extra})
    assert r.status_code == 400 and r.json()["error"]["param"] == param and "resume_token_ids" in r.text, r.text


def test_resume_with_logprobs_is_refused_on_a_whole_answer(dep):
    """A whole answer would lack the resumed tokens' logprobs (a resumed stream's client has them already)."""
    r = httpx.post(dep["C"].url + "/v1/completions", timeout=60, json={
        "model": "qwen3-tiny-s0", "prompt": PROMPT, "max_tokens": 12, "logprobs": 1,
        "kv_transfer_params": {"resume_token_ids": [1]}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer_params", r.text


@pytest.mark.parametrize("mode,sampling", [("replay", dict(temperature=0)),
                                           ("prefill", dict(temperature=0.9, top_p=0.95, seed=11,
                                                            presence_penalty=0.3))])
def test_a_decode_node_killed_mid_stream_is_migrated(dep, mode, sampling):
    want, _ = read_stream(dep["C"].url, body_of(sampling))
    router = dep[mode]
    killed = []

    def kill_the_serving_d():
        url = serving_decode_node(router.url)
        srv = next(dep[k] for k in ("D1", "D2") if dep[k].url == url)
        srv.kill()
        killed.append(srv)

    got, evs = read_stream(router.url, body_of(sampling), kill_the_serving_d)
    assert killed, "the stream ended before a decode node could be killed"
    assert not any("error" in e for e in evs if isinstance(e, dict)), [e for e in evs if "error" in e]
    assert evs[-1] == "[DONE]" and evs[-2]["usage"]["completion_tokens"] == MAX_TOKENS
    assert got == want  # every character once, in order: nothing repeated or lost
    assert metric(router.url, "pdserve_router_migrations_total", kind="stream") == 1
    alive = [dep["P"]] + [dep[k] for k in ("D1", "D2") if dep[k].proc.poll() is None]
    deadline = time.monotonic() + 10
    while any(httpx.get(router.url + "/nodes", timeout=5).json()["decode"][i]["in_flight"] for i in range(2)):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    wait_pools_whole(*alive)
