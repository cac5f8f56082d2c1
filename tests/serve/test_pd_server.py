"""P/D over HTTP: router + 1 P + 1 D (and a strict-rule D) on loopback, against a collocated server.

One deployment for the whole module; the destructive test (P killed) runs last."""
from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server_harness import (RouterProcess, ServerProcess, complete, free_port, kv_config, metric, metrics,
                                  wait_pools_whole)
from tests.server_harness import cleanup_all

PROMPTS = [f"def function_{i}(x):\n    " + "return x + 1\n" * (i % 5) + "#" * i for i in range(16)]


@pytest.fixture(scope="module")
def deployment(qwen3_tiny):
    kv_port = free_port()
    common = ("--max-model-len", "512", "--kv-cache-memory-gb", "0.05", "--enable-debug-routes")
    servers = {
        "P": ServerProcess(qwen3_tiny, *common, "--kv-transfer-config", kv_config("kv_producer", kv_port=kv_port)),
        "D": ServerProcess(qwen3_tiny, *common, "--kv-transfer-config",
                           kv_config("kv_consumer", kv_peers=[f"127.0.0.1:{kv_port}"])),
        "D_strict": ServerProcess(qwen3_tiny, *common, "--full-graph-rule", "strict", "--kv-transfer-config",
                                  kv_config("kv_consumer", kv_peers=[f"127.0.0.1:{kv_port}"])),
        "C": ServerProcess(qwen3_tiny, *common),
    }
    routers = {}
    try:
        for s in servers.values():
            s.wait_healthy()
        routers["R"] = RouterProcess([servers["P"].url], [servers["D"].url])
        routers["R_strict"] = RouterProcess([servers["P"].url], [servers["D_strict"].url])
        for r in routers.values():
            r.wait_healthy()
        yield {**servers, **routers}
    finally:
        cleanup_all(*routers.values(), *servers.values())


def graph_steps(server) -> dict:
    text = httpx.get(server.url + "/metrics", timeout=5).text
    out = {}
    for fam in text_string_to_metric_families(text):
        if fam.name == "pdserve_cudagraph_steps":
            for s in fam.samples:
                if s.name.endswith("_total"):
                    out[(s.labels["mode"], s.labels["reason"])] = s.value
    return out


def test_router_outputs_equal_collocated(deployment):
    r, c = deployment["R"], deployment["C"]
    for i, prompt in enumerate(PROMPTS):
        stream = i % 2 == 1
        assert complete(r.url, prompt, stream) == complete(c.url, prompt, stream), prompt
    wait_pools_whole(deployment["P"], deployment["D"])


def test_prompt_tokens_by_source(deployment):
    """D computes only each request's last prompt token (its replay); the rest came from P, which has nothing
    external. Fresh 37-token prompts (2 blocks + 5): no prefix hit anywhere."""
    P, D = deployment["P"], deployment["D"]
    names = {src: ("vllm:prompt_tokens_by_source_total", {"source": src})
             for src in ("local_compute", "local_cache_hit", "external_kv_transfer")}
    names["all"], names["cached"] = ("vllm:prompt_tokens_total", {}), ("vllm:prompt_tokens_cached_total", {})
    names["kv_computed"] = ("vllm:request_prefill_kv_computed_tokens_sum", {})
    names["step_tokens"] = ("vllm:iteration_tokens_total_sum", {})
    names["ext_queries"] = ("vllm:external_prefix_cache_queries_total", {})
    names["ext_hits"] = ("vllm:external_prefix_cache_hits_total", {})

    def counts(node):
        m = metrics(node.url)
        return {k: metric(m, name, **labels) for k, (name, labels) in names.items()}
    before = {n: counts(n) for n in (P, D)}
    for i in range(2):
        body = {"model": "qwen3-tiny-s0", "prompt": [4000 + 97 * i + j for j in range(37)], "max_tokens": 3,
                "temperature": 0}
        assert httpx.post(deployment["R"].url + "/v1/completions", json=body, timeout=60).status_code == 200
    d, p = ({k: v - before[n][k] for k, v in counts(n).items()} for n in (D, P))
    # D's steps: each replay computes 1 prompt token, then 3 tokens are generated; P's: 37 + its one token
    assert d == {"local_compute": 2, "local_cache_hit": 0, "external_kv_transfer": 72, "all": 74, "cached": 72,
                 "kv_computed": 2, "step_tokens": 2 * (1 + 3), "ext_queries": 74, "ext_hits": 72}, d
    assert p == {"local_compute": 74, "local_cache_hit": 0, "external_kv_transfer": 0, "all": 74, "cached": 0,
                 "kv_computed": 74, "step_tokens": 2 * (37 + 1), "ext_queries": 74, "ext_hits": 0}, p
    wait_pools_whole(P, D)


def test_chat_through_router(deployment):
    body = {"model": "qwen3-tiny-s0", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 8,
            "temperature": 0}
    a = httpx.post(deployment["R"].url + "/v1/chat/completions", json=body, timeout=60).json()
    b = httpx.post(deployment["C"].url + "/v1/chat/completions", json=body, timeout=60).json()
    assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"]


def test_decode_graph_series_by_rule(deployment):
    for prompt in PROMPTS[:6]:
        complete(deployment["R_strict"].url, prompt)
    default = graph_steps(deployment["D"])
    strict = graph_steps(deployment["D_strict"])
    assert default.get(("PIECEWISE", "prefill"), 0) + default.get(("NONE", "prefill"), 0) == 0, default
    assert strict.get(("PIECEWISE", "prefill"), 0) > 0, strict
    assert default.get(("FULL", "none"), 0) > 0


def test_poisson_burst_loses_nothing(deployment):
    rng = random.Random(3)
    r = deployment["R"]

    def one(i):
        return complete(r.url, PROMPTS[i % 16] + str(i), stream=i % 3 == 0, max_tokens=6)

    delays = [rng.expovariate(40.0) for _ in range(64)]
    with ThreadPoolExecutor(64) as pool:
        futures = []
        for i, d in enumerate(delays):
            time.sleep(d)
            futures.append(pool.submit(one, i))
        texts = [f.result(timeout=120) for f in futures]
    assert len(texts) == 64 and all(isinstance(t, str) for t in texts)
    wait_pools_whole(deployment["P"], deployment["D"])


def test_forged_params_straight_to_d_get_400(deployment):
    d = deployment["D"]
    forged = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 1, "transfer_id": "x",
              "num_prompt_tokens": 3, "prompt_hash": "0" * 64}
    r = httpx.post(d.url + "/v1/completions", json={"model": "qwen3-tiny-s0", "prompt": "abc", "max_tokens": 2,
                                                   "kv_transfer_params": forged}, timeout=30)
    assert r.status_code == 400 and "proof does not verify" in r.json()["error"]["message"]
    c = deployment["C"]
    r = httpx.post(c.url + "/v1/completions", json={"model": "qwen3-tiny-s0", "prompt": "abc", "max_tokens": 2,
                                                   "kv_transfer_params": {"do_remote_decode": True}}, timeout=30)
    assert r.status_code == 400


def test_n_choices_through_the_router(deployment):
    """n = 2 through the router: not served P/D, so the router sends it to D alone, which serves both choices
    itself (after the graph-series test: D prefills here); sent straight to D with P/D params, n > 1 is a 400
    naming n."""
    body = {"model": "qwen3-tiny-s0", "prompt": "def g(y):", "n": 2, "max_tokens": 4, "temperature": 1.0,
            "seed": 9}
    p_served = metric(deployment["P"].url, "vllm:request_success_total")
    r = httpx.post(deployment["R"].url + "/v1/completions", json=body, timeout=60)
    assert metric(deployment["P"].url, "vllm:request_success_total") == p_served  # P was not asked
    c = httpx.post(deployment["C"].url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200 and c.status_code == 200, (r.text, c.text)
    assert [x["text"] for x in r.json()["choices"]] == [x["text"] for x in c.json()["choices"]]
    d = httpx.post(deployment["D"].url + "/v1/completions", timeout=30,
                   json={**body, "kv_transfer_params": {"do_remote_prefill": True}})
    assert d.status_code == 400 and d.json()["error"]["param"] == "n", d.text
    wait_pools_whole(deployment["P"], deployment["D"])


@pytest.mark.parametrize("fields,param", [({"prompt": ["def g(y):", [5, 6, 7]]}, "prompt"),
                                          ({"prompt": "def g(y):", "echo": True, "logprobs": 1}, "prompt_logprobs"),
                                          ({"prompt": "def g(y):", "prompt_logprobs": 0}, "prompt_logprobs")],
                         ids=["batch", "echo-logprobs", "prompt-logprobs"])
def test_a_prompt_batch_or_prompt_logprobs_through_the_router(deployment, fields, param):
    """A completions batch (a list of prompts) and prompt logprobs (echo with logprobs too) are not served P/D
    either: the router sends them to D alone, whose choices equal collocated ones; sent straight to D with P/D
    params they are a 400 naming the field; sent to P for a P/D prefill, P serves them plain, without params."""
    body = {"model": "qwen3-tiny-s0", "max_tokens": 4, "temperature": 0.0, **fields}
    p_served = metric(deployment["P"].url, "vllm:request_success_total")
    r = httpx.post(deployment["R"].url + "/v1/completions", json=body, timeout=60)
    assert metric(deployment["P"].url, "vllm:request_success_total") == p_served  # P was not asked
    c = httpx.post(deployment["C"].url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200 and c.status_code == 200, (r.text, c.text)
    assert r.json()["choices"] == c.json()["choices"]
    d = httpx.post(deployment["D"].url + "/v1/completions", timeout=30,
                   json={**body, "kv_transfer_params": {"do_remote_prefill": True}})
    assert d.status_code == 400 and d.json()["error"]["param"] == param, d.text
    # asked for a P/D prefill (vllm-router asks P first for everything), P serves it plain and names no KV to read
    p = httpx.post(deployment["P"].url + "/v1/completions", timeout=30,
                   json={**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
    assert p.status_code == 200 and "kv_transfer_params" not in p.json(), p.text
    assert all("prompt_logprobs" not in ch for ch in p.json()["choices"])
    for _ in range(2):  # P's own prefix-cache hit is not named: vllm-router would put it in D's usage
        again = httpx.post(deployment["P"].url + "/v1/completions", timeout=30, json={
            "prompt": "def g(y):\n" * 20, "n": 2, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
        assert again.status_code == 200 and "prompt_tokens_details" not in again.json()["usage"], again.text
    wait_pools_whole(deployment["P"], deployment["D"])


def test_router_relays_what_every_node_answers_alike(deployment):
    """/tokenize, /detokenize, /v1/models and /version through pdserve's router are a decode node's answers; an
    unknown route is a 404 in OpenAI's error shape."""
    r, d = deployment["R"].url, deployment["D"].url
    for method, path, body in (("POST", "/tokenize", {"prompt": "def f(x):", "return_token_strs": True}),
                               ("POST", "/detokenize", {"tokens": [5, 6, 7]}), ("GET", "/v1/models", None),
                               ("GET", "/version", None), ("POST", "/tokenize", {"prompt": 5})):
        via, direct = (httpx.request(method, u + path, json=body, timeout=30) for u in (r, d))
        assert (via.status_code, via.json()) == (direct.status_code, direct.json()), path
    missing = httpx.get(r + "/v1/nope", timeout=30)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == 404, missing.text


def test_zz_prefill_node_gone_requests_still_complete(deployment):
    """Last: P is killed; the router takes it out and sends requests to D alone, which prefills locally."""
    deployment["P"].kill()
    time.sleep(1.0)
    r, c = deployment["R"], deployment["C"]
    for prompt in PROMPTS[:3]:
        assert complete(r.url, prompt) == complete(c.url, prompt)
    wait_pools_whole(deployment["D"])
