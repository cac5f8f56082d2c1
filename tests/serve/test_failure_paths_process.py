"""Failure paths of the process engine backend (serve/async_engine.py's pipe threads, serve/engine_core.py's
PipeInbox and run_in_process): the engine process dies mid-request (SIGKILL: its pipe reaches EOF on the server's
side, and the server's next command meets a broken pipe), and the server goes away under a running engine (the
engine's side meets EOF and a broken pipe). The first runs a real engine process (~2 s to start); the second runs
the engine's process entry point on a thread of the test over real pipes, so coverage sees it. No thread may die
of an exception on either side."""
from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import msgspec
import signal
import threading
import time

import pytest

from pdserve import SamplingParams
from pdserve.config import EngineConfig
from pdserve.serve import engine_core
from pdserve.serve import request_context
from pdserve.serve.engine_commands import AddRequest
from pdserve.serve.engine_messages import EngineInfo, StepBatch, Wire
from pdserve.serve.responses import ResponseBuilder
from pdserve.worker.model_runner import ModelRunner
from tests.transfer.test_failure_paths_pd import served
from tests.serve.test_failure_paths_serving import BODY, events


@pytest.fixture
def thread_deaths(monkeypatch):
    """Exceptions that ended a thread (threading.excepthook), e.g. a pipe thread's unhandled BrokenPipeError."""
    seen: list = []
    monkeypatch.setattr(threading, "excepthook", lambda args: seen.append((args.thread.name, args.exc_value)))
    return seen


def stream_until_it_ends(c) -> tuple[list, list]:
    """A 45-token stream, run on a thread so that a hang fails the test in 10 s: (its events, its error objects)."""
    out = {}
    client = threading.Thread(target=lambda: out.update(r=c.post(
        "/v1/completions", json={**BODY, "max_tokens": 45, "stream": True})), daemon=True)
    client.start()
    client.join(10)
    assert not client.is_alive(), "the stream never ended"
    assert out["r"].status_code == 200
    ev = events(out["r"].text)
    return ev, [json.loads(e)["error"] for e in ev[:-1] if "error" in json.loads(e)]


def test_the_engine_process_dying_fails_its_requests_and_refuses_new_ones(qwen3_tiny, monkeypatch, thread_deaths):
    """SIGKILL of the engine process while a stream is generating: the stream ends with an error event naming the
    engine's exit (not a hang), /health and new requests say the engine is not running (503), and shutting down
    afterwards (a `stop` written to the dead pipe) is quiet. The KV pool died with the process: there is none to
    check."""
    real = ResponseBuilder.chunks
    killed = []

    def kill_on_first_token(self, recs):
        if not killed and any(r.new_token_ids for r in recs):
            os.kill(state.engine._backend.proc.pid, signal.SIGKILL)
            killed.append(time.monotonic())
        return real(self, recs)
    monkeypatch.setattr(ResponseBuilder, "chunks", kill_on_first_token)
    with served(qwen3_tiny, engine_backend="process") as (c, state):
        ev, errs = stream_until_it_ends(c)
        assert killed and ev[-1] == "[DONE]"
        assert errs and "the engine process exited" in errs[0]["message"], ev[-3:]
        texts = [json.loads(e)["choices"][0]["text"] for e in ev[:-1] if "choices" in json.loads(e)]
        assert len(texts) < 45
        r = c.get("/health")
        assert r.status_code == 503 and r.json() == {"status": "engine not running: the engine process exited"}
        r = c.post("/v1/completions", json=BODY)
        assert r.status_code == 503 and "the engine is not running" in r.json()["error"]["message"]
        assert state.engine.num_in_flight == 0
        proc = state.engine._backend.proc
    assert not proc.is_alive() and proc.exitcode == -signal.SIGKILL
    assert not thread_deaths, thread_deaths


def test_the_engine_stops_cleanly_when_the_server_goes_away(qwen3_tiny, monkeypatch, thread_deaths, caplog):
    """The server process is gone (both pipe ends closed on its side) while the engine generates: the engine's
    outputs meet a broken pipe and its inbox an EOF, which it takes as `stop`: it frees the requests it holds
    (the pool whole) and ends, never as a loop death."""
    cores = []

    class Recorded(engine_core.EngineCore):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            cores.append(self)
    monkeypatch.setattr(engine_core, "EngineCore", Recorded)
    monkeypatch.setattr(signal, "signal", lambda *a: None)  # the entry point's, for a main thread
    monkeypatch.setattr(request_context, "configure_logging", lambda level: None)
    real = ModelRunner.run

    def slow(self, step):  # 45 tokens take ~2 s
        time.sleep(0.05)
        return real(self, step)
    monkeypatch.setattr(ModelRunner, "run", slow)
    caplog.set_level(logging.INFO, logger="pdserve.serve.engine")
    ctx = mp.get_context("spawn")
    cmd_recv, cmd_send = ctx.Pipe(duplex=False)
    out_recv, out_send = ctx.Pipe(duplex=False)
    cfg = EngineConfig.from_kwargs(qwen3_tiny, block_size=4, max_model_len=53)
    t = threading.Thread(target=engine_core.run_in_process, args=(cfg, cmd_recv, out_send, "info"),
                         name="engine-child", daemon=True)
    t.start()
    try:
        wire = Wire()
        assert out_recv.poll(60)
        assert isinstance(wire.decode(out_recv.recv_bytes()), EngineInfo)
        sp = SamplingParams(temperature=0.0, max_tokens=45, ignore_eos=True)
        for rid in ("a", "b"):
            cmd_send.send(AddRequest(rid, [5, 6, 7, 8], sp, time.monotonic()))
        deadline = time.monotonic() + 20
        while True:  # until both generate
            assert out_recv.poll(max(deadline - time.monotonic(), 0.01)), "no tokens"
            batch = wire.decode(out_recv.recv_bytes())
            assert isinstance(batch, StepBatch), batch
            if sum(bool(r.new_token_ids) for r in batch.records) == 2:
                break
        out_recv.close()  # the server is gone
        cmd_send.close()
        t.join(10)
        assert not t.is_alive(), "the engine did not stop"
    finally:
        for conn in (out_recv, cmd_send):
            conn.close()
    eng = cores[0].engine
    eng.check_invariants()
    assert eng.kv.num_free_blocks() == eng.num_blocks - 1, "blocks leaked"
    assert not eng.scheduler.requests
    logs = caplog.text
    assert "engine stopped: 0 KV blocks in use" in logs and "engine loop died" not in logs, logs
    assert not thread_deaths, thread_deaths


def test_an_engine_output_that_does_not_decode_ends_the_requests_and_the_engine(qwen3_tiny, monkeypatch,
                                                                               thread_deaths):
    """A frame from the engine process that fails to decode: its tokens are lost, so the stream ends with an
    error event naming it (not a wait forever), the engine process is stopped and new requests get 503."""
    real = Wire.decode
    broken = []

    def decode(self, frame):
        obj = real(self, frame)
        if not broken and isinstance(obj, StepBatch) and any(r.new_token_ids for r in obj.records):
            broken.append(obj)
            raise msgspec.DecodeError("truncated frame")
        return obj
    monkeypatch.setattr(Wire, "decode", decode)
    with served(qwen3_tiny, engine_backend="process") as (c, state):
        ev, errs = stream_until_it_ends(c)
        assert broken and errs and "an engine output could not be read (DecodeError)" in errs[0]["message"], ev[-3:]
        r = c.post("/v1/completions", json=BODY)
        assert r.status_code == 503
        assert state.engine.num_in_flight == 0
        proc = state.engine._backend.proc
        proc.join(5)
        assert not proc.is_alive()
    assert not thread_deaths, thread_deaths
