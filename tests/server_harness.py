"""Start `pdserve serve` (and `pdserve router`) as subprocesses on free loopback ports, wait for /health, and always
clean them up; helpers the P/D tests share (KV configs, requests, pool and metric checks).

A server runs in its own session (process group), so teardown can end it and anything it started (the engine
process of `--engine-backend process`) by that group id, and check that nothing is left.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from pdserve.bench.launcher import _die_with_parent, free_port, group_alive  # noqa: F401 (re-exported)

REPO = Path(__file__).resolve().parent.parent



@contextmanager
def healthy(srv):
    """A started server once /health answers 200, cleaned up (process group included) however the block ends."""
    try:
        srv.wait_healthy()
        yield srv
    finally:
        srv.cleanup()


class ServerProcess:
    def __init__(self, model_dir: str, *args: str, api_key: str | None = None, port: int | None = None):
        self.args = args  # a restart on the same address: ServerProcess(model_dir, *old.args, port=old.port)
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.log_file = tempfile.NamedTemporaryFile("w+", prefix="pdserve-test-server-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "pdserve.cli", "serve", model_dir, "--port", str(self.port), *args]
        if api_key:
            cmd += ["--api-key", api_key]
        # one torch thread per server: the P/D tests run several servers on 2 cores, and torch processes that each
        # spin a thread per core slow each other's GEMMs many times over
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        # PR_SET_PDEATHSIG too: a test run killed outright (a timeout's SIGTERM skips every fixture's cleanup)
        # takes its servers with it instead of leaving them behind
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=self.log_file, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True, preexec_fn=_die_with_parent)
        self.pgid = self.proc.pid  # start_new_session: the server leads its own group

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def log(self) -> str:
        return Path(self.log_file.name).read_text(errors="replace")

    def wait_healthy(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        seen_503 = False
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            try:
                r = httpx.get(self.url + "/health", timeout=2.0)
                if r.status_code == 200:
                    self.seen_503_before_ready = seen_503
                    return
                seen_503 |= r.status_code == 503
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"server not healthy after {timeout} s:\n{self.log()[-4000:]}")

    def terminate(self) -> None:
        """SIGTERM, not waited for (`cleanup_all` ends many servers at once); a later stop() only waits."""
        if self.proc.poll() is None and not getattr(self, "terminated", False):
            self.proc.send_signal(signal.SIGTERM)
            self.terminated = True

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        """Send `sig` to the server, wait for it; returns its exit code. Kills the group if it does not exit."""
        if self.proc.poll() is None:
            if not (sig == signal.SIGTERM and getattr(self, "terminated", False)):
                self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.returncode

    def kill(self) -> None:
        if group_alive(self.pgid):
            os.killpg(self.pgid, signal.SIGKILL)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass

    def cleanup(self) -> None:
        self.stop(timeout=20.0)
        deadline = time.monotonic() + 5
        while group_alive(self.pgid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if group_alive(self.pgid):
            self.kill()
        self.log_file.close()
        os.unlink(self.log_file.name)


def cleanup_all(*procs) -> None:
    """Ends servers and routers together: SIGTERM to each first (each drains and exits on its own, in parallel),
    then each one's cleanup waits for it (a module's teardown took the sum of its servers' exits before)."""
    for p in procs:
        if p is not None and hasattr(p, "terminate"):
            p.terminate()
    for p in procs:
        if p is not None:
            p.cleanup()


# ---------------------------------------------------------------------------------------------------- P/D helpers
KV_TOKEN = "pd-test-token"
# the flags of the float64 P/D files' nodes, and of the collocated server they compare against (conftest.reference_f64)
F64_COMMON = ("--max-model-len", "512", "--kv-cache-memory-gb", "0.05", "--dtype", "float64", "--enable-debug-routes")


class RouterProcess:
    def __init__(self, prefill: list[str], decode: list[str], *args: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "pdserve.cli", "router", "--port", str(self.port), "--prefill", *prefill,
               "--decode", *decode, "--health-interval", "0.3", *args]
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=True, preexec_fn=_die_with_parent)

    def wait_healthy(self, timeout=60.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise TimeoutError("router not healthy")

    def terminate(self) -> None:
        if self.proc.poll() is None and not getattr(self, "terminated", False):
            self.proc.terminate()
            self.terminated = True

    def cleanup(self):
        self.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        assert not group_alive(self.proc.pid) or self.proc.poll() is not None


def kv_config(role: str, **extra) -> str:
    return json.dumps({"kv_connector": "TcpConnector", "kv_role": role, "kv_auth_token": KV_TOKEN,
                       "kv_transfer_timeout": 1.5, **extra})


def complete(url: str, prompt, stream: bool = False, max_tokens: int = 12, **extra) -> str:
    body = {"model": "qwen3-tiny-s0", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": stream, **extra}
    if not stream:
        r = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]
    text = ""
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200, (r.status_code, r.read())
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += json.loads(line[6:])["choices"][0]["text"]
    return text


def kv_state(server) -> dict:
    return httpx.get(server.url + "/debug/kv", timeout=5).json()


def wait_pools_whole(*servers, timeout=10.0):
    """Every block back in each server's pool (leases released too), none orphaned (the reclamation gauge at rest)
    and the engine's invariants hold."""
    deadline = time.monotonic() + timeout

    def whole(s: dict) -> bool:
        return s["used_blocks"] == 0 and s["invariants_ok"] and s["orphaned_blocks"] == 0
    while True:
        states = [kv_state(s) for s in servers]
        if all(whole(s) for s in states) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    for s in states:
        assert whole(s), s


def metrics(url: str) -> dict:
    """{(sample name, sorted label items): value} of a /metrics page."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def metric(url_or_metrics, name: str, **labels) -> float:
    """Sum of the samples named `name` whose labels include `labels`."""
    m = metrics(url_or_metrics) if isinstance(url_or_metrics, str) else url_or_metrics
    return sum(v for (n, lab), v in m.items() if n == name and set(labels.items()) <= set(lab))
