"""The router's answers when a node misbehaves, against fake P and D nodes (an httpx MockTransport: no engines):
a P whose own P/D set-up refuses the prefill (a deployment error: the next P, else a 502, never the client's 4xx;
that P is then tried last for a while);
a P that refuses the client's fields (D, which answers the same client errors, decides: a shorter max_model_len on
P no longer refuses what D serves); a D that breaks off a stream it began (an error event and [DONE], no
traceback) or a whole answer (a 502, not half a body under a 200)."""
from __future__ import annotations

import json
import time

import httpx
import pytest
from starlette.testclient import TestClient

from tests.router.fake_upstream import MockUpstream, routine
from pdserve.router.app import Router, build_app

P1, P2, D = "http://p1.test", "http://p2.test", "http://d.test"
PARAMS = {"do_remote_prefill": True, "transfer_id": "t1", "kv_proof": "x"}


def err(status: int, message: str, param=None) -> httpx.Response:
    return httpx.Response(status, json={"error": {"message": message, "type": "x", "param": param, "code": status}})


class Broken(httpx.AsyncByteStream):
    """A stream that sends its first events, then the connection drops."""

    def __init__(self, first: list[bytes]):
        self.first = first

    async def __aiter__(self):
        for chunk in self.first:
            yield chunk
        raise httpx.RemoteProtocolError("peer closed connection without sending complete message body")


class Nodes:
    """Fake nodes: `p[url]` and `d` are callables (json body) -> httpx.Response; every call is recorded."""

    def __init__(self, p: dict, d):
        self.p, self.d, self.calls = p, d, []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        url, body, answer = routine(request, self.calls)
        if answer is not None:
            return answer
        r = self.p[url](body) if url in self.p else self.d(body)
        if isinstance(r.stream, Broken):
            return r
        # as a server's answer arrives: a stream not yet read (the router relays D's raw bytes)
        return httpx.Response(r.status_code, headers=r.headers, stream=httpx.ByteStream(r.content))


def routed(nodes: Nodes, prefill: list[str], max_migrations: int = 2):
    router = Router(prefill, [D], "round-robin", health_interval=3600, max_migrations=max_migrations)
    router.client = MockUpstream(nodes)
    client = TestClient(build_app(router))
    client.router = router
    return client


def d_raising(nodes: Nodes, exc: httpx.HTTPError, decode: list[str], prefill_fallback: bool = True) -> Router:
    """A router whose requests to D (d.test) raise `exc` before any byte; every other call goes to `nodes`."""
    def transport(request):
        if request.url.host == "d.test" and request.url.path.startswith("/v1/"):
            exc.request = request
            raise exc
        return nodes(request)
    router = Router([P1], decode, "round-robin", health_interval=3600, prefill_fallback=prefill_fallback)
    router.client = MockUpstream(transport)
    return router


def ok_p(body):
    return httpx.Response(200, json={"choices": [{"text": "x"}], "kv_transfer_params": PARAMS})


def ok_d(body):
    return httpx.Response(200, json={"choices": [{"text": "served"}], "got_params": "kv_transfer_params" in body})


NO_CONNECTOR = "kv_transfer_params: this server has no KV connector (start it with a KV transfer config)"


def test_a_p_without_its_kv_set_up_is_a_deployment_error_not_the_clients():
    """P answers a 400 on kv_transfer_params (started without a KV connector, or a decode node in the prefill
    list): the next P serves the request; with no P left, the client gets a 502 naming the refusal, and D is never
    asked (nothing to hand over, no lease)."""
    bad = lambda body: err(400, NO_CONNECTOR, "kv_transfer_params")  # noqa: E731
    nodes = Nodes({P1: bad, P2: ok_p}, ok_d)
    with routed(nodes, [P1, P2]) as c:
        r = c.post("/v1/completions", json={"prompt": "hello there", "max_tokens": 4})
        assert r.status_code == 200 and r.json()["got_params"], r.text
        assert [u for u, path, _ in nodes.calls] == [P1, P2, D]
    nodes = Nodes({P1: bad}, ok_d)
    with routed(nodes, [P1]) as c:
        r = c.post("/v1/completions", json={"prompt": "hello there", "max_tokens": 4})
        assert r.status_code == 502, r.text
        msg = r.json()["error"]["message"]
        assert P1 in msg and "no KV connector" in msg and "Traceback" not in r.text
        assert [u for u, _, _ in nodes.calls] == [P1]


@pytest.mark.parametrize("d_answer", ["serves", "refuses"])
def test_a_p_refusing_the_clients_fields_leaves_the_answer_to_d(d_answer):
    """P refuses the client's own fields (here its max_model_len is shorter than D's): the request goes to D alone
    (no params), which serves it, or refuses it with its own 400 that goes back to the client as it is."""
    short = lambda body: err(400, "the prompt has 100 tokens but max_model_len is 64", "prompt")  # noqa: E731
    d = ok_d if d_answer == "serves" else (lambda body: err(400, "temperature must be non-negative", "temperature"))
    nodes = Nodes({P1: short}, d)
    with routed(nodes, [P1]) as c:
        r = c.post("/v1/completions", json={"prompt": "hello there", "max_tokens": 4})
        sent_to_d = [b for u, _, b in nodes.calls if u == D]
        assert len(sent_to_d) == 1 and "kv_transfer_params" not in sent_to_d[0]
        if d_answer == "serves":
            assert r.status_code == 200 and r.json()["got_params"] is False
        else:
            assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"


@pytest.mark.parametrize("unused", [True, False])
def test_a_decode_node_that_took_none_of_the_kv_gets_ps_lease_released(unused):
    """D answers 200 with X-PD-KV-Unused (it prefilled locally): the router posts P's params to P's
    /v1/kv/release, since D's own `done` may not have reached P. Without the header, nothing is posted."""
    from pdserve.serve.server_timing import KV_UNUSED_HEADER
    nodes = Nodes({P1: ok_p}, lambda body: httpx.Response(200, json={"choices": [{"text": "x"}]},
                                                          headers={KV_UNUSED_HEADER: "1"} if unused else {}))
    with routed(nodes, [P1]) as c:
        r = c.post("/v1/completions", json={"prompt": "hello there"})
        assert r.status_code == 200
        deadline = time.monotonic() + 5
        while unused and not any(path == "/v1/kv/release" for _, path, _ in nodes.calls):
            assert time.monotonic() < deadline, nodes.calls
            time.sleep(0.01)
    releases = [b for u, path, b in nodes.calls if path == "/v1/kv/release"]
    assert releases == ([{"kv_transfer_params": PARAMS}] if unused else [])


def broken_stream(first: list[bytes]) -> str:
    nodes = Nodes({P1: ok_p}, lambda body: httpx.Response(200, headers={"content-type": "text/event-stream"},
                                                          stream=Broken(first)))
    with routed(nodes, [P1]) as c:
        with c.stream("POST", "/v1/completions", json={"prompt": "hello there", "stream": True}) as r:
            assert r.status_code == 200
            return "".join(r.iter_text())


@pytest.mark.parametrize("cut", ["between events", "inside an event"])
def test_a_decode_node_that_breaks_off_a_stream_ends_it_with_an_error_event(cut):
    """D's events, then an error event that parses on its own (an event cut off is not relayed: the router relays
    whole events), then [DONE]. These fake events carry no token ids, so the stream is not resumed."""
    first = [b'data: {"choices": [{"text": "a"}]}\n\n', b'data: {"choices": [{"text": "b"}]}\n\n']
    if cut == "inside an event":
        first.append(b'data: {"choi')
    events = [e.removeprefix("data: ") for e in broken_stream(first).strip().split("\n\n")]
    assert events[:2] == [f.decode().strip().removeprefix("data: ") for f in first[:2]]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == 502 and D in error["message"] and "broke off" in error["message"]
    assert len(events) == 4


def test_a_stream_that_ended_before_the_break_is_left_as_it_is():
    first = [b'data: {"choices": [{"text": "a"}]}\n\n', b"data: [DONE]\n\n"]
    assert broken_stream(first) == b"".join(first).decode()


def test_a_decode_node_that_breaks_off_a_whole_answer_is_a_502():
    """A non-streamed answer cut short would otherwise reach the client as a 200 with half a JSON body (with
    --max-migrations 0; with migration another node answers: tests/router/test_router_migration.py)."""
    nodes = Nodes({P1: ok_p}, lambda body: httpx.Response(200, headers={"content-type": "application/json"},
                                                          stream=Broken([b'{"choices": [{"text": "par'])))
    with routed(nodes, [P1], max_migrations=0) as c:
        r = c.post("/v1/completions", json={"prompt": "hello there"})
    assert r.status_code == 502 and "broke off" in r.json()["error"]["message"]


def test_a_decode_node_that_refuses_the_connection_is_passed_over():
    """A D that went down since the last health check refuses the connection: nothing reached it, so the request
    goes to the next D (not a 502), and the refusing D is out of rotation until /health answers again."""
    D2 = "http://d2.test"
    nodes = Nodes({P1: ok_p}, ok_d)
    router = d_raising(nodes, httpx.ConnectError("All connection attempts failed"), [D, D2])
    with TestClient(build_app(router)) as c:
        for _ in range(3):
            r = c.post("/v1/completions", json={"prompt": "hello there"})
            assert r.status_code == 200 and r.json()["got_params"], r.text
    assert [n.healthy for n in router.decode.nodes] == [False, True]
    assert [u for u, path, _ in nodes.calls if path == "/v1/completions"] == [P1, D2] * 3


def test_a_p_refusing_pd_prefills_is_tried_last_until_its_hold_ends(monkeypatch):
    """After P1 refuses a P/D prefill, the next requests go to P2 without asking P1 (each used to pay P1's round
    trip and an error line); once its hold ends P1 is asked again, and a P/D prefill it serves clears the hold."""
    from pdserve.router import app as router_mod
    monkeypatch.setattr(router_mod, "PD_REFUSAL_HOLD", 0.5)
    broken = [True]
    p1 = lambda body: err(400, NO_CONNECTOR, "kv_transfer_params") if broken[0] else ok_p(body)  # noqa: E731
    nodes = Nodes({P1: p1, P2: ok_p}, ok_d)
    with routed(nodes, [P1, P2]) as c:
        def asked():
            nodes.calls.clear()
            r = c.post("/v1/completions", json={"prompt": "hello there", "max_tokens": 4})
            assert r.status_code == 200 and r.json()["got_params"], r.text
            return [u for u, _, _ in nodes.calls if u != D]
        firsts = [asked() for _ in range(4)]
        i = firsts.index([P1, P2])  # P1 refused once...
        assert firsts[i + 1:] == [[P2]] * (3 - i)  # ...then was skipped
        broken[0] = False
        time.sleep(0.6)
        assert P1 in [asked()[0] for _ in range(2)]  # the hold is over: P1 is asked again, and serves
        assert all(n.refused_pd_until == 0.0 for n in c.router.prefill.nodes)


def test_with_every_p_held_they_are_still_asked():
    """A lone P that refused P/D prefills is still asked (it may be fixed): the answer stays a 502 naming the
    refusal while it refuses, a 200 once it serves."""
    broken = [True]
    p1 = lambda body: err(400, NO_CONNECTOR, "kv_transfer_params") if broken[0] else ok_p(body)  # noqa: E731
    nodes = Nodes({P1: p1}, ok_d)
    with routed(nodes, [P1]) as c:
        for _ in range(2):
            r = c.post("/v1/completions", json={"prompt": "hello there", "max_tokens": 4})
            assert r.status_code == 502 and "no KV connector" in r.json()["error"]["message"]
        broken[0] = False
        r = c.post("/v1/completions", json={"prompt": "hello there", "max_tokens": 4})
        assert r.status_code == 200 and r.json()["got_params"], r.text


def test_a_client_gone_before_its_body_is_in_is_a_499_and_reaches_no_node():
    """The connection closes mid-body: a 499 (was: the catch-all 500 and a ClientDisconnect traceback), and
    neither P nor D is asked anything."""
    from tests.transfer.test_failure_paths_pd import asgi
    nodes = Nodes({P1: ok_p}, ok_d)
    c = routed(nodes, [P1])
    part = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()[:-3]
    with c:
        res = c.portal.call(lambda: asgi(c.app, "POST", "/v1/completions", chunks=[part], truncated=True,
                                         disconnect_after=0.0))
    assert res["status"] == 499 and nodes.calls == []


def test_a_decode_node_reset_without_a_reason_is_a_named_502_with_a_warning(caplog):
    """Issue 37 item 10: a kept-alive connection D resets before any byte raises an httpx error with no text; the
    client's 502 still names what failed, the body has OpenAI's `param`, and the router logs a WARNING."""
    router = d_raising(Nodes({P1: ok_p}, ok_d), httpx.ReadError(""), [D], prefill_fallback=False)
    with caplog.at_level("WARNING", logger="pdserve.router"), TestClient(build_app(router)) as c:
        r = c.post("/v1/completions", json={"prompt": "hello there"})
    err = r.json()["error"]
    assert r.status_code == 502 and err["message"].endswith("failed: ReadError") and "param" in err, err
    assert any("answered 502" in rec.getMessage() and rec.levelname == "WARNING" for rec in caplog.records)
