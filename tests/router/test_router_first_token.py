"""`pdserve router --pd-first-token prefill` against fake nodes (an httpx MockTransport, no engines): P's first token
streamed before D is asked, D's stream spliced after it (each character, logprob entry and token id once, however D
cuts its chunks), a D that fails before a token of its own replaced by another, one that fails after ending the
stream with an error event (never a token twice), and a first token that ends the request answered by P alone."""
from __future__ import annotations

import json

import httpx
import pytest
from starlette.testclient import TestClient

from tests.router.fake_upstream import MockUpstream, routine
from pdserve.router.app import Router, build_app
from pdserve.router.first_token import FirstToken
from tests.router.test_router_failures import Broken

P, D1, D2 = "http://p.test", "http://d1.test", "http://d2.test"
PARAMS = {"do_remote_prefill": True, "transfer_id": "t1", "kv_proof": "x", "first_token": {"id": 5}}


def sse(*objs) -> bytes:
    return b"".join(b"data: " + (o if isinstance(o, bytes) else json.dumps(o).encode()) + b"\n\n" for o in objs)


def chunk(text=None, fr=None, chat=False, lp=None, ids=None, role=False):
    c = {"index": 0, "finish_reason": fr, "logprobs": lp}
    if chat:
        c["delta"] = ({"role": "assistant", "content": ""} if role else {}) | ({} if text is None else
                                                                                {"content": text})
    else:
        c["text"] = text or ""
    if ids is not None:
        c["token_ids"] = ids
    return {"id": "cmpl-r", "object": "x", "created": 1, "model": "m", "choices": [c]}


def p_answer(text="Hel", chat=False, fr="length", params=PARAMS, lp=None, ids=None):
    c = {"index": 0, "logprobs": lp, "finish_reason": fr, "stop_reason": None}
    c |= {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
    if ids is not None:
        c["token_ids"] = ids
    body = {"id": "cmpl-r", "object": "x", "created": 1, "model": "m", "choices": [c],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}
    if params is not None:
        body["kv_transfer_params"] = params
    return body


class Nodes:
    def __init__(self, p, d: dict):
        self.p, self.d, self.calls = p, d, []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        url, body, answer = routine(request, self.calls)
        if answer is not None:
            return answer
        if url == P:
            r = self.p(body)
            return r if isinstance(r, httpx.Response) else httpx.Response(200, json=r)
        r = self.d[url]
        if callable(r) and not isinstance(r, httpx.Response):  # answers by the body it gets
            r = r(body)
        if isinstance(r, Exception):
            raise r
        return r


def stream_resp(*chunks: bytes, broken=False):
    if broken:
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=Broken(list(chunks)))
    return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=httpx.ByteStream(b"".join(chunks)))


def routed(nodes: Nodes, decode=(D1,), mode="prefill", max_migrations=2, prefill_fallback=True, early=False,
           prefill=(P,)):
    """early: D asked while P prefills (tests/router/test_router_early_decode.py); off here, where D is asked after
    P answered."""
    router = Router(list(prefill), list(decode), "round-robin", health_interval=3600, pd_first_token=mode,
                    max_migrations=max_migrations, prefill_fallback=prefill_fallback, early_decode=early)
    router.client = MockUpstream(nodes)
    client = TestClient(build_app(router))
    client.router = router
    return client


def events(raw: str) -> list:
    out = []
    for ev in raw.split("\n\n"):
        if ev.startswith("data: "):
            out.append(ev[6:] if ev[6:] == "[DONE]" else json.loads(ev[6:]))
    return out


def text_of(evs, chat=False) -> str:
    return "".join((c["delta"].get("content") or "") if chat else c["text"]
                   for e in evs if isinstance(e, dict) and e.get("choices") for c in e["choices"])


def test_p_gets_the_clients_params_and_asks_for_the_first_token():
    nodes = Nodes(lambda b: p_answer(), {D1: stream_resp(sse(chunk("Hello", "length"), b"[DONE]"))})
    with routed(nodes) as c:
        c.post("/v1/completions", json={"prompt": "x", "max_tokens": 7, "stop": ["z"], "stream": True,
                                        "stream_options": {"include_usage": True}})
    p_body = nodes.calls[0][2]
    assert p_body["max_tokens"] == 7 and p_body["stop"] == ["z"] and p_body["stream"] is False
    assert "stream_options" not in p_body and "ignore_eos" not in p_body
    assert p_body["kv_transfer_params"] == {"do_remote_decode": True, "first_token": True}
    assert nodes.calls[1][2]["kv_transfer_params"] == PARAMS  # verbatim to D


@pytest.mark.parametrize("cuts", [["Hel", "lo", " wo", "rld"], ["H", "e", "llo wor", "ld"], ["Hello world"]])
def test_stream_is_p_then_d_without_the_first_token(cuts):
    d = stream_resp(sse(*[chunk(t) for t in cuts[:-1]], chunk(cuts[-1], "length"), b"[DONE]"))
    with routed(Nodes(lambda b: p_answer("Hel"), {D1: d})) as c:
        r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 4, "stream": True})
    evs = events(r.text)
    assert evs[0]["choices"][0]["text"] == "Hel" and evs[0]["choices"][0]["finish_reason"] is None
    assert text_of(evs) == "Hello world"
    assert evs[-2]["choices"][0]["finish_reason"] == "length" and evs[-1] == "[DONE]"


def test_chat_role_once_logprobs_and_token_ids_once():
    lp1 = {"content": [{"token": "Hi", "logprob": -0.5, "top_logprobs": []}]}
    lp_d = {"content": [{"token": "Hi", "logprob": -0.5, "top_logprobs": []},
                        {"token": "!", "logprob": -1.0, "top_logprobs": []}]}
    d = stream_resp(sse(chunk(role=True, chat=True), chunk("Hi!", "stop", chat=True, lp=lp_d, ids=[5, 6]),
                        b"[DONE]"))
    with routed(Nodes(lambda b: p_answer("Hi", chat=True, lp=lp1, ids=[5]), {D1: d})) as c:
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "stream": True,
                                                 "logprobs": True, "return_token_ids": True})
    evs = events(r.text)
    roles = [e for e in evs if isinstance(e, dict) and "role" in e["choices"][0]["delta"]]
    assert len(roles) == 1
    assert text_of(evs, chat=True) == "Hi!"
    entries = [x["token"] for e in evs if isinstance(e, dict) for x in (e["choices"][0]["logprobs"] or {}).get(
        "content", [])]
    ids = [t for e in evs if isinstance(e, dict) for t in e["choices"][0].get("token_ids", [])]
    assert entries == ["Hi", "!"] and ids == [5, 6]


def test_first_token_that_ends_the_request_is_answered_by_p_alone():
    nodes = Nodes(lambda b: p_answer("Bye", fr="stop", params=None), {D1: httpx.ConnectError("never called")})
    with routed(nodes) as c:
        whole = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 4})
        streamed = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 4, "stream": True,
                                                   "stream_options": {"include_usage": True}})
    assert whole.json()["choices"][0]["text"] == "Bye" and whole.json()["choices"][0]["finish_reason"] == "stop"
    evs = events(streamed.text)
    assert text_of(evs) == "Bye" and evs[-3]["choices"][0]["finish_reason"] == "stop"
    assert evs[-2]["usage"]["completion_tokens"] == 1 and evs[-1] == "[DONE]"
    assert all(url == P for url, _, _ in nodes.calls)  # no D asked


def test_d_failing_before_its_own_token_is_replaced():
    d2 = stream_resp(sse(chunk("Hel"), chunk("lo", "length"), b"[DONE]"))
    nodes = Nodes(lambda b: p_answer("Hel"), {D1: httpx.ConnectError("refused"), D2: d2})
    with routed(nodes, decode=(D1, D2)) as c:
        r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "stream": True})
    assert text_of(events(r.text)) == "Hello"
    assert [u for u, path, _ in nodes.calls if path == "/v1/completions"] == [P, D1, D2]


def test_d_failing_after_a_token_of_its_own_ends_with_an_error_event():
    """Without migration (tests/router/test_router_migration.py has it on)."""
    d1 = stream_resp(sse(chunk("Hel"), chunk("lo")), broken=True)
    nodes = Nodes(lambda b: p_answer("Hel"), {D1: d1, D2: stream_resp(sse(chunk("Hello"), b"[DONE]"))})
    with routed(nodes, decode=(D1, D2), max_migrations=0) as c:
        r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 5, "stream": True})
    evs = events(r.text)
    assert text_of(evs) == "Hello"  # nothing repeated
    assert "error" in evs[-2] and evs[-1] == "[DONE]"
    assert D2 not in [u for u, _, _ in nodes.calls]


def test_no_decode_node_takes_it_releases_p_and_ends_with_an_error():
    nodes = Nodes(lambda b: p_answer("Hel"), {D1: httpx.ConnectError("refused")})
    with routed(nodes) as c:
        r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 5, "stream": True})
    evs = events(r.text)
    assert text_of(evs) == "Hel" and "error" in evs[-2] and evs[-1] == "[DONE]"
    assert any(path == "/v1/kv/release" for _, path, _ in nodes.calls)


def test_splice_units():
    s = FirstToken(p_answer("abc", lp={"tokens": ["abc"], "token_logprobs": [-1.0], "top_logprobs": [None],
                                       "text_offset": [0]})).splice()
    lp = {"tokens": ["ab", "c", "d"], "token_logprobs": [-1, -2, -3], "top_logprobs": [None] * 3,
          "text_offset": [0, 2, 3]}
    raw = sse(chunk("abcd", lp=lp))
    out = s.feed(raw[:7]) + s.feed(raw[7:])  # an event split across reads
    got = events(out.decode())[0]["choices"][0]
    assert got["text"] == "d"
    # one logprob entry is P's token's: D's first entry (whatever D's chunking), the rest stay
    assert got["logprobs"]["tokens"] == ["c", "d"]
