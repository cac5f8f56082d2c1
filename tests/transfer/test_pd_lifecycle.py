"""P/D over HTTP with 2 P + 2 D behind two routers (round-robin, least-loaded): load spread, the router's TTFT split,
a client abort mid-decode and while D waits for KV, D's full prefix hit, P draining open leases on SIGTERM, P
restarted on the same address, and a drain that times out. One deployment for the module (float64, so greedy tokens do
not depend on how requests were batched); the tests run in file order and the later ones stop and restart P2. Each
ends with every pool whole."""
from __future__ import annotations

import itertools
import json
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from pdserve.router.nodes import Pool
from pdserve.serve.server_timing import parse_server_timing
from pdserve.transfer.channel.proof import sign_params
from pdserve.transfer.channel.proof import prompt_hash
from tests.server_harness import (KV_TOKEN, RouterProcess, ServerProcess, complete, free_port, kv_config, kv_state,
                                  metric, metrics, wait_pools_whole)
from tests.server_harness import F64_COMMON, cleanup_all

PROMPTS = [f"class Node{i}:\n    def __init__(self):\n" + "        self.x = 1\n" * (i % 4) + "#" * i for i in range(12)]
STAGES = ("router_to_prefill", "prefill", "kv_transfer", "decode_queue", "first_token", "total")
COMMON = F64_COMMON


@pytest.fixture(scope="module")
def dep(qwen3_tiny, reference_f64):
    kv_ports = [free_port(), free_port()]
    peers = [f"127.0.0.1:{p}" for p in kv_ports]
    s = {f"P{i + 1}": ServerProcess(qwen3_tiny, *COMMON, "--shutdown-timeout", "8", "--kv-transfer-config",
                                    kv_config("kv_producer", kv_port=port, engine_id=f"P{i + 1}"))
         for i, port in enumerate(kv_ports)}
    s.update({f"D{i}": ServerProcess(qwen3_tiny, *COMMON, "--kv-transfer-config",
                                     kv_config("kv_consumer", kv_peers=peers)) for i in (1, 2)})
    s["C"] = reference_f64
    routers = {}
    try:
        for srv in s.values():
            srv.wait_healthy()
        p_urls, d_urls = [s["P1"].url, s["P2"].url], [s["D1"].url, s["D2"].url]
        routers = {"round-robin": RouterProcess(p_urls, d_urls),
                   "least-loaded": RouterProcess(p_urls, d_urls, "--policy", "least-loaded")}
        for r in routers.values():
            r.wait_healthy()
        s["routers"] = routers
        yield s
    finally:
        cleanup_all(*routers.values(), *(s[name] for name in ("P1", "P2", "D1", "D2")))


def pools_whole(dep, *names):
    wait_pools_whole(*(dep[n] for n in names or ("P1", "P2", "D1", "D2")))


def served(dep, name) -> float:
    return metric(dep[name].url, "vllm:request_success_total")


def kv_failures(dep, *names) -> float:
    return sum(metric(dep[n].url, "pdserve_kv_transfer_failures_total") for n in names)


def reference(dep, prompt, max_tokens=8) -> str:
    return complete(dep["C"].url, prompt, max_tokens=max_tokens)


def test_router_units():
    assert parse_server_timing("queue;dur=1.5, kv_transfer;dur=20, x;desc=y, ttft;dur=bad") == \
        {"queue": 0.0015, "kv_transfer": 0.02}
    pool = Pool([type("N", (), {"healthy": True, "in_flight": 0})() for _ in range(3)], "least-loaded")
    assert len({id(pool.pick()) for _ in range(3)}) == 3  # idle nodes are taken in turn, not always the first
    pool.nodes[1].in_flight = 1
    assert all(pool.pick() is not pool.nodes[1] for _ in range(4))


@pytest.mark.parametrize("policy", ["round-robin", "least-loaded"])
def test_2p2d_spreads_load(dep, policy):
    router = dep["routers"][policy]
    before = {n: served(dep, n) for n in ("P1", "P2", "D1", "D2")}
    received = sum(metric(dep[d].url, "pdserve_kv_transfer_received_bytes_total") for d in ("D1", "D2"))
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        texts = list(pool.map(lambda i: complete(router.url, PROMPTS[i], stream=i % 2 == 1, max_tokens=8),
                              range(len(PROMPTS))))
    assert texts == [reference(dep, p) for p in PROMPTS]
    counts = {n: served(dep, n) - before[n] for n in before}
    assert all(c > 0 for c in counts.values()), counts
    assert counts["P1"] + counts["P2"] == counts["D1"] + counts["D2"] == len(PROMPTS), counts
    assert sum(metric(dep[d].url, "pdserve_kv_transfer_received_bytes_total") for d in ("D1", "D2")) > received
    nodes = httpx.get(router.url + "/nodes", timeout=5).json()
    assert all(n["in_flight"] == 0 for n in nodes["prefill"] + nodes["decode"]), nodes
    pools_whole(dep)


def test_router_ttft_breakdown(dep):
    router = dep["routers"]["round-robin"]

    def hist(stat):
        m = metrics(router.url)
        return {st: metric(m, f"pdserve_router_ttft_seconds_{stat}", stage=st) for st in STAGES}

    counts, sums = hist("count"), hist("sum")
    assert metric(router.url, "process_resident_memory_bytes") > 0  # the router process's own
    for stream in (False, True):
        assert complete(router.url, PROMPTS[3], stream=stream) == reference(dep, PROMPTS[3], 12)
    new_counts, new_sums = hist("count"), hist("sum")
    assert all(new_counts[st] - counts[st] == 2 for st in STAGES), (counts, new_counts)
    added = {st: new_sums[st] - sums[st] for st in STAGES}
    assert added["prefill"] > 0 and added["kv_transfer"] > 0 and added["first_token"] > 0, added
    assert abs(sum(added[st] for st in STAGES[:-1]) - added["total"]) < 0.005, added  # the stages add up
    # The nodes' own report: P's answer and D's held stream headers carry Server-Timing.
    body = {"model": "qwen3-tiny-s0", "prompt": PROMPTS[4], "max_tokens": 1, "temperature": 0,
            "kv_transfer_params": {"do_remote_decode": True}}
    r = httpx.post(dep["P1"].url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 200 and "prefill;dur=" in r.headers["server-timing"], r.headers
    params = r.json()["kv_transfer_params"]  # signed by P
    with httpx.stream("POST", dep["D1"].url + "/v1/completions", timeout=30,
                      json={**body, "max_tokens": 4, "stream": True, "kv_transfer_params": params}) as r:
        timing = r.headers["server-timing"]
        assert r.status_code == 200 and "kv_transfer;dur=" in timing and "queue;dur=" in timing, timing
        chunks = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: ") and x != "data: [DONE]"]
    assert "".join(c["choices"][0]["text"] for c in chunks) == reference(dep, PROMPTS[4], 4)
    pools_whole(dep)


def test_client_abort_mid_decode_through_router(dep):
    router = dep["routers"]["round-robin"]
    aborts = sum(metric(dep[d].url, "vllm:request_success_total", finished_reason="abort") for d in ("D1", "D2"))
    body = {"model": "qwen3-tiny-s0", "prompt": PROMPTS[5], "max_tokens": 400, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        got = list(itertools.islice((x for x in r.iter_lines() if x.startswith("data: ")), 3))
    assert len(got) == 3  # the client closed after 3 chunks, the request still decoding on D
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        now = sum(metric(dep[d].url, "vllm:request_success_total", finished_reason="abort") for d in ("D1", "D2"))
        if now > aborts:
            break
        time.sleep(0.1)
    assert now == aborts + 1
    assert sum(metric(dep[d].url, "vllm:generation_tokens_total") for d in ("D1", "D2")) > 0
    pools_whole(dep)  # D freed the request; P's lease was confirmed by D's pull before decoding began


def prefill_directly(p, prompt) -> dict:
    """Step 1 by hand: P prefills and keeps the KV under a lease; the params come back signed, as the router would."""
    r = httpx.post(p.url + "/v1/completions", timeout=30, json={
        "model": "qwen3-tiny-s0", "prompt": prompt, "max_tokens": 1, "temperature": 0, "ignore_eos": True,
        "kv_transfer_params": {"do_remote_decode": True}})
    assert r.status_code == 200, r.text
    return r.json()["kv_transfer_params"]  # signed by P


def decode_directly(d, prompt, params, max_tokens=8) -> str:
    return complete(d.url, prompt, stream=True, max_tokens=max_tokens, kv_transfer_params=params)


def test_full_prefix_hit_on_decode_still_frees_lease(dep):
    """D already holds the whole prompt (33 tokens: its first 32 fill two blocks): it pulls nothing, but still tells
    P `done`, so P's lease ends now instead of at its expiry."""
    p1, d1 = dep["P1"], dep["D1"]
    prompt = PROMPTS[7]
    assert decode_directly(d1, prompt, prefill_directly(p1, prompt)) == reference(dep, prompt)
    received = metric(d1.url, "pdserve_kv_transfer_received_bytes_total")
    assert decode_directly(d1, prompt, prefill_directly(p1, prompt)) == reference(dep, prompt)
    assert metric(d1.url, "pdserve_kv_transfer_received_bytes_total") == received
    pools_whole(dep)


def test_prefill_sigterm_serves_open_leases(dep):
    p2, d1 = dep["P2"], dep["D1"]
    params = prefill_directly(p2, PROMPTS[6])
    assert kv_state(p2)["leased_blocks"] > 0
    received, failures = metric(d1.url, "pdserve_kv_transfer_received_bytes_total"), kv_failures(dep, "D1")
    p2.proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    assert p2.proc.poll() is None, "P exited with a lease open"
    t0 = time.monotonic()
    assert decode_directly(d1, PROMPTS[6], params) == reference(dep, PROMPTS[6])
    assert p2.proc.wait(8) == 0
    assert time.monotonic() - t0 < 4, "P waited for its drain timeout, not for the lease to end"
    assert metric(d1.url, "pdserve_kv_transfer_received_bytes_total") > received  # pulled, not recomputed
    assert kv_failures(dep, "D1") == failures
    log = p2.log()
    assert "waiting up to" in log and "1 open KV lease(s)" in log and "all KV leases ended" in log, log[-3000:]
    assert "engine stopped: 0 KV blocks in use (0 leased), invariants ok" in log, log[-3000:]
    pools_whole(dep, "P1", "D1", "D2")


def test_prefill_restart_same_address(dep, qwen3_tiny):
    """P2 comes back on the same HTTP and KV ports: the routers put it back and D pulls from the new process (D
    dials a fresh connection per transfer, so nothing stale is cached)."""
    old = dep["P2"]
    assert old.proc.poll() is not None
    old.cleanup()
    args = list(old.args)
    args[args.index("--shutdown-timeout") + 1] = "1.5"  # for the drain-timeout test that follows
    dep["P2"] = p2 = ServerProcess(qwen3_tiny, *args, port=old.port)
    p2.wait_healthy()
    router = dep["routers"]["round-robin"]
    deadline = time.monotonic() + 10
    while not all(n["healthy"] for n in httpx.get(router.url + "/nodes", timeout=5).json()["prefill"]):
        assert time.monotonic() < deadline, "the router did not put the restarted P back"
        time.sleep(0.1)
    failures = kv_failures(dep, "D1", "D2")
    for i in range(4):  # round-robin: two of these go to the restarted P2
        assert complete(router.url, PROMPTS[7 + i], stream=i % 2 == 0, max_tokens=8) == reference(dep, PROMPTS[7 + i])
    assert served(dep, "P2") >= 2
    assert metric(p2.url, "pdserve_kv_transfer_sent_bytes_total") > 0  # D read the KV from the new P2
    assert kv_failures(dep, "D1", "D2") == failures
    pools_whole(dep)


def test_zz_drain_timeout_drops_unclaimed_lease(dep):
    """Last: P2 (drain timeout 1.5 s) is stopped with a lease no D claims; it waits out the timeout, exits 0, and a
    late D finds it gone and recomputes the prompt itself."""
    p2, d2 = dep["P2"], dep["D2"]
    prompt = PROMPTS[11] + "\n# never seen by D2"  # a D2 prefix-cache hit would need no pull, and count no failure
    params = prefill_directly(p2, prompt)
    t0 = time.monotonic()
    p2.proc.send_signal(signal.SIGTERM)
    assert p2.proc.wait(10) == 0
    assert time.monotonic() - t0 >= 1.4
    log = p2.log()
    assert "dropping 1 open KV lease(s)" in log, log[-3000:]
    failures = kv_failures(dep, "D2")
    assert decode_directly(d2, prompt, params) == reference(dep, prompt)
    assert kv_failures(dep, "D2") == failures + 1
    pools_whole(dep, "P1", "D1", "D2")


def test_zz_client_abort_while_decode_waits_for_kv(dep):
    """After P2 is gone, a silent listener takes its KV port: D2's load of the request waits for the handshake; the
    client goes away meanwhile. D2 aborts the request at once (it held the response headers, watching for the
    disconnect), and the blocks the load was given stay out of use until it times out, then go back."""
    d2 = dep["D2"]
    kv_port = json.loads(dep["P2"].args[dep["P2"].args.index("--kv-transfer-config") + 1])["kv_port"]
    prompt = list(range(100, 140))
    params = sign_params({"do_remote_prefill": True, "do_remote_decode": False, "transfer_id": "t",
                          "remote_engine_id": "P2", "remote_request_id": "r", "remote_host": "127.0.0.1",
                          "remote_port": kv_port, "remote_block_ids": [1, 2, 3], "num_prompt_tokens": len(prompt),
                          "prompt_hash": prompt_hash(prompt), "lease_seconds": 30.0}, KV_TOKEN)
    m = metrics(d2.url)
    aborts = metric(m, "vllm:request_success_total", finished_reason="abort")
    timeouts = metric(m, "pdserve_kv_transfer_failures_total", reason="timeout")
    with socket.create_server(("127.0.0.1", kv_port)):
        body = {"model": "qwen3-tiny-s0", "prompt": prompt, "max_tokens": 4, "stream": True,
                "kv_transfer_params": params}
        with ThreadPoolExecutor(1) as pool:
            # the client gives up at 1.2 s, before D's load times out (kv_transfer_timeout 1.5 s)
            sent = pool.submit(httpx.post, d2.url + "/v1/completions", json=body, timeout=httpx.Timeout(30, read=1.2))
            # while D waits for P's KV the request is waiting, deferred (not for a seat or blocks)
            deadline, m = time.monotonic() + 1.1, {}
            while not metric(m, "vllm:num_requests_waiting_by_reason", reason="deferred") and \
                    time.monotonic() < deadline:
                m = metrics(d2.url)
            assert metric(m, "vllm:num_requests_waiting_by_reason", reason="deferred") == 1, m
            assert metric(m, "vllm:num_requests_waiting_by_reason", reason="capacity") == 0
            assert metric(m, "vllm:num_requests_waiting") == 1
            with pytest.raises(httpx.ReadTimeout):  # no headers before the first token
                sent.result()
        deadline = time.monotonic() + 5
        while metric(d2.url, "vllm:request_success_total", finished_reason="abort") == aborts:
            assert time.monotonic() < deadline, "D did not abort the request"
            time.sleep(0.05)
        deadline = time.monotonic() + 5  # kv_transfer_timeout (1.5 s) from the load's start: it times out
        while metric(d2.url, "pdserve_kv_transfer_failures_total", reason="timeout") == timeouts:
            assert time.monotonic() < deadline, "D's load did not time out"
            time.sleep(0.05)
    assert "KV load failed (timeout)" in d2.log()
    pools_whole(dep, "D2")
