"""Failure paths of the HTTP server (serve/api_server.py, serve/serving.py, serve/errors.py, serve/protocol.py) that
the suite never took, in process (TestClient, or the ASGI app driven by hand where a client must send an odd body
or go away early): request bodies over --max-body-bytes (declared, streamed, or lying within the slack), /metrics
when the engine's stats fail, a route that raises (the catch-all 500), a declared parameter that fails validation,
a chat template that fails, a client gone before its full response, requests while the engine starts. Each answer
is OpenAI-shaped and names the problem (never a traceback), and the KV pool is whole afterwards."""
from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest
from fastapi import FastAPI
from starlette.testclient import TestClient

from pdserve import SamplingParams
from pdserve.config import EngineConfig
from pdserve.core.engine import LLMEngine
from pdserve.serve import api_server
from pdserve.serve.api_server import ServerState, build_app
from pdserve.serve.errors import APIError, install_error_handlers
from pdserve.serve.responses import ResponseBuilder
from pdserve.serve.server_config import ServerConfig
from pdserve.worker.model_runner import ModelRunner
from tests.transfer.test_failure_paths_pd import asgi, engine_core, served, wait_for
from tests.serve.test_failure_paths_serving import BODY, pool_whole

LIMIT = 1000  # --max-body-bytes of the module's server
TOO_BIG = f"request body is larger than the server's limit of {LIMIT} bytes (--max-body-bytes)"
CHAT = {k: v for k, v in BODY.items() if k != "prompt"} | {"messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def srv(qwen3_tiny):
    with served(qwen3_tiny, max_body_bytes=LIMIT) as (c, state):
        @c.app.get("/debug/typed")  # no route of the server declares a parameter; this one does
        async def typed(n: int):
            return {"n": n}
        yield c, state


@pytest.fixture
def slow_steps(monkeypatch):
    """Every model step takes 0.2 s more while `on[0]`: 45 tokens take ~9 s, so an abort is told apart from the
    end."""
    real, on = ModelRunner.run, [True]

    def slow(self, step):
        if on[0]:
            time.sleep(0.2)
        return real(self, step)
    monkeypatch.setattr(ModelRunner, "run", slow)
    return on


def call(c, *args, **kw) -> dict:
    return c.portal.call(lambda: asgi(c.app, *args, **kw))


def error_of(res: dict, status: int) -> dict:
    assert res["status"] == status, res
    assert b"Traceback" not in res["body"]
    err = json.loads(res["body"])["error"]
    assert err["code"] == status
    return err


def served_still(c):
    r = c.post("/v1/completions", json=BODY)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == BODY["max_tokens"], r.text
    pool_whole(c)


def chunks(total: int, size: int = 1 << 16):
    body = json.dumps({**BODY, "prompt": "x" * total}).encode()
    for i in range(0, len(body), size):
        yield body[i:i + size]


def test_a_client_gone_before_its_body_is_in_is_a_499_not_a_500(srv):
    """The connection closes while the body is still coming: a client abort (499, logged as such), never the
    catch-all 500 with a ClientDisconnect traceback; on every route that reads a body."""
    c, _ = srv
    part = json.dumps(BODY).encode()[:-5]
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/kv/release", "/v1/kv/probe"):
        res = call(c, "POST", path, chunks=[part], truncated=True, disconnect_after=0.0)
        assert res["status"] == 499 and b"Traceback" not in res["body"], (path, res)
    served_still(c)


def test_bodies_over_the_limit_are_413_and_never_read_whole(srv):
    """A declared length far over the limit is refused before a byte is read; a streamed body (no length) is
    read only up to the limit plus the drain slack; a body within the slack is read and refused; the KV routes
    take the same limit. Each 413 names the limit and the flag."""
    c, _ = srv
    slack = api_server._DRAIN_SLACK
    declared = LIMIT + slack + 1
    res = call(c, "POST", "/v1/completions", chunks=chunks(declared), headers=[("content-length", str(declared))])
    assert TOO_BIG in error_of(res, 413)["message"] and res["read"] == 0, res["read"]
    streamed = 2 * slack
    res = call(c, "POST", "/v1/completions", chunks=chunks(streamed))
    assert TOO_BIG in error_of(res, 413)["message"]
    assert LIMIT + slack < res["read"] <= LIMIT + slack + (1 << 16), res["read"]  # stopped reading
    within = json.dumps({**BODY, "prompt": "x" * (2 * LIMIT)}).encode()
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/kv/release", "/v1/kv/probe"):
        res = call(c, "POST", path, within)
        assert TOO_BIG in error_of(res, 413)["message"] and res["read"] == len(within), path
    served_still(c)


def test_metrics_still_answer_when_the_engine_stats_fail(srv, monkeypatch):
    """/metrics asks the engine loop for its stats; should that query raise, the page still comes back with what
    the server side counts (a scraper must never see a 500 for an engine-side hiccup), and without the engine-side
    series: the last snapshot's gauges, served again, would read as live."""
    c, state = srv
    served_still(c)
    assert "vllm:num_requests_running{" in c.get("/metrics").text
    core = engine_core(state)

    def broken():
        raise RuntimeError("stats broke")
    monkeypatch.setattr(core, "_q_stats", broken)
    r = c.get("/metrics")
    assert r.status_code == 200, r.text
    lines = r.text.splitlines()
    assert any(x.startswith("vllm:request_success_total{") and 'finished_reason="length"' in x for x in lines)
    assert "stats broke" not in r.text and "vllm:num_requests_running" not in r.text
    pool_whole(c)


def test_a_route_that_raises_is_a_500_without_the_cause(srv, monkeypatch, slow_steps):
    """Rendering a full response raises (a bug): the client gets the OpenAI-shaped 500 (its id header too), not the
    exception's text or a traceback, and the request is aborted in the engine (its blocks back long before its
    45 tokens would have been made)."""
    c, _ = srv
    real = ResponseBuilder.add

    def broken(self, rec):
        if rec.new_token_ids:
            raise KeyError("renderer bug")
        return real(self, rec)
    monkeypatch.setattr(ResponseBuilder, "add", broken)
    t0 = time.monotonic()
    r = c.post("/v1/completions", json={**BODY, "max_tokens": 45}, headers={"X-Request-Id": "boom-1"})
    assert r.status_code == 500, r.text
    assert r.json()["error"]["message"] == "internal server error (see the server log)"
    assert "renderer bug" not in r.text and "Traceback" not in r.text and r.headers["x-request-id"] == "boom-1"
    pool_whole(c, timeout=max(0.1, 4.0 - (time.monotonic() - t0)))
    monkeypatch.setattr(ResponseBuilder, "add", real)
    slow_steps[0] = False
    served_still(c)


def test_the_catch_all_handler_answers_500_in_the_openai_shape():
    """errors.py's own last resort (behind the server's middleware, which answers first in the full app): any
    exception a route lets out is a 500 in the OpenAI shape, its text kept to the log."""
    app = FastAPI()
    install_error_handlers(app)

    @app.get("/boom")
    async def boom():
        raise RuntimeError("secret detail")
    with TestClient(app, raise_server_exceptions=False) as c:
        r = c.get("/boom")
    assert r.status_code == 500
    assert r.json() == {"error": {"message": "internal server error (see the server log)",
                                  "type": "InternalServerError", "param": None, "code": 500}}
    assert "secret detail" not in r.text


def test_a_declared_parameter_that_fails_validation_is_a_400_naming_it(srv):
    """FastAPI's own validation (a 422 by default) answers 400 in the OpenAI shape, naming the parameter."""
    c, _ = srv
    r = c.get("/debug/typed", params={"n": "seven"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "query.n" and err["message"].startswith("query.n: ") and "integer" in err["message"]
    assert c.get("/debug/typed", params={"n": "7"}).json() == {"n": 7}
    served_still(c)


@pytest.mark.parametrize("kwargs,param,start", [
    # a request's own template is code the server would run: refused before anything renders it
    ({"chat_template": "{{ raise_exception('this template takes no such turn') }}"}, "chat_template_kwargs",
     "chat_template_kwargs: a request's own chat template is not rendered unless the server runs with "
     "--trust-request-chat-template"),
    ({"tokenize": True}, "messages", "messages: the chat template failed: "),  # clashes with the server's own call
], ids=["own-template", "kwarg-clash"])
def test_a_failing_chat_template_is_a_400(srv, kwargs, param, start):
    c, _ = srv
    r = c.post("/v1/chat/completions", json={**CHAT, "chat_template_kwargs": kwargs})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["message"].startswith(start), err
    assert err["param"] == param and "Traceback" not in r.text
    served_still(c)


def test_a_client_gone_before_its_full_response_is_499_and_aborted(srv, slow_steps):
    """A non-streaming request whose client goes away while it is generated: 499, and the engine aborts it (its
    blocks back well before its 45 tokens would be done)."""
    c, _ = srv
    body = json.dumps({**BODY, "max_tokens": 45}).encode()
    t0 = time.monotonic()
    res = call(c, "POST", "/v1/completions", body, disconnect_after=0.5, timeout=6)
    assert res["status"] == 499 and res["seconds"] < 2, res
    pool_whole(c, timeout=max(0.1, 4.0 - (time.monotonic() - t0)))


def test_requests_while_the_engine_starts_get_503(qwen3_tiny, monkeypatch):
    """The socket is open before the engine is up. While the engine is built, and in the moment after (the engine
    up, the server's request translation not built yet), /health says so and a request gets a 503 naming it;
    so do routes that query the engine loop (they said "not running" before), and the engine itself refuses a
    submit before its start-up is done. Then the server serves."""
    build, serve = threading.Event(), threading.Event()
    real_init, real_ready = LLMEngine.__init__, ServerState.on_engine_ready

    def held_init(self, *a, **kw):
        build.wait(10)
        real_init(self, *a, **kw)

    async def held_ready(self, server=None):
        await self.engine.wait_started()
        await asyncio.to_thread(serve.wait, 10)
        await real_ready(self, server)
    monkeypatch.setattr(LLMEngine, "__init__", held_init)
    monkeypatch.setattr(ServerState, "on_engine_ready", held_ready)
    state = ServerState(EngineConfig.from_kwargs(qwen3_tiny, block_size=4, max_model_len=53),
                        ServerConfig(enable_debug_routes=True, engine_backend="thread"))

    def starting(c):
        r = c.get("/health")
        assert r.status_code == 503 and r.json() == {"status": "starting up"}
        r = c.post("/v1/completions", json=BODY)
        assert r.status_code == 503 and r.json()["error"]["message"] == "the engine is still starting up", r.text

    def engine_starting(c):  # what routes that ask the engine loop (a router's KV probe, /debug/kv) answer
        for path in ("/v1/kv/probe", "/debug/kv"):
            r = c.get(path)
            assert r.status_code == 503 and r.json()["error"]["message"] == "the engine is still starting up", \
                (path, r.text)

    async def submit():
        try:
            state.engine.submit("early", [5, 6, 7], SamplingParams(max_tokens=2), time.monotonic())
        except APIError as e:
            return e

    with TestClient(build_app(state)) as c:
        try:
            starting(c)  # the engine is being built
            engine_starting(c)
            e = c.portal.call(submit)
            assert isinstance(e, APIError) and e.status == 503 and "still starting" in e.message
            assert c.get("/metrics").status_code == 200
            build.set()
            wait_for(lambda: state.engine.ready, timeout=30, what="the engine")
            starting(c)  # the engine is up, the server not yet
        finally:
            build.set()
            serve.set()
        wait_for(lambda: c.get("/health").status_code == 200, what="health")
        served_still(c)
