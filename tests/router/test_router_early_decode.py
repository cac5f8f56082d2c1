"""`pdserve router --pd-first-token prefill --pd-early-decode` against fake nodes: a streamed
request's D is asked while P prefills, with `await_prefill` naming P and the key P got; the open D becomes the stream
after P's token; a D that fails before answering is replaced by one that gets P's params; P's answer that is all of
it, a P that fails and one tried again elsewhere drop the open D; every node's in-flight count ends at 0."""
from __future__ import annotations

import asyncio

import httpx
from starlette.testclient import TestClient

from pdserve.router.app import Router, build_app
from pdserve.router.migration import Attempt
from pdserve.router.nodes import Node
from tests.router.fake_upstream import MockUpstream, routine
from tests.router.test_router_first_token import D1, D2, P, PARAMS, chunk, events, p_answer, sse, text_of

P2 = "http://p2.test"
REST = sse(chunk("Hel"), chunk("lo", "length"), b"[DONE]")  # D's stream: P's token again, then its own


class Closing(httpx.AsyncByteStream):
    """A D's stream that records whether the router closed it."""

    def __init__(self, data: bytes):
        self.data, self.closed = data, False

    async def __aiter__(self):
        yield self.data

    async def aclose(self) -> None:
        self.closed = True


class Fleet:
    """Async fake nodes. P answers only once a D was asked with `await_prefill` for its key (or after 5 s with a
    500), so a router that asks D after P fails the test. `p[url](body)` and `d[url](body)` give the answers."""

    def __init__(self, p: dict, d: dict):
        self.p, self.d, self.calls, self.streams = p, d, [], []
        self.awaited: dict[str, asyncio.Event] = {}

    def _event(self, key: str) -> asyncio.Event:
        return self.awaited.setdefault(key, asyncio.Event())

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        url, body, answer = routine(request, self.calls)
        if answer is not None:
            return answer
        kvp = body.get("kv_transfer_params") or {}
        if url in self.p:
            key = kvp.get("handoff_key")
            if key is not None:
                try:
                    await asyncio.wait_for(self._event(key).wait(), 5.0)
                except asyncio.TimeoutError:
                    return httpx.Response(500, json={"error": {"message": "no D asked while P prefilled"}})
            r = self.p[url](body)
            return r if isinstance(r, httpx.Response) else httpx.Response(200, json=r)
        if "await_prefill" in kvp:
            self._event(kvp["await_prefill"]["key"]).set()
        r = self.d[url](body)
        if isinstance(r, Exception):
            raise r
        if isinstance(r, bytes):
            stream = Closing(r)
            self.streams.append(stream)
            return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=stream)
        return r

    def d_bodies(self, url: str) -> list:
        return [b for u, path, b in self.calls if u == url and path == "/v1/completions"]


def routed(fleet: Fleet, prefill=(P,), decode=(D1,)):
    router = Router(list(prefill), list(decode), "round-robin", health_interval=3600, pd_first_token="prefill",
                    early_decode=True)
    router.client = MockUpstream(fleet)
    client = TestClient(build_app(router))
    client.router = router
    return client


def idle(c) -> bool:
    return all(n.in_flight == 0 for n in c.router.prefill.nodes + c.router.decode.nodes)


def test_d_is_asked_while_p_prefills_and_its_stream_follows_ps_token():
    fleet = Fleet({P: lambda b: p_answer("Hel")}, {D1: lambda b: REST})
    with routed(fleet) as c:
        r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "stream": True})
        assert idle(c)
    evs = events(r.text)
    assert evs[0]["choices"][0]["text"] == "Hel" and text_of(evs) == "Hello" and evs[-1] == "[DONE]"
    (p_body,), (d_body,) = [b for u, _, b in fleet.calls if u == P], fleet.d_bodies(D1)
    key = p_body["kv_transfer_params"]["handoff_key"]
    assert len(key) == 32 and p_body["kv_transfer_params"]["first_token"] is True
    assert d_body["kv_transfer_params"] == {"await_prefill": {"url": P, "key": key}}
    assert d_body["prompt"] == "x" and d_body["max_tokens"] == 2  # the client's own request otherwise


def test_a_whole_answer_is_asked_of_d_after_p_with_ps_params():
    fleet = Fleet({P: lambda b: p_answer("Hel")},
                  {D1: lambda b: httpx.Response(200, json=p_answer("Hello", params=None))})
    with routed(fleet) as c:
        r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert r.json()["choices"][0]["text"] == "Hello"
    p_body = next(b for u, _, b in fleet.calls if u == P)
    assert "handoff_key" not in p_body["kv_transfer_params"]
    assert [b["kv_transfer_params"] for b in fleet.d_bodies(D1)] == [PARAMS]


def test_a_first_token_that_ends_the_request_drops_the_open_d():
    fleet = Fleet({P: lambda b: p_answer("Bye", fr="stop", params=None)}, {D1: lambda b: REST})
    with routed(fleet) as c:
        r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 4, "stream": True})
        for _ in range(100):  # the drop runs in the background
            if idle(c) and all(s.closed for s in fleet.streams):
                break
            c.portal.call(asyncio.sleep, 0.01)
        assert idle(c)
    evs = events(r.text)
    assert text_of(evs) == "Bye" and evs[-2]["choices"][0]["finish_reason"] == "stop" and evs[-1] == "[DONE]"
    assert len(fleet.d_bodies(D1)) == 1 and all(s.closed for s in fleet.streams)


def test_an_early_d_that_answers_an_error_is_replaced_by_one_given_ps_params():
    def d1(body):
        if "await_prefill" in body["kv_transfer_params"]:  # e.g. its wait for P's params ran out
            return httpx.Response(409, json={"error": {"message": "the prefill node handed nothing over"}})
        return REST

    fleet = Fleet({P: lambda b: p_answer("Hel")}, {D1: d1})
    with routed(fleet) as c:  # one D: the same one, asked again the usual way
        r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "stream": True})
        assert idle(c)
    assert text_of(events(r.text)) == "Hello"
    bodies = fleet.d_bodies(D1)
    assert len(bodies) == 2 and bodies[1]["kv_transfer_params"] == PARAMS
    assert not any(path == "/v1/kv/release" for _, path, _ in fleet.calls)  # the second D took P's params


def test_an_early_d_refusing_the_connection_is_out_and_another_d_takes_ps_params():
    fleet = Fleet({P: lambda b: p_answer("Hel")}, {D1: lambda b: httpx.ConnectError("refused"),
                                                    D2: lambda b: REST})
    with routed(fleet, decode=(D1, D2)) as c:
        r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "stream": True})
        assert idle(c) and not c.router.decode.nodes[0].healthy
    assert text_of(events(r.text)) == "Hello"
    assert [b["kv_transfer_params"] for b in fleet.d_bodies(D2)] == [PARAMS]


def test_a_p_tried_again_elsewhere_gets_a_new_key_and_d():
    fleet = Fleet({P: lambda b: httpx.Response(500, json={"error": {"message": "boom"}}),
                   P2: lambda b: p_answer("Hel")}, {D1: lambda b: REST})
    with routed(fleet, prefill=(P, P2)) as c:
        r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "stream": True})
        for _ in range(100):
            if idle(c):
                break
            c.portal.call(asyncio.sleep, 0.01)
        assert idle(c)
    assert text_of(events(r.text)) == "Hello"
    keys = [b["kv_transfer_params"]["handoff_key"] for u, _, b in fleet.calls if u in (P, P2)]
    awaits = [b["kv_transfer_params"]["await_prefill"] for b in fleet.d_bodies(D1)]
    assert [a["url"] for a in awaits] == [P, P2] and [a["key"] for a in awaits] == keys and keys[0] != keys[1]
    assert fleet.streams[0].closed  # the D opened for the first P was dropped


def test_on_by_default_and_off_asks_d_after_p():
    from tests.router.test_router_collocated import parse
    assert parse(["--prefill", P, "--decode", D1, "--pd-first-token", "prefill"]).pd_early_decode
    assert not parse(["--prefill", P, "--decode", D1, "--no-pd-early-decode"]).pd_early_decode
    fleet = Fleet({P: lambda b: p_answer("Hel")}, {D1: lambda b: REST})
    router = Router([P], [D1], "round-robin", health_interval=3600, pd_first_token="prefill", early_decode=False)
    router.client = MockUpstream(fleet)
    with TestClient(build_app(router)) as c:
        r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "stream": True})
    assert text_of(events(r.text)) == "Hello"
    assert [b["kv_transfer_params"] for b in fleet.d_bodies(D1)] == [PARAMS]


def test_a_stream_cancelled_while_its_early_d_opens_cancels_the_open():
    """The client leaving while the early D has not answered: the open is cancelled (D sees its client go) and the
    node's in-flight count is given back once."""
    async def go():
        node = Node(D1, in_flight=1)
        attempt = Attempt(node)
        attempt.pending = asyncio.get_running_loop().create_future()  # D still waiting for P's params
        waiting = asyncio.ensure_future(attempt.opened())
        await asyncio.sleep(0)
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        await attempt.end()  # the response's background end, after the relay's own: nothing left to give back
        return waiting.cancelled(), node.in_flight
    fut_cancelled, in_flight = asyncio.run(go())
    assert fut_cancelled and in_flight == 0
