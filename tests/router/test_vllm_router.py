"""vLLM's Rust router (`vllm-router`, a test extra) in P/D mode in front of pdserve's P and D, unmodified: it relays
P's kv_transfer_params (with P's own proof) to D verbatim. Greedy outputs equal a collocated server's (D itself,
asked without params: it prefills locally), streamed and not; D's graph series show no `prefill` step for the
router's traffic; D takes every text prompt's ids from P's params (tokenize once) and tokenizes none of them; P's
leased blocks return to 0 after the traffic and right after D refuses a request. Also here,
on the same deployment: P's authentic but stale proofs (released, or past the lease) get 400 at D; a P and D with
different KV tokens are found by pdserve's router before traffic and answered 503 naming the mismatch."""
from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.server_harness import (REPO, RouterProcess, ServerProcess, _die_with_parent, complete,
                                  free_port, kv_config, kv_state, metric, metrics, wait_pools_whole)
from tests.server_harness import cleanup_all

VLLM_ROUTER = shutil.which("vllm-router") or str(Path(sys.executable).parent / "vllm-router")
pytestmark = pytest.mark.skipif(not os.access(VLLM_ROUTER, os.X_OK), reason="vllm-router is not installed")
LEASE = 6.0  # P's kv_lease_seconds: a release within 2 s is never the expiry; the stale test waits it out
COMMON = ("--kv-cache-memory-gb", "0.05", "--enable-debug-routes")
TOOK_PS_IDS = "prompt tokens (P's, not tokenized here)"  # D's log line of a request that took P's prompt ids
PROMPTS = ["def fibonacci(n):\n    if n < 2:\n        return n\n", "import numpy as np\nx = np.arange(",
           "The quick brown fox " * 6]


class VllmRouter:
    def __init__(self, prefill: str, decode: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [VLLM_ROUTER, "--vllm-pd-disaggregation", "--prefill", prefill, "none", "--decode", decode,
               "--host", "127.0.0.1", "--port", str(self.port), "--prometheus-host", "127.0.0.1",
               "--prometheus-port", str(free_port()), "--worker-startup-check-interval", "1", "--log-level", "warning"]
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=True, preexec_fn=_die_with_parent)

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"vllm-router exited with {self.proc.returncode}"
            try:  # it answers once its own start-up health checks of every node passed
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.3)
        raise TimeoutError("vllm-router not ready")

    def cleanup(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


@pytest.fixture(scope="module")
def dep(qwen3_tiny):
    kv_port = free_port()
    s = {"P": ServerProcess(qwen3_tiny, *COMMON, "--max-model-len", "1024", "--kv-transfer-config",
                            kv_config("kv_producer", kv_port=kv_port, kv_lease_seconds=LEASE)),
         "D": ServerProcess(qwen3_tiny, *COMMON, "--max-model-len", "256", "--kv-transfer-config",
                            kv_config("kv_consumer", kv_peers=[f"127.0.0.1:{kv_port}"])),
         # a D that was given another KV token: P's proofs cannot verify there
         "D_other": ServerProcess(qwen3_tiny, *COMMON, "--max-model-len", "256", "--kv-transfer-config",
                                  kv_config("kv_consumer", kv_peers=[f"127.0.0.1:{kv_port}"],
                                            kv_auth_token="another-token"))}
    routers = {}
    try:
        for srv in s.values():
            srv.wait_healthy()
        routers = {"vllm": VllmRouter(s["P"].url, s["D"].url),
                   "mismatch": RouterProcess([s["P"].url], [s["D_other"].url])}
        routers["vllm"].wait_ready()
        routers["mismatch"].wait_healthy()
        yield {**s, **routers}
    finally:
        cleanup_all(*routers.values(), *s.values())


def leased(dep) -> int:
    return kv_state(dep["P"])["leased_blocks"]


def wait_no_lease(dep, within: float = 2.0) -> None:
    t0 = time.monotonic()
    while (n := leased(dep)) > 0:
        assert time.monotonic() - t0 < within, f"P still holds {n} leased blocks {within} s on (lease {LEASE} s)"
        time.sleep(0.05)


def chat(url: str, stream: bool) -> str:
    body = {"model": "qwen3-tiny-s0", "messages": [{"role": "user", "content": PROMPTS[0]}], "max_tokens": 10,
            "temperature": 0, "ignore_eos": True, "stream": stream}
    if not stream:
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"]
    text = ""
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
    return text


def test_outputs_equal_collocated_and_decode_never_prefills(dep):
    router, d = dep["vllm"], dep["D"]
    before, handed = metrics(d.url), d.log().count(TOOK_PS_IDS)
    via = [complete(router.url, p, stream=s) for p in PROMPTS for s in (False, True)]
    via += [complete(router.url, [11, 22, 33, 44, 55, 66, 77])]  # a token-id prompt
    via_chat = [chat(router.url, s) for s in (False, True)]
    after = metrics(d.url)
    # tokenize once: every text prompt's ids came from P (relayed in its params), none was tokenized on D
    assert d.log().count(TOOK_PS_IDS) - handed == len(PROMPTS) * 2 + 2
    prefill_steps = [metric(m, "pdserve_cudagraph_steps_total", reason="prefill") for m in (before, after)]
    assert prefill_steps[1] == prefill_steps[0], "D prefilled for the router's traffic"
    received = [metric(m, "pdserve_kv_transfer_received_bytes_total") for m in (before, after)]
    assert received[1] > received[0], "no KV moved from P to D"
    # the collocated oracle: D itself, asked without params, prefills locally
    assert via == [complete(d.url, p, stream=s) for p in PROMPTS for s in (False, True)] + \
        [complete(d.url, [11, 22, 33, 44, 55, 66, 77])]
    assert via_chat == [chat(d.url, s) for s in (False, True)]
    wait_no_lease(dep)
    wait_pools_whole(dep["P"], d)


def same(a, b) -> bool:
    """Equal JSON, floats to 1e-12: vllm-router re-encodes the answers it merges, and its float parsing can move a
    float's last digit."""
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-12)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("fields", [{"n": 2, "temperature": 1.0, "seed": 7}, {"prompt": PROMPTS[:2]},
                                    {"echo": True, "logprobs": 1}, {"prompt_logprobs": 1}],
                         ids=["n", "batch", "echo-logprobs", "prompt-logprobs"])
def test_what_is_not_served_pd_is_served_by_d_alone(dep, fields):
    """vllm-router asks P first for every request: for n > 1, a batch and prompt logprobs P answers as a plain
    request without kv_transfer_params (a 400 before), so the router sends D the request without them and D
    prefills it: the answer is a collocated one, and P holds no lease."""
    body = {"model": "qwen3-tiny-s0", "prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0, **fields}
    r = httpx.post(dep["vllm"].url + "/v1/completions", json=body, timeout=60)
    c = httpx.post(dep["D"].url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200 and c.status_code == 200, (r.text, c.text)
    assert same(r.json()["choices"], c.json()["choices"])
    assert leased(dep) == 0
    wait_pools_whole(dep["P"], dep["D"])


def test_streaming_usage_through_vllm_router(dep):
    body = {"model": "qwen3-tiny-s0", "prompt": PROMPTS[1], "max_tokens": 5, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    usage = None
    with httpx.stream("POST", dep["vllm"].url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                usage = json.loads(line[6:]).get("usage") or usage
    assert usage and usage["completion_tokens"] == 5
    wait_no_lease(dep)


def test_decode_refusal_releases_the_lease_at_once(dep):
    """P accepts (the router asks it for one token), D refuses (its max_model_len is 256): D's own 400 goes back,
    and D's bare `done` ends P's lease long before its expiry."""
    r = httpx.post(dep["vllm"].url + "/v1/completions", timeout=60,
                   json={"model": "qwen3-tiny-s0", "prompt": PROMPTS[2], "max_tokens": 1000})
    assert r.status_code == 400 and "max_tokens" in r.text, r.text
    wait_no_lease(dep)
    wait_pools_whole(dep["P"], dep["D"])


def prefill_on_p(dep, prompt: str) -> dict:
    r = httpx.post(dep["P"].url + "/v1/completions", timeout=30, json={
        "model": "qwen3-tiny-s0", "prompt": prompt, "max_tokens": 1, "temperature": 0,
        "kv_transfer_params": {"do_remote_decode": True}})
    assert r.status_code == 200, r.text
    return r.json()["kv_transfer_params"]


def post_d(dep, prompt: str, params: dict) -> httpx.Response:
    return httpx.post(dep["D"].url + "/v1/completions", timeout=30, json={
        "model": "qwen3-tiny-s0", "prompt": prompt, "max_tokens": 4, "temperature": 0, "kv_transfer_params": params})


def test_stale_proofs_are_prefilled_on_d(dep):
    """Authentic params whose KV P no longer holds: used once already (P released the lease on D's `done`), or held
    past the lease (a D that stalled). D's load finds the KV gone (P answers `expired`) and D prefills the prompt
    itself: the same text, no client error, X-PD-KV-Unused; P's pool is whole. Extra fields beside P's (what a
    router might add) are accepted quietly."""
    from pdserve.serve.server_timing import KV_UNUSED_HEADER
    params = prefill_on_p(dep, PROMPTS[0])
    first = post_d(dep, PROMPTS[0], {**params, "router_added": 1})
    assert first.status_code == 200 and KV_UNUSED_HEADER not in first.headers
    wait_no_lease(dep)
    replay = post_d(dep, PROMPTS[0], params)
    assert replay.status_code == 200 and replay.headers.get(KV_UNUSED_HEADER) == "1", replay.text
    assert replay.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
    params = prefill_on_p(dep, PROMPTS[1])
    assert leased(dep) > 0
    time.sleep(LEASE + 0.5)
    late = post_d(dep, PROMPTS[1], params)
    assert late.status_code == 200 and late.headers.get(KV_UNUSED_HEADER) == "1", late.text
    wait_no_lease(dep)
    wait_pools_whole(dep["P"], dep["D"])


def test_kv_token_mismatch_is_a_deployment_error(dep):
    """pdserve's router probes P -> D_other before any traffic and answers 503 naming the mismatch (never D's 400);
    D_other's own 400 for P's params names the likely cause, and P's lease is released."""
    answers = []
    for _ in range(2):  # the first may come before the probe: D's refusal, answered 502; then the pair is out
        r = httpx.post(dep["mismatch"].url + "/v1/completions", timeout=30,
                       json={"model": "qwen3-tiny-s0", "prompt": PROMPTS[0], "max_tokens": 4})
        answers.append(r.status_code)
        assert r.status_code in (502, 503) and "KV token mismatch" in r.json()["error"]["message"], r.text
    assert answers[1] == 503
    wait_no_lease(dep)
    params = prefill_on_p(dep, PROMPTS[2])
    d = httpx.post(dep["D_other"].url + "/v1/completions", timeout=30, json={
        "model": "qwen3-tiny-s0", "prompt": PROMPTS[2], "max_tokens": 4, "kv_transfer_params": params})
    assert d.status_code == 400 and "token mismatch" in d.json()["error"]["message"], d.text
    release = httpx.post(dep["P"].url + "/v1/kv/release", json={"kv_transfer_params": params}, timeout=10)
    assert release.status_code == 200  # D_other dialed nothing for params it could not verify: still leased
    wait_no_lease(dep)
    wait_pools_whole(dep["P"], dep["D_other"])
