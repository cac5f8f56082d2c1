"""An engine whose device is unusable declares itself dead (issue 37): a sticky device error (CUDA's illegal memory
access, a device-side assert) fails every later step, and an engine that only failed each step's requests was a
zombie: every request a 500 while /health said 200, so no router or supervisor reacted. Simulated on CPU by a model
step that raises what CUDA raises through torch (torch.AcceleratorError), for both engine backends; the process
backend's engine loop runs on a thread of the test (its pipes, wire and reader as in a real child process) so the
injected failure reaches it. Each ends with the requests failed with a message, /health and new requests 503
naming the cause, and the KV pool whole."""
from __future__ import annotations

import contextlib
import multiprocessing.context
import os
import signal
import threading
import time

import pytest
import torch
from multiprocessing.connection import Connection

from pdserve import LLM, SamplingParams
from pdserve.core.step_pipeline import MAX_FAILED_STEPS, EngineDeadError
from pdserve.serve import engine_backend, engine_core, request_context
from pdserve.worker.device_errors import device_unusable
from pdserve.worker.model_runner import ModelRunner
from tests.serve.test_failure_paths_serving import BODY
from tests.transfer.test_failure_paths_pd import served

ILLEGAL = "CUDA error: an illegal memory access was encountered"


class ThreadProcess(threading.Thread):
    """The spawn context's Process, as a thread of this process: the engine's entry point (run_in_process), its
    pipes and the server's reader and writer run as in a child, and the test's monkeypatches reach the engine."""

    exitcode = None

    def __init__(self, target, name, daemon, args):
        # the parent closes its copies of the child's pipe ends once started: the thread keeps duplicates, as a
        # child process has its own descriptors
        args = tuple(Connection(os.dup(a.fileno()), readable=a.readable, writable=a.writable)
                     if isinstance(a, Connection) else a for a in args)
        self.pipes = [a for a in args if isinstance(a, Connection)]
        super().__init__(target=target, name=name, daemon=daemon, args=args)

    def run(self) -> None:
        try:
            super().run()
        finally:  # as a process's exit: the server's reader sees EOF
            for conn in self.pipes:
                conn.close()

    def kill(self) -> None:  # a thread cannot be killed; the engine's loop ends by itself here
        pass


@pytest.fixture
def cores(monkeypatch):
    """The EngineCores made (either backend), so a test can look at the dead engine's pool."""
    made = []

    class Recorded(engine_core.EngineCore):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            made.append(self)
    monkeypatch.setattr(engine_core, "EngineCore", Recorded)
    monkeypatch.setattr(engine_backend, "EngineCore", Recorded)
    real = multiprocessing.context.SpawnContext.Process

    def process(*a, **kw):  # the engine's child only: the JSON body worker (serve/json_body.py) stays a process
        return ThreadProcess(*a, **kw) if kw.get("name") == "pdserve-engine" else real(*a, **kw)
    monkeypatch.setattr(multiprocessing.context.SpawnContext, "Process", staticmethod(process))
    monkeypatch.setattr(signal, "signal", lambda *a: None)  # run_in_process's, for a main thread
    monkeypatch.setattr(request_context, "configure_logging", lambda level: None)
    return made


def test_which_errors_mean_the_device_is_unusable():
    assert device_unusable(torch.AcceleratorError(ILLEGAL)) == f"AcceleratorError: {ILLEGAL}"
    assert device_unusable(RuntimeError("CUDA error: device-side assert triggered\nCUDA kernel errors might be"))
    try:  # raised from one: a wrapper (a sampler's, a graph replay's) does not hide it
        try:
            raise RuntimeError("RuntimeError: CUDA error: unspecified launch failure")
        except RuntimeError as inner:
            raise ValueError("step failed") from inner
    except ValueError as e:
        assert device_unusable(e) == "RuntimeError: RuntimeError: CUDA error: unspecified launch failure"
    for recoverable in (RuntimeError("device lost"), ValueError("bad input"),
                        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
                        torch.AcceleratorError("CUDA error: out of memory")):
        assert device_unusable(recoverable) is None, recoverable


@pytest.mark.parametrize("backend", ["thread", "process"])
def test_a_sticky_device_error_marks_the_engine_dead(qwen3_tiny, monkeypatch, cores, backend):
    """Steps start raising CUDA's illegal-address error with two requests in flight: both end with a 500 naming
    it, /health answers 503 with the reason, a new request a 503, and the dead engine's pool is whole."""
    on = threading.Event()
    real = ModelRunner.run

    def sticky(self, step):
        if on.is_set():
            raise torch.AcceleratorError(ILLEGAL)
        time.sleep(0.02)  # 40 tokens take ~1 s: both requests are in flight when the device fails
        return real(self, step)
    monkeypatch.setattr(ModelRunner, "run", sticky)
    with served(qwen3_tiny, engine_backend=backend) as (c, state):
        assert c.post("/v1/completions", json=BODY).status_code == 200
        answers = []
        clients = [threading.Thread(target=lambda: answers.append(c.post(
            "/v1/completions", json={**BODY, "max_tokens": 40})), daemon=True) for _ in range(2)]
        for t in clients:
            t.start()
        deadline = time.monotonic() + 10
        while state.engine.num_in_flight < 2:
            assert time.monotonic() < deadline, "the requests never arrived"
            time.sleep(0.005)
        on.set()
        for t in clients:
            t.join(20)
        assert len(answers) == 2
        for r in answers:
            assert r.status_code == 500, r.text
            msg = r.json()["error"]["message"]
            assert "engine dead" in msg and "illegal memory access" in msg and "Traceback" not in r.text
        health = c.get("/health")
        assert health.status_code == 503, health.text
        assert health.json()["status"] == f"engine not running: engine dead: AcceleratorError: {ILLEGAL}"
        r = c.post("/v1/completions", json=BODY)
        assert r.status_code == 503 and "engine dead" in r.json()["error"]["message"], r.text
        backend = state.engine._backend
        loop = getattr(backend, "proc", None) or backend.threads[0]  # the engine loop: done tearing down
        loop.join(20)
        assert not loop.is_alive() and not state.engine.alive()
        eng = cores[-1].engine
        assert eng.kv.num_free_blocks() == eng.num_blocks - 1, "blocks leaked"
        assert not eng.scheduler.requests and eng.scheduler.transfers.orphaned_blocks() == 0


def test_steps_failing_in_a_row_mark_the_engine_dead(qwen3_tiny):
    """An error no marker names, in every step: the engine lets each step fail its requests until MAX_FAILED_STEPS
    failed in a row, then raises EngineDeadError; one step that lands in between starts the count again."""
    e = LLM(qwen3_tiny, block_size=4, max_model_len=53).engine
    real, fail = e.runner.run, [True]

    def broken(step):
        if fail[0]:
            raise RuntimeError("device lost")
        return real(step)
    e.runner.run = broken
    sp = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)

    def one_step(rid: str):
        e.add_request([5, 6, 7], sp, request_id=rid)
        return e.step()
    for i in range(MAX_FAILED_STEPS - 1):
        assert one_step(f"a{i}")[0].outputs[0].finish_reason == "error"
    fail[0] = False
    e.add_request([5, 6, 7], sp, request_id="ok")
    while e.has_unfinished_requests():
        e.step()
    fail[0] = True
    for i in range(MAX_FAILED_STEPS - 1):  # the count started again
        assert one_step(f"b{i}")[0].outputs[0].finish_reason == "error"
    with pytest.raises(EngineDeadError, match=f"{MAX_FAILED_STEPS} model steps failed in a row.*device lost"):
        one_step("last")
    outs = e.fail_all("engine dead")
    assert [o.request_id for o in outs] == ["last"] and outs[0].error == "engine dead"
    assert e.kv.num_free_blocks() == e.num_blocks - 1 and not e.scheduler.requests


def test_a_dead_prefill_node_fails_its_requests_and_frees_its_leases(qwen3_tiny, monkeypatch):
    """P/D: a prefill node's device fails with a lease open for a decode node: the request in flight ends with the
    error, the loop reports the death, and once its KV server is down the leased blocks go back too (a dead node
    serves no reader: D's pull fails and D prefills locally)."""
    import queue

    from pdserve.config import EngineConfig
    from pdserve.serve.engine_commands import AddRequest
    from tests.serve.test_failure_paths_engine_core import Loop
    from tests.server_harness import free_port
    on, real = threading.Event(), ModelRunner.run

    def sticky(self, step):
        if on.is_set():
            raise torch.AcceleratorError("CUDA error: device-side assert triggered")
        return real(self, step)
    monkeypatch.setattr(ModelRunner, "run", sticky)
    loop = Loop(EngineConfig.from_kwargs(qwen3_tiny, block_size=4, max_model_len=53, kv_transfer_config={
        "kv_connector": "TcpConnector", "kv_role": "kv_producer", "kv_port": free_port(), "kv_auth_token": "s"}))
    try:
        one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        loop.inbox.put(AddRequest("p", list(range(5, 25)), one, time.monotonic(), {"do_remote_decode": True}))
        assert loop.finished("p").kv_transfer_params["do_remote_prefill"]
        eng = loop.core.engine
        assert eng.scheduler.transfers.num_leased_blocks() > 0
        on.set()
        loop.add("victim", [5, 6, 7])
        deadline = time.monotonic() + 20
        while not loop.errors:
            assert time.monotonic() < deadline, "the death was never reported"
            with contextlib.suppress(queue.Empty):
                loop._pump(0.5)
        assert "engine dead" in str(loop.errors[0]) and "device-side assert" in str(loop.errors[0])
        victim = [r for r in loop.records["victim"] if r.finished]
        assert victim and victim[0].finish_reason == "error" and "engine dead" in victim[0].error
        loop.thread.join(20)
        assert not loop.thread.is_alive()
        assert eng.kv.num_free_blocks() == eng.num_blocks - 1, "blocks leaked"
        assert not eng.scheduler.transfers.leased and eng.scheduler.transfers.orphaned_blocks() == 0
    finally:
        loop.inbox.put(engine_core.Stop())
        loop.thread.join(20)
