"""Failure paths of the HTTP side (serve/serving.py, serve/api_server.py), in process through starlette's TestClient
on the thread backend (so coverage sees them): a model step that fails answers 500 with its cause (full) or an error
event (stream); a stream whose rendering breaks after the headers went out ends with an error event and aborts the
request. Each ends with the KV pool whole (/debug/kv), and the server goes on serving."""
from __future__ import annotations

import json
import time
from contextlib import contextmanager

import pytest
from starlette.testclient import TestClient

from pdserve.config import EngineConfig
from pdserve.serve.api_server import ServerState, build_app
from pdserve.serve.responses import ResponseBuilder
from pdserve.serve.server_config import ServerConfig
from pdserve.worker.model_runner import ModelRunner

BODY = {"prompt": [5, 6, 7, 8], "max_tokens": 6, "temperature": 0.0, "ignore_eos": True}


@contextmanager
def server(model, **cfg):
    state = ServerState(EngineConfig.from_kwargs(model, block_size=4, max_model_len=53),
                        ServerConfig(**{"enable_debug_routes": True, "engine_backend": "thread", **cfg}))
    with TestClient(build_app(state)) as c:
        c.app_state = state
        deadline = time.monotonic() + 60
        while c.get("/health").status_code != 200:
            assert time.monotonic() < deadline, "server not healthy"
            time.sleep(0.05)
        yield c


def pool_whole(c, timeout=10.0):
    """An abort reaches the engine at its next step boundary: wait for the pool to come back whole."""
    deadline = time.monotonic() + timeout
    while True:
        kv = c.get("/debug/kv").json()
        if kv["invariants_ok"] and kv["free_blocks"] == kv["total_blocks"]:
            return
        assert time.monotonic() < deadline, f"KV pool not whole: {kv}"
        time.sleep(0.05)


def events(text: str) -> list:
    return [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]


@pytest.fixture
def failing_steps(monkeypatch):
    """Model steps raise while `on[0]` is true."""
    on = [False]
    real = ModelRunner.run

    def flaky(self, step):
        if on[0]:
            raise RuntimeError("device lost")
        return real(self, step)
    monkeypatch.setattr(ModelRunner, "run", flaky)
    return on


@pytest.mark.parametrize("kind", ["completions", "chat/completions"])
def test_a_failed_model_step_answers_500_or_an_error_event(qwen3_tiny, failing_steps, kind):
    body = dict(BODY) if kind == "completions" else \
        {k: v for k, v in BODY.items() if k != "prompt"} | {"messages": [{"role": "user", "content": "hi"}]}
    with server(qwen3_tiny) as c:
        failing_steps[0] = True
        r = c.post(f"/v1/{kind}", json=body)
        assert r.status_code == 500, r.text
        err = r.json()["error"]
        assert err["code"] == 500 and "model step failed: device lost" in err["message"]
        assert "Traceback" not in r.text
        pool_whole(c)
        r = c.post(f"/v1/{kind}", json={**body, "stream": True})
        assert r.status_code == 200  # the headers left before the step ran
        ev = events(r.text)
        assert ev[-1] == "[DONE]"
        errs = [json.loads(e)["error"] for e in ev[:-1] if "error" in json.loads(e)]
        assert errs and "model step failed: device lost" in errs[0]["message"]
        pool_whole(c)
        failing_steps[0] = False  # the server goes on
        r = c.post(f"/v1/{kind}", json=body)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 6
        pool_whole(c)


def test_a_stream_that_breaks_after_its_headers_ends_with_an_error_and_aborts(qwen3_tiny, monkeypatch):
    """Rendering a chunk raises mid-stream: the client gets an error event and the end of the stream (no hang, no
    traceback), and the request is aborted in the engine (its blocks freed) though it had tokens left to make:
    steps are slowed so that the 45 tokens would take ~9 s, and the pool must be whole well before that."""
    real_step = ModelRunner.run

    def slow(self, step):
        time.sleep(0.2)
        return real_step(self, step)
    monkeypatch.setattr(ModelRunner, "run", slow)
    real = ResponseBuilder.chunks
    calls = [0]

    def broken(self, recs):
        if any(r.new_token_ids for r in recs):
            calls[0] += 1
            if calls[0] == 2:
                raise KeyError("renderer bug")
        return real(self, recs)
    monkeypatch.setattr(ResponseBuilder, "chunks", broken)
    with server(qwen3_tiny) as c:
        t0 = time.monotonic()
        r = c.post("/v1/completions", json={**BODY, "max_tokens": 45, "stream": True})
        assert r.status_code == 200
        ev = events(r.text)
        assert ev[-1] == "[DONE]"
        err = json.loads(ev[-2])["error"]
        assert err["code"] == 500 and "internal server error" in err["message"]
        assert "renderer bug" not in r.text and "Traceback" not in r.text
        texts = [json.loads(e)["choices"][0]["text"] for e in ev[:-2] if "choices" in json.loads(e)]
        assert len(texts) < 45
        pool_whole(c, timeout=max(0.1, 4.0 - (time.monotonic() - t0)))
        monkeypatch.setattr(ResponseBuilder, "chunks", real)
        monkeypatch.setattr(ModelRunner, "run", real_step)
        r = c.post("/v1/completions", json=BODY)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 6
        pool_whole(c)
