"""P/D over HTTP: router + 1 P + 1 D (and a strict-rule D) on loopback, against a collocated server.

One deployment for the whole module; the destructive test (P killed) runs last."""
from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server_harness import REPO, ServerProcess, free_port, group_alive

TOKEN = "pd-test-token"
PROMPTS = [f"def function_{i}(x):\n    " + "return x + 1\n" * (i % 5) + "#" * i for i in range(16)]


class RouterProcess:
    def __init__(self, prefill: list[str], decode: list[str], *args: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "pdserve.cli", "router", "--port", str(self.port), "--prefill", *prefill,
               "--decode", *decode, "--kv-auth-token", TOKEN, "--health-interval", "0.3", *args]
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=True)

    def wait_healthy(self, timeout=60.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise TimeoutError("router not healthy")

    def cleanup(self):
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        assert not group_alive(self.proc.pid) or self.proc.poll() is not None


def kv_config(role: str, **extra) -> str:
    return json.dumps({"kv_connector": "TcpConnector", "kv_role": role, "kv_auth_token": TOKEN,
                       "kv_transfer_timeout": 1.5, **extra})


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
        for r in routers.values():
            r.cleanup()
        for s in servers.values():
            s.cleanup()


def complete(url: str, prompt, stream: bool = False, max_tokens: int = 12, **extra):
    body = {"model": "qwen3-tiny-s0", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": stream, **extra}
    if not stream:
        r = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]
    text = ""
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += json.loads(line[6:])["choices"][0]["text"]
    return text


def kv_state(server) -> dict:
    return httpx.get(server.url + "/debug/kv", timeout=5).json()


def wait_pools_whole(*servers, timeout=10.0):
    deadline = time.monotonic() + timeout
    while True:
        states = [kv_state(s) for s in servers]
        if all(s["used_blocks"] == 0 and s["invariants_ok"] for s in states) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    for s in states:
        assert s["invariants_ok"] and s["used_blocks"] == 0, s


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
    assert r.status_code == 400 and "router proof" in r.json()["error"]["message"]
    c = deployment["C"]
    r = httpx.post(c.url + "/v1/completions", json={"model": "qwen3-tiny-s0", "prompt": "abc", "max_tokens": 2,
                                                   "kv_transfer_params": {"do_remote_decode": True}}, timeout=30)
    assert r.status_code == 400


def test_zz_prefill_node_gone_requests_still_complete(deployment):
    """Last: P is killed; the router takes it out and sends requests to D alone, which prefills locally."""
    deployment["P"].kill()
    time.sleep(1.0)
    r, c = deployment["R"], deployment["C"]
    for prompt in PROMPTS[:3]:
        assert complete(r.url, prompt) == complete(c.url, prompt)
    wait_pools_whole(deployment["D"])
