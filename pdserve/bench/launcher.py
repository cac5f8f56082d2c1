"""Deployments on loopback for `bench pd`: a collocated server, N collocated servers behind pdserve's router
(`collocated-xN`), or router + 1 P + 1 D, as child processes (the router pdserve's, or vLLM's `vllm-router` in its
P/D mode).

Each child leads its own process group (teardown ends it and anything it started by group id) and, on Linux, gets
SIGTERM if the orchestrator dies without cleaning up (PR_SET_PDEATHSIG): children never outlive the bench.
"""
from __future__ import annotations

import ctypes
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from pdserve.bench.http_get import get_json, http_get


_POOL = re.compile(r"collocated-x(\d+)")
# 1P1D arms whose first token comes from P; -early adds the router's --pd-early-decode (pdserve's router only)
FIRST_TOKEN_ARMS = ("first-token", "first-token-early", "first-token-late")


def collocated_nodes(arm: str) -> int:
    """How many collocated servers an arm runs: 1 for `collocated`, N for `collocated-xN` (N >= 2, behind the
    router), 0 for a P/D arm."""
    if arm == "collocated":
        return 1
    m = _POOL.fullmatch(arm)
    return int(m[1]) if m and int(m[1]) >= 2 else 0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


try:  # loaded here, not in the forked child: dlopen after fork in a threaded process can deadlock
    _LIBC = ctypes.CDLL("libc.so.6", use_errno=True)
except OSError:
    _LIBC = None  # not Linux: the orchestrator's own teardown still runs


def _die_with_parent() -> None:
    if _LIBC is not None:
        _LIBC.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        if os.getppid() == 1:  # the bench died before prctl took effect
            os._exit(1)


def group_alive(pgid: int) -> bool:
    """Whether any process of the group still runs. Zombies do not count: a child reparented to an init that reaps
    slowly (multiprocessing's resource tracker, in containers) stays a zombie for up to a second after it exited."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        pids = [int(d) for d in os.listdir("/proc") if d.isdigit()]
    except OSError:  # no procfs: the signal probe's answer stands
        return True
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        if int(fields[2]) == pgid and fields[0] != b"Z":
            return True
    return False


@dataclass
class Child:
    name: str
    url: str
    proc: subprocess.Popen
    log_path: Path

    def log_tail(self, n: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-n:]


@dataclass
class Deployment:
    arm: str
    log_dir: Path
    children: list[Child] = field(default_factory=list)
    url: str = ""
    decode_urls: list[str] = field(default_factory=list)

    def spawn(self, name: str, args: list[str], port: int, env: dict, program: Optional[list[str]] = None) -> str:
        """Start `pdserve <args>` (or `program <args>`) on `port`; returns its URL."""
        log_path = self.log_dir / f"{self.arm}-{name}.log"
        cmd = [*(program or [sys.executable, "-m", "pdserve.cli"]), *args, "--port", str(port)]
        with log_path.open("w") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                    preexec_fn=_die_with_parent, env={**os.environ, **env, "PYTHONUNBUFFERED": "1"})
        url = f"http://127.0.0.1:{port}"
        self.children.append(Child(name, url, proc, log_path))
        return url

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        pending = list(self.children)
        while pending:
            for c in list(pending):
                if c.proc.poll() is not None:
                    raise RuntimeError(f"{self.arm}: {c.name} exited with {c.proc.returncode}:\n{c.log_tail()}")
                try:
                    if http_get(c.url + "/health", 2.0)[0] == 200:
                        pending.remove(c)
                except OSError:
                    pass
            if pending and time.monotonic() > deadline:
                raise TimeoutError(f"{self.arm}: {pending[0].name} not healthy after {timeout:.0f} s "
                                   f"(log: {pending[0].log_path})")
            time.sleep(0.2)
        # A router's health checks lag its nodes' by up to a second: until it sees every node back, it would send
        # requests to D alone (D prefills them, and they count as non-FULL steps that are only a start-up artefact).
        for router in (c for c in self.children if c.name == "router"):
            while not self._router_sees_all(router.url):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{self.arm}: the router does not see every node healthy after "
                                       f"{timeout:.0f} s (log: {router.log_path})")
                time.sleep(0.2)

    @staticmethod
    def _router_sees_all(url: str) -> bool:
        try:
            nodes = get_json(url + "/nodes", 2.0)
            return all(n["healthy"] for n in nodes["prefill"] + nodes["decode"])
        except (OSError, ValueError, KeyError, TypeError):
            return False

    def stop(self, timeout: float = 20.0) -> list[str]:
        """SIGTERM every child (routers first, so nodes drain idle), then SIGKILL what is left; returns the names of
        children whose process group had to be killed."""
        killed = []
        for c in reversed(self.children):
            if c.proc.poll() is None:
                c.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for c in reversed(self.children):
            if reap_group(c.proc, deadline):
                killed.append(c.name)
        return killed


def reap_group(proc: subprocess.Popen, deadline: float) -> bool:
    """Waits until `proc` (a process group's leader, already signalled) and every other process of its group have
    exited, up to `deadline` (time.monotonic()); SIGKILLs the group if any is left. Returns whether it had to."""
    try:
        proc.wait(max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    # a server exits before its engine-core process (same group) has finished exiting: give it the rest
    while group_alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if not group_alive(proc.pid):
        return False
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(10)
    return True


def vllm_router_program() -> Optional[str]:
    """The `vllm-router` executable (beside this Python's, or on PATH), or None."""
    here = Path(sys.executable).parent / "vllm-router"
    return str(here) if os.access(here, os.X_OK) else shutil.which("vllm-router")


def launch(dep: Deployment, model: str, server_args: list[str], token: str, router: str = "pdserve",
           speculative_config: Optional[str] = None, kv_extra: Optional[dict] = None) -> None:
    """Spawns `dep.arm`: `collocated`, `collocated-xN` (N servers behind pdserve's router), or 1P1D named by D's
    full-graph rule (`strict`, `default`, `prompt-tail`) or `first-token` (the default rule, the first token from P;
    with pdserve's router D asked as P is, its early decode default; `first-token-early` the same with the flag given,
    `first-token-late` with `--no-pd-early-decode`)
    behind `router` (pdserve, or vllm-router), with `speculative_config` (JSON) on the node that decodes and
    `kv_extra` merged into both nodes' KV configs.
    Children are added to `dep` as they start, so a teardown mid-launch still finds them."""
    spec = [] if speculative_config is None else ["--speculative-config", speculative_config]
    arm = dep.arm
    env = {"PDSERVE_KV_TOKEN": token}  # via the environment: never on a command line others can read
    serve = ["serve", model, *server_args]
    # Every arm gets the same cores: collocated all of them, P and D half each, N pooled servers 1/N each. Two torch
    # processes that each spin up one thread per core on the same cores slow each other's GEMMs many times over
    # (NOTES.md).
    cpus = os.cpu_count() or 1
    pool = collocated_nodes(arm)
    threads = os.environ.get("OMP_NUM_THREADS") or str(cpus if arm == "collocated" else max(1, cpus // (pool or 2)))
    env["OMP_NUM_THREADS"] = threads
    if arm == "collocated":
        dep.url = dep.spawn("server", [*serve, *spec], free_port(), env)
        return
    if pool:  # the router's collocated pool: every request served whole by one server, in turn
        dep.decode_urls = [dep.spawn(f"server{i}", [*serve, *spec], free_port(), env) for i in range(pool)]
        dep.url = dep.spawn("router", ["router", "--decode", *dep.decode_urls, "--log-level", "warning"], free_port(),
                            env)
        return
    kv_port = free_port()
    producer = {"kv_connector": "TcpConnector", "kv_role": "kv_producer", "kv_port": kv_port}
    consumer = {"kv_connector": "TcpConnector", "kv_role": "kv_consumer", "kv_peers": [f"127.0.0.1:{kv_port}"]}
    producer, consumer = {**producer, **(kv_extra or {})}, {**consumer, **(kv_extra or {})}
    rule = [] if arm in ("default", *FIRST_TOKEN_ARMS) else ["--full-graph-rule", arm]
    # first-token: P hands D its first token even to a router that does not ask (vllm-router); ours asks
    first = ["--pd-first-token", "prefill"] if arm in FIRST_TOKEN_ARMS else []
    # first-token-early: the router also sends D the request as it sends P, and D takes P's hand-off itself (the
    # router's default, so the same deployment as first-token there); first-token-late: D asked after P answered
    early = {"first-token-early": ["--pd-early-decode"], "first-token-late": ["--no-pd-early-decode"]}.get(arm, [])
    p = dep.spawn("prefill", [*serve, *first, "--kv-transfer-config", json.dumps(producer)], free_port(), env)
    d = dep.spawn("decode", [*serve, *rule, *spec, "--kv-transfer-config", json.dumps(consumer)], free_port(),
                  env)
    dep.decode_urls = [d]
    if router == "vllm-router":  # P/D mode: P's params relayed verbatim; it waits for both nodes' /health itself
        args = ["--vllm-pd-disaggregation", "--prefill", p, "none", "--decode", d, "--host", "127.0.0.1",
                "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
                "--worker-startup-check-interval", "1", "--log-level", "warning"]
        dep.url = dep.spawn("vllm-router", args, free_port(), env, program=[vllm_router_program()])
        return
    dep.url = dep.spawn("router", ["router", "--prefill", p, "--decode", d, *first, *early, "--log-level",
                                   "warning"], free_port(), env)
