"""With no decode node to take a request, a prefill node serves it whole (`pdserve router --prefill-fallback`, on by
default; issue 37: a D down or stalled past a health check is not a client error while a P is up). Against fake
nodes: the request P gets is the client's own (no P/D params, its own max_tokens), P's lease on params no D took is
released, a first-token stream goes on from P's token with no character twice, and --no-prefill-fallback answers
503 without asking P. End to end with real engines: tests/transfer/test_migration_http.py."""
from __future__ import annotations

import httpx
import pytest

from tests.router.test_router_first_token import D1, D2, P, Nodes, chunk, events, p_answer, routed, sse, stream_resp
from tests.router.test_router_migration import REPLAY_PARAMS, text_of


def plain_p(got: list, text="whole"):
    """A P that prefills P/D requests (replay params) and answers any other request whole, recording it."""
    def answer(body):
        if (body.get("kv_transfer_params") or {}).get("do_remote_decode"):
            return p_answer("x", params=REPLAY_PARAMS)
        got.append(body)
        if body.get("stream"):
            return stream_resp(sse(chunk(text[:2], ids=[1]), chunk(text[2:], "length", ids=[2]), b"[DONE]"))
        return p_answer(text, params=None)
    return answer


class DownD(Nodes):
    """Fake nodes whose decode nodes answer /health 503 (down, as the router's health loop sees them)."""

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health" and request.url.host != "p.test":
            return httpx.Response(503)
        return super().__call__(request)


def asked(nodes, path="/v1/completions"):
    return [u for u, p, _ in nodes.calls if p == path]


def released(nodes):
    return [b["kv_transfer_params"] for _, p, b in nodes.calls if p == "/v1/kv/release"]


def answer_text(r, stream):
    return text_of(events(r.text)) if stream else r.json()["choices"][0]["text"]


@pytest.mark.parametrize("stream", [False, True])
def test_no_healthy_d_p_serves_the_clients_request_whole(stream):
    got = []
    nodes = DownD(plain_p(got), {D1: httpx.ConnectError("refused")})
    c = routed(nodes, mode="replay")
    c.router.decode.nodes[0].healthy = False
    with c:
        assert c.get("/health").status_code == 200  # a P can serve
        r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 7, "stream": stream, "seed": 1})
        counted = c.get("/metrics").text
    assert r.status_code == 200 and answer_text(r, stream) == "whole", r.text
    assert asked(nodes) == [P]  # one request, straight to P: no prefill leg, no D
    assert "kv_transfer_params" not in got[0] and got[0]["max_tokens"] == 7 and got[0]["seed"] == 1
    assert "pdserve_router_prefill_fallbacks_total 1.0" in counted


def test_without_prefill_fallback_no_healthy_d_is_a_503_and_p_is_not_asked():
    nodes = DownD(plain_p([]), {D1: httpx.ConnectError("refused")})
    c = routed(nodes, mode="replay", prefill_fallback=False)
    c.router.decode.nodes[0].healthy = False
    with c:
        assert c.get("/health").status_code == 503
        r = c.post("/v1/completions", json={"prompt": "x"})
    assert r.status_code == 503 and "no healthy decode node" in r.json()["error"]["message"]
    assert asked(nodes) == []


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("failure", [httpx.ConnectError("refused"), httpx.ReadError("Connection reset by peer")])
def test_d_failing_before_an_answer_after_p_prefilled_falls_back_to_that_p(failure, stream):
    """D went down (refused) or died with the request (reset, then asked once more): the P that prefilled the prompt
    (its prefix cache holds it) serves the client's request whole, and its lease on the params no D took ends."""
    got = []
    nodes = Nodes(plain_p(got), {D1: failure, D2: failure})
    with routed(nodes, decode=(D1, D2), mode="replay") as c:
        r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 4, "stream": stream})
    assert r.status_code == 200 and answer_text(r, stream) == "whole", r.text
    order = asked(nodes)
    assert order[0] == P and order[-1] == P and set(order[1:-1]) == {D1, D2}, order
    assert "kv_transfer_params" not in got[0] and got[0]["max_tokens"] == 4
    assert released(nodes) == [REPLAY_PARAMS]


def test_a_first_token_stream_goes_on_from_ps_token_on_p():
    """--pd-first-token prefill: the client has P's token; with no D left P resumes from it (resume_token_ids), and
    the client sees each character once."""
    got = []

    def p(body):
        if (body.get("kv_transfer_params") or {}).get("first_token"):
            return p_answer("Hel", ids=[5])
        got.append(body)
        return stream_resp(sse(chunk("Hel", ids=[5]), chunk("lo", "length", ids=[6]), b"[DONE]"))
    nodes = Nodes(p, {D1: httpx.ConnectError("refused")})
    with routed(nodes) as c:
        r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "stream": True})
    evs = events(r.text)
    assert text_of(evs) == "Hello" and evs[-1] == "[DONE]" and not any("error" in e for e in evs[:-1]), evs
    assert got[0]["kv_transfer_params"] == {"resume_token_ids": [5]}
    assert len(released(nodes)) == 1  # P's lease from the first-token prefill, which no D took
