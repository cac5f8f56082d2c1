"""Start `pdserve serve` as a subprocess on a free loopback port, wait for /health, and always clean it up.

The server runs in its own session (process group), so teardown can end it and anything it started (the engine
process of `--engine-backend process`) by that group id, and check that nothing is left.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


class ServerProcess:
    def __init__(self, model_dir: str, *args: str, api_key: str | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.log_file = tempfile.NamedTemporaryFile("w+", prefix="pdserve-test-server-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "pdserve.cli", "serve", model_dir, "--port", str(self.port), *args]
        if api_key:
            cmd += ["--api-key", api_key]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=self.log_file, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
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

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        """Send `sig` to the server, wait for it; returns its exit code. Kills the group if it does not exit."""
        if self.proc.poll() is None:
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
