"""vllm-router in front of a P started with `--pd-first-token prefill`: vllm-router asks P for `max_tokens` 1 and
throws P's token away, but P's params carry it, and D (whose own params give the same key) starts from it with a
plain decode: no replay, so a D on the strict rule runs no prefill step for the router's traffic. Outputs (greedy and
seeded, streamed and not) equal a collocated server's; P's leases end; both pools whole."""
from __future__ import annotations

import os

import pytest

from tests.router.test_vllm_router import VLLM_ROUTER, VllmRouter, chat, wait_no_lease
from tests.server_harness import ServerProcess, complete, free_port, kv_config, metric, metrics, wait_pools_whole
from tests.server_harness import cleanup_all

COMMON = ("--kv-cache-memory-gb", "0.05", "--enable-debug-routes", "--max-model-len", "256", "--dtype", "float64")
PROMPTS = ["def fibonacci(n):\n    if n < 2:\n        return n\n", "The quick brown fox " * 6]

pytestmark = pytest.mark.skipif(not os.access(VLLM_ROUTER, os.X_OK), reason="vllm-router is not installed")


@pytest.fixture(scope="module")
def dep(qwen3_tiny, reference_f64):
    kv_port = free_port()
    s = {"P": ServerProcess(qwen3_tiny, *COMMON, "--pd-first-token", "prefill", "--kv-transfer-config",
                            kv_config("kv_producer", kv_port=kv_port, kv_lease_seconds=6.0)),
         "D": ServerProcess(qwen3_tiny, *COMMON, "--full-graph-rule", "strict", "--kv-transfer-config",
                            kv_config("kv_consumer", kv_peers=[f"127.0.0.1:{kv_port}"])),
         "C": reference_f64}
    router = None
    try:
        for srv in s.values():
            srv.wait_healthy()
        router = VllmRouter(s["P"].url, s["D"].url)
        router.wait_ready()
        yield {**s, "vllm": router}
    finally:
        cleanup_all(router, s["P"], s["D"])


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.9, "seed": 5}], ids=["greedy", "seeded"])
def test_decode_starts_from_p_token_behind_vllm_router(dep, sampling):
    router, d = dep["vllm"], dep["D"]
    before = metrics(d.url)
    via = [complete(router.url, p, stream=s, **sampling) for p in PROMPTS for s in (False, True)]
    after = metrics(d.url)
    assert via == [complete(dep["C"].url, p, stream=s, **sampling) for p in PROMPTS for s in (False, True)]
    # strict rule: a replay of the last prompt token would be a prefill step here; a decode of P's token is not
    assert metric(after, "pdserve_cudagraph_steps_total", reason="prefill") == \
        metric(before, "pdserve_cudagraph_steps_total", reason="prefill")
    assert metric(after, "pdserve_kv_transfer_received_bytes_total") > \
        metric(before, "pdserve_kv_transfer_received_bytes_total")
    wait_no_lease(dep)
    wait_pools_whole(dep["P"], d, dep["C"])


def test_chat_behind_vllm_router(dep):
    assert [chat(dep["vllm"].url, s) for s in (False, True)] == [chat(dep["C"].url, s) for s in (False, True)]
