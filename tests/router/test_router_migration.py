"""Request migration (`pdserve router --max-migrations`, router/migration.py) against fake nodes: a stream broken off
after tokens resumes on another node from the token ids the client has (`kv_transfer_params.resume_token_ids`),
the client seeing every character and id once; a 5xx error event resumes too; past the limit, or with no node left,
the stream ends with an error event; with no D left a P resumes it; a whole answer broken off is asked again; a
reset before any byte of an answer (issue 37 item 7) is retried. What the nodes generate is checked end to end
against a collocated server in tests/transfer/test_migration_http.py."""
from __future__ import annotations

import httpx
import pytest

from tests.router.test_router_first_token import D1, D2, Nodes, chunk, events, p_answer, routed, sse, stream_resp
from tests.router.test_router_failures import Broken

D3 = "http://d3.test"
REPLAY_PARAMS = {"do_remote_prefill": True, "transfer_id": "t1", "kv_proof": "x"}


def p_replay(body):
    return p_answer("x", params=REPLAY_PARAMS)


def ids_of(evs) -> list:
    return [t for e in evs if isinstance(e, dict) and e.get("choices") for t in e["choices"][0].get("token_ids", [])]


def text_of(evs, chat=False) -> str:
    return "".join((c["delta"].get("content") or "") if chat else c["text"]
                   for e in evs if isinstance(e, dict) and e.get("choices") for c in e["choices"])


def resumes(got: list, text_then: str, ids_then: list, rest: list):
    """A node that resumes: records the body it got, repeats what the client has, then `rest` (text, id) pairs."""
    def answer(body):
        got.append(body)
        evs = [chunk(text_then, ids=ids_then)] + [chunk(t, ids=[i]) for t, i in rest[:-1]]
        t, i = rest[-1]
        return stream_resp(sse(*evs, chunk(t, "length", ids=[i]), b"[DONE]"))
    return answer


@pytest.mark.parametrize("cuts", [["Hel", "lo"], ["H", "ello"], ["Hello"]])
def test_a_stream_broken_after_tokens_resumes_on_another_d(cuts):
    """D1 sent tokens 1 and 2 (its text cut in any way), then died; D2 gets the client's request with those ids and
    no P params, repeats their text and ids, and goes on: the client gets each character once and no token ids
    (it did not ask for them)."""
    d1 = stream_resp(sse(chunk(cuts[0], ids=[1] if cuts[1:] else [1, 2]), *[chunk(t, ids=[2]) for t in cuts[1:]]),
                     broken=True)
    got = []
    nodes = Nodes(p_replay, {D1: d1, D2: resumes(got, "Hello", [1, 2], [(" wor", 3), ("ld", 4)])})
    with routed(nodes, decode=(D1, D2), mode="replay") as c:
        r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 4, "stream": True, "seed": 3})
        counted = c.get("/metrics").text
    evs = events(r.text)
    assert text_of(evs) == "Hello world" and evs[-1] == "[DONE]" and not any("error" in e for e in evs[:-1])
    assert ids_of(evs) == [] and all("token_ids" not in e["choices"][0] for e in evs[:-1])
    d1_body = [b for u, path, b in nodes.calls if u == D1][0]
    assert d1_body["return_token_ids"] is True and d1_body["kv_transfer_params"] == REPLAY_PARAMS
    assert got[0]["kv_transfer_params"] == {"resume_token_ids": [1, 2]} and got[0]["seed"] == 3
    assert got[0]["max_tokens"] == 4  # the client's own request: the node counts the resumed tokens itself
    assert 'pdserve_router_migrations_total{kind="stream"} 1.0' in counted


def test_chat_role_once_and_the_ids_the_client_asked_for_once():
    d1 = stream_resp(sse(chunk(role=True, chat=True), chunk("Hi", chat=True, ids=[7])), broken=True)
    got = []

    def d2(body):
        got.append(body)
        return stream_resp(sse(chunk(role=True, chat=True), chunk("Hi", chat=True, ids=[7]),
                               chunk(" there", "stop", chat=True, ids=[8]), b"[DONE]"))
    nodes = Nodes(p_replay, {D1: d1, D2: d2})
    with routed(nodes, decode=(D1, D2), mode="replay") as c:
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "stream": True,
                                                 "return_token_ids": True})
    evs = events(r.text)
    roles = [e for e in evs if isinstance(e, dict) and "role" in e["choices"][0]["delta"]]
    assert len(roles) == 1 and text_of(evs, chat=True) == "Hi there" and ids_of(evs) == [7, 8]
    assert got[0]["kv_transfer_params"] == {"resume_token_ids": [7]}


def test_a_5xx_error_event_after_tokens_resumes_too():
    """D's engine failed the request (its error event, then [DONE]): neither goes out, another node goes on."""
    d1 = stream_resp(sse(chunk("Hel", ids=[1]), {"error": {"message": "device lost", "code": 500}}, b"[DONE]"))
    got = []
    nodes = Nodes(p_replay, {D1: d1, D2: resumes(got, "Hel", [1], [("lo", 2)])})
    with routed(nodes, decode=(D1, D2), mode="replay") as c:
        r = c.post("/v1/completions", json={"prompt": "x", "stream": True})
    evs = events(r.text)
    assert text_of(evs) == "Hello" and evs.count("[DONE]") == 1 and not any("error" in e for e in evs[:-1])
    assert got[0]["kv_transfer_params"] == {"resume_token_ids": [1]}


def test_past_max_migrations_the_stream_ends_with_an_error_event():
    n = []

    def broken(body):  # the k-th node asked repeats what the client has, sends one token of its own and dies
        n.append(body)
        return stream_resp(sse(chunk("abc"[:len(n)], ids=[1, 2, 3][:len(n)])), broken=True)
    nodes = Nodes(p_replay, {D1: broken, D2: broken, D3: broken})
    with routed(nodes, decode=(D1, D2, D3), mode="replay", max_migrations=1) as c:
        r = c.post("/v1/completions", json={"prompt": "x", "stream": True})
    evs = events(r.text)
    assert text_of(evs) == "ab" and "error" in evs[-2] and evs[-1] == "[DONE]"
    assert len(n) == 2  # one migration


def test_with_no_d_left_a_prefill_node_resumes_it():
    d1 = stream_resp(sse(chunk("Hel", ids=[1])), broken=True)
    got = []

    def p(body):
        if body.get("kv_transfer_params", {}).get("do_remote_decode"):
            return p_replay(body)
        got.append(body)
        return stream_resp(sse(chunk("Hel", ids=[1]), chunk("p!", "length", ids=[2]), b"[DONE]"))
    nodes = Nodes(p, {D1: d1})
    with routed(nodes, decode=(D1,), mode="replay") as c:
        r = c.post("/v1/completions", json={"prompt": "x", "stream": True})
    assert text_of(events(r.text)) == "Help!"
    assert got[0]["kv_transfer_params"] == {"resume_token_ids": [1]}


def test_first_token_then_d_then_another_d():
    """--pd-first-token prefill: the resumed ids start with P's token."""
    d1 = stream_resp(sse(chunk("Hel", ids=[5]), chunk("lo", ids=[6])), broken=True)
    got = []
    nodes = Nodes(lambda b: p_answer("Hel", ids=[5]),
                  {D1: d1, D2: resumes(got, "Hello", [5, 6], [(" you", 7)])})
    with routed(nodes, decode=(D1, D2)) as c:
        r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 3, "stream": True})
    evs = events(r.text)
    assert text_of(evs) == "Hello you" and ids_of(evs) == [] and evs[-1] == "[DONE]"
    assert nodes.calls[0][2]["return_token_ids"] is True  # P's token id: where a resume starts
    assert got[0]["kv_transfer_params"] == {"resume_token_ids": [5, 6]}


def test_a_whole_answer_broken_off_is_asked_of_another_node():
    d1 = httpx.Response(200, headers={"content-type": "application/json"}, stream=Broken([b'{"choices": [{"te']))
    got = []

    def d2(body):
        got.append(body)
        return httpx.Response(200, json={"choices": [{"text": "whole"}]})
    nodes = Nodes(p_replay, {D1: d1, D2: d2})
    with routed(nodes, decode=(D1, D2), mode="replay") as c:
        r = c.post("/v1/completions", json={"prompt": "x"})
        counted = c.get("/metrics").text
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "whole"
    assert "kv_transfer_params" not in got[0] and "return_token_ids" not in got[0]  # D2 prefills it itself
    assert 'pdserve_router_migrations_total{kind="whole"} 1.0' in counted


@pytest.mark.parametrize("stream", [False, True])
def test_a_reset_before_any_answer_is_retried_on_another_d_with_the_same_params(stream):
    """Issue 37 item 7: a kept-alive connection the node closed (e.g. after a stall past its keep-alive) resets a
    request it never read: nothing reached the client, so another D gets the same P params."""
    got = []

    def d2(body):
        got.append(body)
        if stream:
            return stream_resp(sse(chunk("ok", "length", ids=[1]), b"[DONE]"))
        return httpx.Response(200, json={"choices": [{"text": "ok"}]})
    nodes = Nodes(p_replay, {D1: httpx.RemoteProtocolError("Server disconnected without sending a response."),
                             D2: d2})
    with routed(nodes, decode=(D1, D2), mode="replay") as c:
        r = c.post("/v1/completions", json={"prompt": "x", "stream": stream})
    assert r.status_code == 200 and "ok" in r.text
    assert got[0]["kv_transfer_params"] == REPLAY_PARAMS


def test_a_single_d_that_resets_once_is_asked_once_more():
    calls = []

    def d1(body):
        calls.append(body)
        if len(calls) == 1:
            return httpx.ReadError("Connection reset by peer")
        return httpx.Response(200, json={"choices": [{"text": "ok"}]})
    nodes = Nodes(p_replay, {D1: d1})
    with routed(nodes, decode=(D1,), mode="replay") as c:
        assert c.post("/v1/completions", json={"prompt": "x"}).json()["choices"][0]["text"] == "ok"
    assert len(calls) == 2


def test_a_single_d_that_resets_twice_is_a_502_without_prefill_fallback():
    nodes = Nodes(p_replay, {D1: lambda body: httpx.ReadError("Connection reset by peer")})
    with routed(nodes, decode=(D1,), mode="replay", prefill_fallback=False) as c:
        r = c.post("/v1/completions", json={"prompt": "x"})
    assert r.status_code == 502 and "ReadError" in r.json()["error"]["message"] or "reset" in r.text
    assert len([u for u, path, _ in nodes.calls if u == D1]) == 2


def test_a_timeout_is_not_retried():
    """The node may still be working on it: a second node would run it twice."""
    nodes = Nodes(p_replay, {D1: httpx.ReadTimeout("timed out"), D2: lambda body: httpx.Response(200, json={})})
    with routed(nodes, decode=(D1, D2), mode="replay") as c:
        r = c.post("/v1/completions", json={"prompt": "x"})
    assert r.status_code == 502 and D2 not in [u for u, _, _ in nodes.calls]
