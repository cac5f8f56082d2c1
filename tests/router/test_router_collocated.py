"""The router in front of a collocated pool (`pdserve router --decode A B`, no --prefill; vllm-router's plain mode),
against fake nodes: each request goes whole, its body as the client sent it, to one node in turn; a node that
refuses the connection is passed over; none left is a 503; the CLI refuses P/D-only flags without prefill nodes."""
from __future__ import annotations

import json

import httpx
import pytest
from starlette.testclient import TestClient

from pdserve.router.app import Router, build_app
from pdserve.router.cli import add_router_args, check_router_args
from tests.router.fake_upstream import MockUpstream

A, B = "http://a.test", "http://b.test"


class Pool:
    """Fake collocated nodes: each answers whole with its own name; `down` refuse the connection."""

    def __init__(self, down=()):
        self.down, self.calls = set(down), []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        url = f"{request.url.scheme}://{request.url.host}"
        if url in self.down:
            raise httpx.ConnectError("All connection attempts failed", request=request)
        if request.url.path == "/health":
            return httpx.Response(200)
        body = json.loads(request.content)
        self.calls.append((url, request.url.path, body))
        if body.get("stream"):
            events = [b'data: {"choices": [{"index": 0, "text": "x"}]}\n\n', b"data: [DONE]\n\n"]
            return httpx.Response(200, headers={"content-type": "text/event-stream"},
                                  stream=httpx.ByteStream(b"".join(events)))
        return httpx.Response(200, json={"choices": [{"index": 0, "text": url}]})


def routed(pool: Pool, policy: str = "round-robin") -> TestClient:
    router = Router([], [A, B], policy, health_interval=3600)
    router.client = MockUpstream(pool)
    client = TestClient(build_app(router))
    client.router = router
    return client


def test_each_request_goes_whole_to_the_nodes_in_turn():
    """No prefill step: the client's body reaches one node unaltered (max_tokens, stop fields, no
    kv_transfer_params), and the nodes take turns."""
    pool = Pool()
    body = {"prompt": "hello there", "max_tokens": 7, "stop": ["\n"], "min_tokens": 2, "temperature": 0.5}
    with routed(pool) as c:
        texts = [c.post("/v1/completions", json=body).json()["choices"][0]["text"] for _ in range(4)]
        chat = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert chat.status_code == 200
    assert texts == [A, B, A, B]
    assert [u for u, _, _ in pool.calls] == [A, B, A, B, A]
    assert all(b == body for _, path, b in pool.calls if path == "/v1/completions")
    assert pool.calls[-1][1] == "/v1/chat/completions" and "kv_transfer_params" not in pool.calls[-1][2]


def test_a_stream_is_relayed_from_its_node():
    pool = Pool()
    with routed(pool) as c:
        r = c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3, "stream": True})
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]"), r.text
    assert [u for u, _, _ in pool.calls] == [A]


def test_a_node_that_refuses_the_connection_is_passed_over():
    pool = Pool(down={A})
    with routed(pool) as c:
        for _ in range(3):
            r = c.post("/v1/completions", json={"prompt": "hello there"})
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == B, r.text
        assert [n.healthy for n in c.router.decode.nodes] == [False, True]


def test_no_node_left_is_a_503_naming_it():
    pool = Pool()
    with routed(pool) as c:
        for n in c.router.decode.nodes:
            n.healthy = False
        r = c.post("/v1/completions", json={"prompt": "hello there"})
    assert r.status_code == 503 and "no healthy decode node" in r.json()["error"]["message"]
    assert pool.calls == []


def parse(argv: list[str]):
    import argparse
    p = argparse.ArgumentParser()
    add_router_args(p)
    args = p.parse_args(argv)
    check_router_args(args)
    return args


def test_the_cli_takes_a_pool_without_prefill_nodes_and_refuses_what_needs_them():
    assert parse(["--decode", A, B]).prefill == []
    with pytest.raises(ValueError, match="--pd-first-token prefill needs --prefill"):
        parse(["--decode", A, "--pd-first-token", "prefill"])
