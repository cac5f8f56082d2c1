"""Server life cycle: admission control (--max-waiting -> 503), graceful shutdown on SIGTERM with a request in flight
(aborted cleanly after --shutdown-timeout, exit 0, nothing left running), the process engine backend on SIGINT, and
/health going 503 while the engine process is stopped (SIGSTOP), 200 again after SIGCONT."""
from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

from tests.server_harness import ServerProcess, group_alive


def _stream_lines(client: httpx.Client, body: dict, first_event: threading.Event, sink: list) -> None:
    with client.stream("POST", "/v1/completions", json=body) as r:
        sink.append(r.status_code)
        for line in r.iter_lines():
            if line.startswith("data: "):
                sink.append(line[6:])
                first_event.set()
    first_event.set()


def assert_group_gone(srv, why: str, within: float = 5.0) -> None:
    """No process of the server's group runs `within` s from now (its engine process included)."""
    deadline = time.monotonic() + within
    while group_alive(srv.pgid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not group_alive(srv.pgid), why


@pytest.fixture(scope="module")
def server(qwen3_tiny):
    srv = ServerProcess(qwen3_tiny, "--enable-debug-routes", "--max-num-seqs", "1", "--max-waiting", "1",
                        "--shutdown-timeout", "1", "--max-model-len", "2048", "--num-gpu-blocks-override", "256")
    try:
        srv.wait_healthy()
        yield srv
    finally:
        srv.cleanup()


def test_max_waiting_then_sigterm(server):
    long = {"prompt": "while True:", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.url, timeout=60) as c:
        a_first, a_lines = threading.Event(), []
        ta = threading.Thread(target=_stream_lines, args=(c, long, a_first, a_lines), daemon=True)
        ta.start()
        assert a_first.wait(30) and a_lines[0] == 200  # A is running: it holds the only seat
        b_first, b_lines = threading.Event(), []
        tb = threading.Thread(target=_stream_lines, args=(c, {**long, "max_tokens": 5}, b_first, b_lines),
                              daemon=True)
        tb.start()
        deadline = time.monotonic() + 10
        while not b_lines and time.monotonic() < deadline:  # B's headers: it is queued behind A
            time.sleep(0.02)
        time.sleep(0.3)
        r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=10)
        assert r.status_code == 503, r.text
        assert "max-waiting" in r.json()["error"]["message"] and r.json()["error"]["code"] == 503

        # SIGTERM with A (and B behind it) in flight: health goes away, A is aborted after --shutdown-timeout
        t0 = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        ta.join(30)
        tb.join(30)
        assert not ta.is_alive() and not tb.is_alive()
        assert a_lines[-1] == "[DONE]"
        finals = [json.loads(x)["choices"][0]["finish_reason"] for x in a_lines[1:-1] if json.loads(x)["choices"]]
        assert finals[-1] == "abort"
        assert b_lines[-1] == "[DONE]"
        assert time.monotonic() - t0 < 20
    assert server.proc.wait(30) == 0
    deadline = time.monotonic() + 5
    while group_alive(server.pgid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not group_alive(server.pgid), "a process of the server is still running"
    log = server.log()
    assert "draining" in log and "shut down cleanly" in log and "Traceback" not in log


def engine_child(server_pid: int) -> int:
    """The pid of the server's engine process (a multiprocessing spawn child)."""
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    cmd = f.read()
            except OSError:
                continue
            if ppid == server_pid and b"spawn_main" in cmd:
                return int(d)
    raise AssertionError(f"no engine process under pid {server_pid}")


def health_becomes(url: str, status: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if httpx.get(url + "/health", timeout=5).status_code == status:
            return True
        time.sleep(0.2)
    return False


def test_process_backend_sigint(qwen3_tiny):
    srv = ServerProcess(qwen3_tiny, "--engine-backend", "process", "--enable-debug-routes",
                        "--max-model-len", "512", "--num-gpu-blocks-override", "128", "--engine-stall-timeout", "1")
    try:
        srv.wait_healthy()
        # (whether /health said 503 before the engine was up depends on which start-up ends first: the engine's
        # process is launched before the server loads its tokenizer; a stopped engine's 503 is checked below)
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "import os", "max_tokens": 5, "temperature": 0,
                                                          "ignore_eos": True}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
        k = httpx.get(srv.url + "/debug/kv", timeout=10).json()
        assert k["used_blocks"] == 0 and k["invariants_ok"]
        m = httpx.get(srv.url + "/metrics", timeout=10).text
        assert "pdserve_cudagraph_steps_total" in m
        # a stopped engine process is alive and has sent no error: /health sees its unanswered ping
        child = engine_child(srv.proc.pid)
        os.kill(child, signal.SIGSTOP)
        try:
            assert health_becomes(srv.url, 503, 10)
        finally:
            os.kill(child, signal.SIGCONT)
        assert health_becomes(srv.url, 200, 10)
        assert srv.stop(signal.SIGINT, timeout=30) == 0
        assert_group_gone(srv, "the engine process outlived the server")
    finally:
        srv.cleanup()


def test_process_backend_drains_when_the_whole_group_gets_sigterm(qwen3_tiny):
    """systemd's default KillMode, `kill -TERM -<pgid>` and container inits signal the server and its engine child
    alike: a stream in flight still finishes (the child ignores SIGTERM and waits for the server's stop), and
    everything exits 0. Before, the child died at once and the stream ended with "the engine process exited"."""
    srv = ServerProcess(qwen3_tiny, "--engine-backend", "process", "--max-model-len", "512",
                        "--num-gpu-blocks-override", "128", "--shutdown-timeout", "20")
    try:
        srv.wait_healthy()
        lines: list = []
        started = threading.Event()

        def stream():
            body = {"prompt": "import os", "max_tokens": 300, "temperature": 0, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        lines.append(line[6:])
                        started.set()
        t = threading.Thread(target=stream)
        t.start()
        assert started.wait(30)
        os.killpg(srv.pgid, signal.SIGTERM)
        t.join(60)
        assert lines[-1] == "[DONE]", lines[-3:]
        chunks = [json.loads(x) for x in lines[:-1]]
        assert not any("error" in c for c in chunks), chunks[-2:]
        assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
        assert sum(len(c["choices"][0].get("text", "")) > 0 for c in chunks if c["choices"]) > 1
        assert srv.proc.wait(30) == 0
    finally:
        srv.cleanup()


def test_a_dead_engine_ends_its_streams_with_an_error_and_the_server_exits_1(qwen3_tiny):
    """The engine process SIGKILLed mid-stream: the stream ends with an error event and [DONE], and the server
    exits 1 (as vLLM's) so that a supervisor restarts it; before, it stayed up answering 503 for good."""
    srv = ServerProcess(qwen3_tiny, "--engine-backend", "process", "--max-model-len", "512",
                        "--num-gpu-blocks-override", "128")
    try:
        srv.wait_healthy()
        lines: list = []
        started = threading.Event()

        def stream():
            body = {"prompt": "import os", "max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        lines.append(line[6:])
                        started.set()
        t = threading.Thread(target=stream)
        t.start()
        assert started.wait(30)
        os.kill(engine_child(srv.proc.pid), signal.SIGKILL)
        t.join(30)
        assert not t.is_alive() and lines[-1] == "[DONE]", lines[-3:]
        assert "the engine process exited" in json.loads(lines[-2])["error"]["message"]
        assert srv.proc.wait(30) == 1
        assert_group_gone(srv, "a process of the server outlived it")
    finally:
        srv.cleanup()


@pytest.mark.parametrize("broken", ["tokenizer.json", "generation_config.json"])
def test_a_server_that_fails_after_its_engine_process_started_takes_it_along(qwen3_tiny, tmp_path, broken):
    """The engine's process starts before the server loads its tokenizer and the model's defaults (they overlap):
    when either is refused, the server exits 2 naming the file and its engine process is gone with it."""
    import shutil
    model = tmp_path / "model"
    shutil.copytree(qwen3_tiny, model)
    (model / broken).write_text('{"temperature": -1}' if broken == "generation_config.json" else "{not json")
    srv = ServerProcess(str(model))
    try:
        assert srv.proc.wait(60) == 2
        log = srv.log()
        assert ("cannot load its tokenizer" if broken == "tokenizer.json" else
                "default sampling parameters are invalid") in log, log[-2000:]
        assert "Traceback" not in log, log[-3000:]
        assert_group_gone(srv, "the engine process outlived the server")
    finally:
        srv.cleanup()
