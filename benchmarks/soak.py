"""A randomized, seed-fixed soak of real pdserve processes with injected faults, an oracle and invariants (issue 37).

Topologies (both by default, side by side on one machine): `2p2d` (2 P + 2 D, TcpConnector) and `1p1d-spec` (1 P +
1 D with n-gram speculative decoding on D). Each topology sits behind two `pdserve router`s, one per first-token mode
(`--pd-first-token replay` and `prefill`); a request picks a router at random. Every node runs the same tiny model
in float64, so greedy and seeded answers are exactly comparable with the oracle, a collocated `pdserve serve` of the
same model that is never faulted.

Faults (seeded: their kinds, gaps, targets and sizes come from --seed; their outcomes depend on timing):
  proxy_delay, proxy_truncate, proxy_reset, proxy_blackhole: a TCP fault proxy sits in front of each P's KV port and
      D's `kv_peers` name the proxy; for a window it delays every chunk, cuts connections after a few bytes, resets
      them, or accepts and never forwards (existing sessions stall too);
  kill_d: SIGKILL a decode node while it streams (the router should migrate its streams), restart it on its port;
  kill_p: SIGKILL a prefill node, restart it on its ports;
  stop_short / stop_long: SIGSTOP a node, SIGCONT it later; short stalls last less than kv_transfer_timeout +
      kv_lease_seconds (the issue's target: 0 client errors from those), long ones more.

Invariants: 0 wrong answers (text and finish_reason equal to the oracle's; `wrong_tokens` in the JSON counts answers
with any token off), 0 hangs (every request has a client-side deadline, --deadline), every node's `/debug/kv`
`invariants_ok` while it runs, 0 used blocks on every node at rest, 0 crashes (no process died that the harness did
not kill). Client-visible errors are counted by cause (HTTP status or error event, and the message), with the
faults they overlapped. Prints a table and writes a JSON file; exits 1 when an invariant broke.

    python benchmarks/soak.py --duration 1800 --seed 1 --out benchmarks/results/soak_30min.json

Every server binds 127.0.0.1 on a free port (each P's fault proxy takes its KV port on 127.0.0.2, which P advertises)
and leads its own process group (PR_SET_PDEATHSIG too); the harness ends
them all on its way out, exception and Ctrl-C included.
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from pdserve.bench.launcher import _die_with_parent, free_port, group_alive

REPO = Path(__file__).resolve().parent.parent
KV_TOKEN = "soak-kv-token"
BLOCK = 16
PROXY_HOST = "127.0.0.2"  # where each P's fault proxy listens (Linux routes all of 127/8 to lo)
MODEL_NAME = "soak-model"
SPEC_CONFIG = '{"method":"ngram","num_speculative_tokens":2,"prompt_lookup_max":3}'
CORPUS = """def fibonacci(n):
    if n < 2:
        return n
    return fibonacci(n - 1) + fibonacci(n - 2)

The quick brown fox jumps over the lazy dog. A prefill node computes the prompt and a decode node streams the answer;
the router sends each request to both and the client sees one stream. Blocks are leased, read and freed again.
for i in range(10):
    print(i, i * i, "squares and cubes", i ** 3)
Once upon a time there was a small model that wrote random words, and every word it wrote was checked twice.
"""
STOPS = ["\n", " the", "e ", ".", "s", "(", " a", "in"]


def log(msg: str) -> None:
    print(f"[soak {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ------------------------------------------------------------------------------------------------ the fault proxy
class FaultProxy:
    """A TCP proxy in front of one P's KV port. Mode `pass` forwards; `delay` sleeps before each chunk; `truncate`
    closes a connection after a few more bytes from P; `reset` resets every connection (RST) and each new one;
    `blackhole` accepts new connections and never forwards, and stops forwarding on the existing ones. A window ends
    with `pass`: connections a blackhole held are closed then (what a D sees after a network partition heals)."""

    def __init__(self, upstream_port: int):
        # P's params name its KV port and `kv_advertise_host` but no port of their own, so the proxy takes the same
        # port on another loopback address (P: 127.0.0.1:X, proxy: PROXY_HOST:X, P advertises PROXY_HOST)
        self.upstream = ("127.0.0.1", upstream_port)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((PROXY_HOST, upstream_port))
        self.sock.listen(128)
        self.port = upstream_port
        self.mode, self.delay_s, self.truncate_bytes = "pass", 0.0, 0
        self.lock = threading.Lock()
        self.conns: set[tuple[socket.socket, socket.socket | None]] = set()
        self.held: set[socket.socket] = set()  # sockets a blackhole stalled: closed when its window ends
        self.closed = False
        self.stats = Counter()
        threading.Thread(target=self._accept, daemon=True, name=f"proxy-{self.port}").start()

    def set(self, mode: str, delay_s: float = 0.0, truncate_bytes: int = 0) -> None:
        with self.lock:
            self.mode, self.delay_s, self.truncate_bytes = mode, delay_s, truncate_bytes
            conns = list(self.conns)
        if mode == "reset":
            for c in conns:
                self._drop(c, reset=True)
        elif mode == "pass":  # a healed partition: what the blackhole held is gone
            for c in conns:
                if c[1] is None or c[0] in self.held or c[1] in self.held:
                    self._drop(c)
            self.held.clear()

    def _drop(self, conn, reset: bool = False) -> None:
        with self.lock:
            self.conns.discard(conn)
        for s in conn:
            if s is None:
                continue
            try:
                if reset:
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                s.close()
            except OSError:
                pass

    def _accept(self) -> None:
        while not self.closed:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            mode = self.mode
            self.stats[f"accepted_{mode}"] += 1
            if mode == "reset":
                self._drop((client, None), reset=True)
                continue
            if mode == "blackhole":
                with self.lock:
                    self.conns.add((client, None))
                continue
            try:
                up = socket.create_connection(self.upstream, timeout=5)
            except OSError:
                self._drop((client, None), reset=True)  # P down: D sees its dial fail, as without the proxy
                continue
            conn = (client, up)
            with self.lock:
                self.conns.add(conn)
            sent = [0]
            threading.Thread(target=self._pump, args=(client, up, conn, False, sent), daemon=True).start()
            threading.Thread(target=self._pump, args=(up, client, conn, True, sent), daemon=True).start()

    def _pump(self, src, dst, conn, from_p: bool, sent) -> None:
        src.settimeout(0.2)
        cut_at = None
        while True:
            with self.lock:
                if conn not in self.conns:
                    return
                mode, delay_s, trunc = self.mode, self.delay_s, self.truncate_bytes
            if mode == "blackhole":
                self.held.add(src)  # stalled, never forwarded: closed when the window ends
                time.sleep(0.05)
                continue
            try:
                data = src.recv(65536)
            except socket.timeout:
                continue
            except OSError:
                data = b""
            if not data:
                self._drop(conn)
                return
            if mode == "delay":
                time.sleep(delay_s)
            if mode == "truncate" and from_p:
                cut_at = sent[0] + trunc if cut_at is None else cut_at
                if sent[0] + len(data) >= cut_at:
                    data = data[:max(0, cut_at - sent[0])]
                    try:
                        dst.sendall(data)
                    except OSError:
                        pass
                    self.stats["truncated"] += 1
                    self._drop(conn)
                    return
            try:
                dst.sendall(data)
            except OSError:
                self._drop(conn)
                return
            if from_p:
                sent[0] += len(data)

    def close(self) -> None:
        self.closed = True
        try:
            self.sock.close()
        except OSError:
            pass
        for c in list(self.conns):
            self._drop(c)


# ------------------------------------------------------------------------------------------------ processes
class _Spawner:
    """Forks every child from one long-lived thread: PR_SET_PDEATHSIG fires when the *thread* that forked a child
    ends, so a node restarted from the fault thread would get SIGTERM when that thread returns."""

    def __init__(self):
        self.q: queue.Queue = queue.Queue()
        threading.Thread(target=self._run, daemon=True, name="spawner").start()

    def _run(self) -> None:
        while True:
            fn, box, done = self.q.get()
            try:
                box.append(fn())
            except BaseException as e:  # handed to the caller
                box.append(e)
            done.set()

    def call(self, fn):
        box: list = []
        done = threading.Event()
        self.q.put((fn, box, done))
        done.wait()
        if isinstance(box[0], BaseException):
            raise box[0]
        return box[0]


_SPAWNER: _Spawner | None = None
_SPAWNER_LOCK = threading.Lock()


def spawn(fn):
    global _SPAWNER
    with _SPAWNER_LOCK:
        if _SPAWNER is None:
            _SPAWNER = _Spawner()
    return _SPAWNER.call(fn)


@dataclass(eq=False)
class Proc:
    """A `pdserve serve` or `pdserve router` child in its own process group, restartable on the same port."""
    name: str
    argv: list[str]
    port: int
    log_dir: Path
    env: dict
    role: str = "oracle"  # prefill | decode | router | oracle
    topo: str = ""
    proc: subprocess.Popen | None = None
    down: bool = False  # the harness killed or stopped it: not a crash, not polled
    stopped: bool = False
    restarts: int = 0
    kv_port: int = 0
    proxy: FaultProxy | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        logf = (self.log_dir / f"{self.name}.log").open("a")
        logf.write(f"\n=== start {self.restarts}: {' '.join(self.argv)}\n")
        logf.flush()
        cmd = [sys.executable, "-m", "pdserve.cli", *self.argv, "--port", str(self.port)]
        self.proc = spawn(lambda: subprocess.Popen(cmd, cwd=REPO, stdout=logf, stderr=subprocess.STDOUT, env=self.env,
                                                   start_new_session=True, preexec_fn=_die_with_parent))
        logf.close()
        self.down = self.stopped = False

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.proc is not None and group_alive(self.proc.pid):
            os.killpg(self.proc.pid, sig)

    def kill(self) -> None:
        self.down = True
        self.signal(signal.SIGKILL)
        if self.proc is not None:
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                pass

    def terminate(self, timeout: float = 15.0) -> None:
        """SIGCONT (a stopped node cannot exit), SIGTERM, then SIGKILL the group if anything is left."""
        if self.proc is None:
            return
        self.down = True
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        deadline = time.monotonic() + 3
        while group_alive(self.proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if group_alive(self.proc.pid):
            self.signal(signal.SIGKILL)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                pass

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                tail = (self.log_dir / f"{self.name}.log").read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{tail}")
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise TimeoutError(f"{self.name} not healthy after {timeout:.0f} s (log: {self.log_dir / self.name}.log)")


# ------------------------------------------------------------------------------------------------ the workload
@dataclass
class Req:
    idx: int
    endpoint: str  # completions | chat
    body: dict
    stream: bool
    shape: str  # what the prompt is: "ids:1", "ids:kB", "ids:kB+1", "ids:n", "text", "chat"
    topo: str = ""
    router: str = ""


def oracle_key(body: dict, endpoint: str) -> str:
    b = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    return endpoint + json.dumps(b, sort_keys=True)


def make_request(rng: random.Random, idx: int, corpus_ids: list[int], max_prompt: int) -> Req:
    """One random request: prompt shape and length, max_tokens, greedy or seeded sampling (some with penalties, stop
    strings, min_tokens), streamed or whole, completions or chat."""
    words = CORPUS.split()
    endpoint = "chat" if rng.random() < 0.25 else "completions"
    body: dict = {"model": MODEL_NAME, "max_tokens": rng.choice([1, 2, rng.randint(3, 24), rng.randint(24, 96),
                                                                  rng.randint(96, 200)])}
    if endpoint == "chat":
        n = rng.randint(1, 3)
        body["messages"] = [{"role": "user" if i % 2 == 0 else "assistant",
                             "content": " ".join(rng.choice(words) for _ in range(rng.randint(1, 16)))}
                            for i in range(2 * n - 1)]  # <= 80 words: prompt + max_tokens stay in max_model_len
        shape = "chat"
    elif rng.random() < 0.7:  # token ids: exact lengths, the block edges included
        kind = rng.choice(["1", "kB", "kB+1", "n", "n"])
        k = rng.randint(1, max(1, (max_prompt - 1) // BLOCK))
        n = {"1": 1, "kB": k * BLOCK, "kB+1": k * BLOCK + 1}.get(kind) or rng.randint(2, max_prompt)
        start = rng.randrange(0, len(corpus_ids))
        body["prompt"] = [corpus_ids[(start + j) % len(corpus_ids)] for j in range(n)]
        shape = f"ids:{kind}"
    else:
        body["prompt"] = " ".join(rng.choice(words) for _ in range(rng.randint(1, 60)))
        shape = "text"
    if rng.random() < 0.5:
        body["temperature"] = 0
    else:
        body.update(temperature=round(rng.uniform(0.5, 1.3), 2), seed=rng.randint(0, 2**31 - 1))
        if rng.random() < 0.5:
            body["top_p"] = round(rng.uniform(0.6, 1.0), 2)
        if rng.random() < 0.3:
            body["top_k"] = rng.randint(2, 50)
    if rng.random() < 0.3:
        pen = rng.choice(["presence_penalty", "frequency_penalty", "repetition_penalty"])
        lo, hi = (1.05, 1.5) if pen == "repetition_penalty" else (-0.5, 1.5)
        body[pen] = round(rng.uniform(lo, hi), 2)
    if rng.random() < 0.25:
        body["stop"] = rng.sample(STOPS, rng.randint(1, 2))
    if rng.random() < 0.4:
        body["ignore_eos"] = True
    if rng.random() < 0.1:
        body["min_tokens"] = rng.randint(0, body["max_tokens"])
    stream = rng.random() < 0.6
    body["stream"] = stream
    if stream and rng.random() < 0.5:
        body["stream_options"] = {"include_usage": True}
    return Req(idx, endpoint, body, stream, shape)


@dataclass
class Outcome:
    text: str = ""
    finish: str | None = None
    error: str | None = None  # cause: "http 502", "event 500", "transport ReadError", "hang", ...
    detail: str = ""


class Deadline:
    """Closes a request's response when its deadline passes, so a stalled read cannot outlive it."""

    def __init__(self):
        self.lock = threading.Lock()
        self.live: dict[int, tuple[float, list]] = {}
        self.n = 0
        threading.Thread(target=self._watch, daemon=True, name="deadline").start()

    def add(self, seconds: float) -> tuple[int, list]:
        with self.lock:
            self.n += 1
            holder: list = []  # [response, expired flag]
            self.live[self.n] = (time.monotonic() + seconds, holder)
            return self.n, holder

    def done(self, key: int) -> None:
        with self.lock:
            self.live.pop(key, None)

    def _watch(self) -> None:
        while True:
            time.sleep(0.25)
            now = time.monotonic()
            with self.lock:
                late = [(k, h) for k, (t, h) in self.live.items() if t < now]
            for k, h in late:
                h.append("expired")
                for r in h:
                    if isinstance(r, httpx.Response):
                        try:
                            r.close()
                        except Exception:
                            pass
                self.done(k)


def _normalize(msg: str) -> str:
    msg = re.sub(r"https?://[\d.:]+", "URL", msg)
    msg = re.sub(r"\b[0-9a-f]{8,}\b", "ID", msg)
    return re.sub(r"\d+(\.\d+)?", "N", msg)[:90]


def send(client: httpx.Client, url: str, req: Req, deadline: Deadline, seconds: float) -> Outcome:
    """POST the request and read its answer; `error` says why it failed, `hang` when the deadline cut it off."""
    key, holder = deadline.add(seconds)
    try:
        out = _send(client, url, req, holder)
    except (httpx.HTTPError, ValueError) as e:
        out = Outcome(error=f"transport {type(e).__name__}", detail=_normalize(str(e)))
    finally:
        deadline.done(key)
    if "expired" in holder:  # whatever the read saw after the watchdog closed it
        return Outcome(text=out.text, error="hang", detail=f"past the {seconds:.0f} s deadline")
    return out


def _send(client: httpx.Client, url: str, req: Req, holder: list) -> Outcome:
    path = "/v1/chat/completions" if req.endpoint == "chat" else "/v1/completions"
    out = Outcome()
    with client.stream("POST", url + path, json=req.body) as r:
        holder.append(r)
        if r.status_code != 200:
            body = r.read().decode(errors="replace")
            try:
                msg = json.loads(body)["error"]["message"]
            except (ValueError, KeyError, TypeError):
                msg = body
            return Outcome(error=f"http {r.status_code}", detail=_normalize(str(msg)))
        if not req.stream:
            choice = json.loads(r.read())["choices"][0]
            out.text = choice["message"]["content"] if req.endpoint == "chat" else choice["text"]
            out.finish = choice.get("finish_reason")
            return out
        done = False
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                continue
            ev = json.loads(line[6:])
            if "error" in ev:
                err = ev["error"]
                code = err.get("code") if isinstance(err, dict) else None
                msg = err.get("message", "") if isinstance(err, dict) else str(err)
                out.error, out.detail = f"event {code}", _normalize(msg)
                continue
            for ch in ev.get("choices") or []:
                if req.endpoint == "chat":
                    out.text += (ch.get("delta") or {}).get("content") or ""
                else:
                    out.text += ch.get("text") or ""
                out.finish = ch.get("finish_reason") or out.finish
        if not done and out.error is None:
            out.error = "stream without [DONE]"
        return out


def judge(want: Outcome, got: Outcome) -> dict:
    """The oracle's verdict on one answer: ok (text and finish_reason equal), wrong, error (by cause; `wrong_prefix`
    when what it streamed before failing was already wrong) or oracle_error."""
    if want.error is not None:
        return {"status": "oracle_error", "cause": want.error, "detail": want.detail}
    if got.error is not None:
        rec = {"status": "error", "cause": got.error, "detail": got.detail}
        if got.text and not want.text.startswith(got.text):
            rec["wrong_prefix"] = True
        return rec
    if got.text != want.text or got.finish != want.finish:
        return {"status": "wrong", "got": got.text[:300], "want": want.text[:300], "got_finish": got.finish,
                "want_finish": want.finish}
    return {"status": "ok"}


# ------------------------------------------------------------------------------------------------ the soak
@dataclass
class Fault:
    kind: str
    target: str
    t0: float
    t1: float = 0.0
    note: str = ""


@dataclass
class Soak:
    args: argparse.Namespace
    log_dir: Path
    procs: dict[str, Proc] = field(default_factory=dict)
    routers: dict[str, list[Proc]] = field(default_factory=dict)  # topology -> its routers
    faults: list[Fault] = field(default_factory=list)
    results: list[dict] = field(default_factory=list)
    crashes: list[dict] = field(default_factory=list)
    invariant_failures: list[dict] = field(default_factory=list)
    harness_errors: list[str] = field(default_factory=list)  # a client, fault or monitor thread that raised
    lock: threading.Lock = field(default_factory=threading.Lock)
    stop_traffic: threading.Event = field(default_factory=threading.Event)
    stop_all: threading.Event = field(default_factory=threading.Event)
    t_start: float = 0.0
    wall_start: float = 0.0

    # -- deployment
    def env(self) -> dict:
        return {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
                "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
                "PDSERVE_ADAPTIVE_THREADS": "0", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}

    def common(self) -> list[str]:
        a = self.args
        return ["serve", a.model, "--served-model-name", MODEL_NAME, "--dtype", "float64", "--max-model-len",
                str(a.max_model_len), "--kv-cache-memory-gb", str(a.kv_cache_gb), "--enable-debug-routes"]

    def kv_cfg(self, role: str, **extra) -> str:
        return json.dumps({"kv_connector": "TcpConnector", "kv_role": role, "kv_auth_token": KV_TOKEN,
                           "kv_transfer_timeout": self.args.kv_transfer_timeout,
                           "kv_lease_seconds": self.args.kv_lease_seconds, **extra})

    def add(self, name: str, argv: list[str], role: str, topo: str = "", port: int | None = None) -> Proc:
        p = Proc(name, argv, port or free_port(), self.log_dir, self.env(), role=role, topo=topo)
        self.procs[name] = p
        p.start()
        return p

    def deploy(self) -> None:
        a = self.args
        self.add("oracle", self.common(), "oracle")
        topos = ["2p2d", "1p1d-spec"] if a.topology == "both" else [a.topology]
        for topo in topos:
            n_p, n_d = (2, 2) if topo == "2p2d" else (1, 1)
            tag = "a" if topo == "2p2d" else "b"
            peers = []
            for i in range(n_p):
                kv_port = free_port()
                proxy = FaultProxy(kv_port)  # before P starts: the port is taken on both addresses from now on
                p = self.add(f"{tag}-P{i}", [*self.common(), "--kv-transfer-config",
                                            self.kv_cfg("kv_producer", kv_port=kv_port,
                                                        kv_advertise_host=PROXY_HOST)], "prefill", topo)
                p.kv_port, p.proxy = kv_port, proxy
                peers.append(f"{PROXY_HOST}:{proxy.port}")
            spec = ["--speculative-config", SPEC_CONFIG] if topo == "1p1d-spec" else []
            for i in range(n_d):
                self.add(f"{tag}-D{i}", [*self.common(), *spec, "--kv-transfer-config",
                                         self.kv_cfg("kv_consumer", kv_peers=peers)], "decode", topo)
        for p in list(self.procs.values()):
            p.wait_healthy(a.startup_timeout)
        for topo in topos:
            ps = [p.url for p in self.procs.values() if p.topo == topo and p.role == "prefill"]
            ds = [p.url for p in self.procs.values() if p.topo == topo and p.role == "decode"]
            self.routers[topo] = []
            for mode in a.first_token:
                r = self.add(f"{topo}-router-{mode}", ["router", "--prefill", *ps, "--decode", *ds,
                                                       "--health-interval", "0.5", "--pd-first-token", mode,
                                                       "--max-migrations", str(a.max_migrations)], "router", topo)
                self.routers[topo].append(r)
        for rs in self.routers.values():
            for r in rs:
                r.wait_healthy(60)
                self.wait_router_sees_all(r, 60)

    def wait_router_sees_all(self, r: Proc, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                n = httpx.get(r.url + "/nodes", timeout=2).json()
                if all(x["healthy"] for x in n["prefill"] + n["decode"]):
                    return True
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            time.sleep(0.25)
        return False

    def teardown(self) -> None:
        # routers first (nodes then drain idle), the oracle last; proxies after the nodes
        for role in ("router", "node"):  # each tier in parallel: SIGTERM all, wait, SIGKILL what is left
            tier = [p for p in self.procs.values() if (p.role == "router") == (role == "router")]
            ts = [threading.Thread(target=self._end, args=(p,)) for p in tier]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
        for p in self.procs.values():
            if p.proxy is not None:
                p.proxy.close()

    def guarded(self, fn, *args) -> None:
        """Run a thread's body; an exception is a harness error that fails the run (never a silently shorter soak)."""
        try:
            fn(*args)
        except Exception as e:
            import traceback
            self.harness_errors.append(f"{fn.__name__}: {e!r}")
            log(f"HARNESS ERROR in {fn.__name__}:\n{traceback.format_exc()}")

    @staticmethod
    def _end(p: Proc) -> None:
        try:
            p.terminate()
        except Exception as e:  # keep going: every group must be ended
            log(f"teardown of {p.name}: {e!r}")

    # -- traffic
    def tokenize_corpus(self) -> list[int]:
        r = httpx.post(self.procs["oracle"].url + "/tokenize", json={"model": MODEL_NAME, "prompt": CORPUS},
                       timeout=30)
        r.raise_for_status()
        return r.json()["tokens"]

    def client_loop(self, worker: int, corpus_ids: list[int], oracle_cache: dict, deadline: Deadline) -> None:
        a = self.args
        topos = list(self.routers)
        max_prompt = min(8 * BLOCK + 1, a.max_model_len - 201)
        with httpx.Client(timeout=httpx.Timeout(a.deadline + 5, connect=10)) as client:
            i = 0
            while not self.stop_traffic.is_set():
                idx = worker + i * a.clients
                i += 1
                rng = random.Random(f"{a.seed}:req:{idx}")  # a request depends on (seed, index) only
                req = make_request(rng, idx, corpus_ids, max_prompt)
                req.topo = rng.choice(topos)
                router = rng.choice(self.routers[req.topo])
                req.router = router.name
                key = oracle_key(req.body, req.endpoint)
                want = oracle_cache.get(key)
                if want is None:
                    whole = Req(idx, req.endpoint, {**req.body, "stream": False}, False, req.shape)
                    whole.body.pop("stream_options", None)
                    want = send(client, self.procs["oracle"].url, whole, deadline, a.deadline)
                    oracle_cache[key] = want
                t0 = time.monotonic()
                got = send(client, router.url, req, deadline, a.deadline)
                t1 = time.monotonic()
                rec = {"idx": idx, "t0": round(t0 - self.t_start, 2), "t1": round(t1 - self.t_start, 2),
                       "topo": req.topo, "router": req.router, "endpoint": req.endpoint, "stream": req.stream,
                       "shape": req.shape, "max_tokens": req.body["max_tokens"],
                       "sampling": "greedy" if req.body.get("temperature") == 0 else "seeded"}
                if a.corrupt_oracle_every and idx % a.corrupt_oracle_every == 0 and want.error is None:
                    want = Outcome(text=want.text + "~", finish=want.finish)  # the self-test: must be caught
                rec.update(judge(want, got))
                if rec["status"] == "wrong" or rec.get("wrong_prefix"):
                    rec["body"] = req.body
                    log(f"WRONG answer: request {idx} via {req.router}: {json.dumps(rec)[:600]}")
                with self.lock:
                    self.results.append(rec)
                if rec["status"] != "ok":  # a client backs off: a node down for 20 s is not 1000 fast errors
                    self.stop_traffic.wait(a.error_backoff)

    # -- invariants while running
    def monitor(self) -> None:
        while not self.stop_all.wait(2.0):
            for p in list(self.procs.values()):
                if p.down:
                    continue
                if not p.alive():
                    tail = (self.log_dir / f"{p.name}.log").read_text(errors="replace")[-2000:]
                    self.crashes.append({"node": p.name, "t": round(time.monotonic() - self.t_start, 1),
                                         "returncode": p.proc.returncode, "log_tail": tail})
                    log(f"CRASH: {p.name} exited with {p.proc.returncode}; restarting it")
                    p.restarts += 1
                    p.start()
                    continue
                if p.role in ("prefill", "decode", "oracle") and not p.stopped:
                    try:
                        kv = httpx.get(p.url + "/debug/kv", timeout=3).json()
                    except (httpx.HTTPError, ValueError):
                        continue  # busy or restarting: the at-rest check is the strict one
                    if not kv.get("invariants_ok", True):
                        self.invariant_failures.append({"node": p.name, "t": round(time.monotonic() - self.t_start,
                                                                                   1), "kv": kv})
                        log(f"INVARIANT broken on {p.name}: {kv}")

    # -- faults
    def fault_loop(self) -> None:
        a = self.args
        rng = random.Random(f"{a.seed}:faults")
        kinds = [k for k in a.faults]
        deck: list[str] = []
        threshold = a.kv_transfer_timeout + a.kv_lease_seconds
        t_end = self.t_start + a.duration
        while True:
            gap = rng.expovariate(a.fault_rate / 60.0) if a.fault_rate > 0 else 1e9
            gap = min(max(gap, 2.0), 4 * 60.0 / max(a.fault_rate, 1e-9))
            if self.stop_traffic.wait(gap) or time.monotonic() > t_end - 5:
                return
            if not deck:  # each kind once per round, in a seeded order: a short run still meets every kind
                deck = list(kinds)
                rng.shuffle(deck)
            kind = deck.pop()
            if kind.startswith("kill") and t_end - time.monotonic() < 25 and any(not k.startswith("kill")
                                                                                for k in deck):
                # a restart takes ~20 s here: none so late that it would stretch the run past its duration
                deck.insert(0, kind)
                kind = next(k for k in reversed(deck) if not k.startswith("kill"))
                deck.remove(kind)
            if kind == "stop" and rng.random() < a.long_stall_fraction:
                kind = "stop_long"
            elif kind == "stop":
                kind = "stop_short"
            nodes = [p for p in self.procs.values() if p.role in ("prefill", "decode")]
            ps = [p for p in nodes if p.role == "prefill"]
            ds = [p for p in nodes if p.role == "decode"]
            f = Fault(kind, "", time.monotonic() - self.t_start)
            try:
                if kind.startswith("proxy_"):
                    p = rng.choice(ps)
                    f.target = p.name
                    window = rng.uniform(min(3, a.fault_window), a.fault_window)
                    mode = kind[len("proxy_"):]
                    delay = round(rng.uniform(0.05, 0.8), 2)
                    trunc = rng.randint(0, 300_000)
                    f.note = {"delay": f"{delay} s per chunk", "truncate": f"cut after {trunc} bytes",
                              "reset": "", "blackhole": ""}[mode] + f" for {window:.1f} s"
                    log(f"fault {kind} on {p.name}'s KV port: {f.note}")
                    p.proxy.set(mode, delay_s=delay, truncate_bytes=trunc)
                    self.stop_all.wait(window)
                    p.proxy.set("pass")
                elif kind in ("kill_d", "kill_p"):
                    pool = ds if kind == "kill_d" else ps
                    target = self.pick_busy(pool, rng) if kind == "kill_d" else rng.choice(pool)
                    f.target = target.name
                    busy = kind == "kill_d" and target.name in self._busy
                    log(f"fault {kind}: SIGKILL {target.name}{' (streaming)' if busy else ''}")
                    f.note = ("mid-stream" if target.name in self._busy else "idle") if kind == "kill_d" else ""
                    target.kill()
                    self.stop_all.wait(rng.uniform(0.5, 3))
                    target.restarts += 1
                    target.start()
                    try:
                        target.wait_healthy(a.startup_timeout)
                    except (RuntimeError, TimeoutError) as e:
                        self.crashes.append({"node": target.name, "t": round(time.monotonic() - self.t_start, 1),
                                             "returncode": None, "log_tail": f"restart failed: {e}"[:2000]})
                    for r in self.routers[target.topo]:
                        self.wait_router_sees_all(r, 30)
                else:  # stop_short | stop_long
                    target = rng.choice(nodes)
                    f.target = target.name
                    secs = rng.uniform(1.0, a.short_stall_max) if kind == "stop_short" \
                        else threshold + rng.uniform(3, 10)
                    f.note = f"{secs:.1f} s ({'<' if secs < threshold else '>'} {threshold:.0f} s = " \
                             f"kv_transfer_timeout + kv_lease_seconds)"
                    log(f"fault {kind}: SIGSTOP {target.name} for {f.note}")
                    target.stopped = target.down = True
                    target.signal(signal.SIGSTOP)
                    self.stop_all.wait(secs)
                    target.signal(signal.SIGCONT)
                    target.stopped = target.down = False
            finally:
                f.t1 = time.monotonic() - self.t_start
                with self.lock:
                    self.faults.append(f)

    _busy: set = field(default_factory=set)  # decode nodes seen streaming when a kill_d chose its target

    def pick_busy(self, pool: list[Proc], rng: random.Random) -> Proc:
        """A decode node with a stream in flight (waits up to 15 s for one), else any."""
        deadline = time.monotonic() + 15
        self._busy = set()
        while time.monotonic() < deadline and not self.stop_traffic.is_set():
            busy = []
            for topo, rs in self.routers.items():
                for r in rs:
                    try:
                        for n in httpx.get(r.url + "/nodes", timeout=2).json()["decode"]:
                            if n.get("in_flight"):
                                busy += [p for p in pool if p.url == n["url"]]
                    except (httpx.HTTPError, ValueError, KeyError):
                        pass
            if busy:
                busy = sorted(set(busy), key=lambda p: p.name)
                self._busy = {p.name for p in busy}
                return busy[rng.randrange(len(busy))]
            time.sleep(0.2)
        return rng.choice(pool)

    # -- at rest
    def at_rest(self) -> dict:
        """After the traffic: every node alive, its pool whole (0 used blocks, P's leases gone) and its invariants
        holding, within kv_transfer_timeout + kv_lease_seconds + slack (a lease no D took ends at its expiry)."""
        a = self.args
        wait = a.kv_transfer_timeout + a.kv_lease_seconds + 20
        deadline = time.monotonic() + wait
        nodes = [p for p in self.procs.values() if p.role in ("prefill", "decode", "oracle")]
        states: dict[str, dict] = {}
        while True:
            for p in nodes:
                try:
                    states[p.name] = httpx.get(p.url + "/debug/kv", timeout=5).json()
                except (httpx.HTTPError, ValueError) as e:
                    states[p.name] = {"error": repr(e)}
            whole = all(s.get("used_blocks") == 0 and s.get("invariants_ok") for s in states.values())
            if whole or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        for p in nodes:  # evidence that KV moved at all: D's prompt tokens by source, transfer failures by reason
            try:
                text = httpx.get(p.url + "/metrics", timeout=5).text
            except httpx.HTTPError:
                continue
            m: Counter = Counter()
            for fam in text_string_to_metric_families(text):
                for smp in fam.samples:
                    if smp.name == "vllm:prompt_tokens_by_source_total":
                        m[f"prompt_tokens:{smp.labels.get('source')}"] += smp.value
                    elif smp.name == "pdserve_kv_transfer_failures_total":
                        m[f"kv_failures:{smp.labels.get('reason')}"] += smp.value
            states[p.name]["metrics_since_start"] = {k: int(v) for k, v in sorted(m.items()) if v}
        routers = {}
        for rs in self.routers.values():
            for r in rs:
                try:
                    n = httpx.get(r.url + "/nodes", timeout=5).json()
                    routers[r.name] = sum(x.get("in_flight", 0) for x in n["prefill"] + n["decode"])
                except (httpx.HTTPError, ValueError, KeyError) as e:
                    routers[r.name] = repr(e)
        return {"nodes": states, "router_in_flight": routers, "waited_s": round(wait - (deadline - time.monotonic()),
                                                                                1)}

    def run(self) -> dict:
        a = self.args
        t_deploy = time.monotonic()
        self.deploy()
        log(f"deployed {len(self.procs)} processes in {time.monotonic() - t_deploy:.0f} s; logs in {self.log_dir}")
        corpus_ids = self.tokenize_corpus()
        deadline = Deadline()
        oracle_cache: dict = {}
        self.t_start, self.wall_start = time.monotonic(), time.time()
        self.commit = _git_commit()  # the code the nodes run: HEAD when they started, not when the run ended
        threads = [threading.Thread(target=self.guarded, args=(self.monitor,), daemon=True, name="monitor"),
                   threading.Thread(target=self.guarded, args=(self.fault_loop,), daemon=True, name="faults")]
        threads += [threading.Thread(target=self.guarded, args=(self.client_loop, w, corpus_ids, oracle_cache,
                                                                deadline), daemon=True, name=f"client-{w}")
                    for w in range(a.clients)]
        for t in threads:
            t.start()
        next_report = self.t_start + 60
        while time.monotonic() < self.t_start + a.duration:
            time.sleep(0.5)
            if time.monotonic() > next_report:
                next_report += 60
                with self.lock:
                    c = Counter(r["status"] for r in self.results)
                log(f"{time.monotonic() - self.t_start:.0f} s: {dict(c)}, {len(self.faults)} faults")
        self.stop_traffic.set()
        for t in threads[1:]:  # the fault in progress ends (a stopped node is continued), clients finish theirs
            t.join(a.deadline + 2 * a.startup_timeout)
        traffic_s = time.monotonic() - self.t_start
        for p in self.procs.values():  # nothing stays stopped or behind a faulty proxy at rest
            if p.stopped:
                p.signal(signal.SIGCONT)
                p.stopped = p.down = False
            if p.proxy is not None:
                p.proxy.set("pass")
        rest = self.at_rest()
        self.stop_all.set()
        threads[0].join(10)
        return self.summary(traffic_s, rest)

    # -- the report
    def summary(self, traffic_s: float, rest: dict) -> dict:
        a = self.args
        threshold = a.kv_transfer_timeout + a.kv_lease_seconds
        res = self.results
        status = Counter(r["status"] for r in res)
        errors = [r for r in res if r["status"] == "error"]
        grace = 3.0

        def overlapping(r):
            return [f for f in self.faults if f.t0 - grace <= r["t1"] and r["t0"] <= f.t1 + grace]

        by_cause = Counter(f"{r['cause']}: {r['detail']}" if r["detail"] else r["cause"] for r in errors
                           if r["cause"] != "hang")
        by_fault = Counter()
        short_stall_errors = []
        for r in errors:
            fs = overlapping(r)
            kinds = sorted({f.kind for f in fs}) or ["none"]
            by_fault["+".join(kinds)] += 1
            r["faults"] = [f"{f.kind}:{f.target}@{f.t0:.0f}" for f in fs]
            if kinds == ["stop_short"] and r["cause"] != "hang":
                short_stall_errors.append(r)
        # streams a kill_d cut: requests in flight on its topology when the D died (migration should carry them)
        kill_ds = [f for f in self.faults if f.kind == "kill_d"]
        topo_of = {p.name: p.topo for p in self.procs.values()}
        cut = [r for r in res if r["stream"] and any(topo_of[f.target] == r["topo"] and r["t0"] < f.t0 < r["t1"]
                                                      for f in kill_ds)]
        leaked = {n: s.get("used_blocks") for n, s in rest["nodes"].items() if s.get("used_blocks") != 0}
        bad_inv = [n for n, s in rest["nodes"].items() if not s.get("invariants_ok")]
        out = {
            "name": a.name, "seed": a.seed, "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "commit": getattr(self, "commit", "") or _git_commit(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.wall_start)),
            "topology": a.topology, "first_token_modes": a.first_token, "duration_s": round(traffic_s, 1),
            "settings": {"fault_rate_per_min": a.fault_rate, "clients": a.clients, "deadline_s": a.deadline,
                         "kv_transfer_timeout": a.kv_transfer_timeout, "kv_lease_seconds": a.kv_lease_seconds,
                         "stall_threshold_s": threshold, "short_stall_max_s": a.short_stall_max,
                         "long_stall_fraction": a.long_stall_fraction, "max_migrations": a.max_migrations,
                         "faults": a.faults},
            "requests": len(res), "by_status": dict(status),
            "requests_by_topology": dict(Counter(r["topo"] for r in res)),
            "requests_by_shape": dict(Counter(r["shape"] for r in res)),
            "faults_by_kind": dict(Counter(f.kind for f in self.faults)),
            "faults": [f.__dict__ for f in self.faults],
            "wrong_tokens": status["wrong"], "wrong_answers": [r for r in res if r["status"] == "wrong"][:20],
            "wrong_partial_before_error": sum(1 for r in errors if r.get("wrong_prefix")),
            "hangs": sum(1 for r in errors if r["cause"] == "hang"),
            "oracle_errors": status["oracle_error"],
            "leaked_blocks": leaked, "invariants_broken_at_rest": bad_inv,
            "invariant_failures_running": self.invariant_failures, "crashes": self.crashes,
            "client_errors": len(errors) - sum(1 for r in errors if r["cause"] == "hang"),
            "client_errors_by_cause": dict(by_cause.most_common()),
            "client_errors_by_fault": dict(by_fault.most_common()),
            "client_errors_short_stalls": len(short_stall_errors),
            "streams_in_flight_at_kill_d": len(cut),
            "streams_in_flight_at_kill_d_failed": sum(1 for r in cut if r["status"] != "ok"),
            "errors": errors[:200],
            "at_rest": rest,
            "harness_errors": self.harness_errors,
            "restarts": {p.name: p.restarts for p in self.procs.values() if p.restarts},
            "proxy_stats": {p.name: dict(p.proxy.stats) for p in self.procs.values() if p.proxy is not None},
        }
        out["ok"] = (out["wrong_tokens"] == 0 and out["wrong_partial_before_error"] == 0 and out["hangs"] == 0
                     and not leaked and not bad_inv and not self.invariant_failures and not self.crashes
                     and out["oracle_errors"] == 0 and not self.harness_errors
                     and not any(isinstance(v, str) or v for v in rest["router_in_flight"].values()))
        return out


def _git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def print_table(s: dict) -> None:
    rows = [("duration", f"{s['duration_s']} s"), ("seed", s["seed"]), ("topology", s["topology"]),
            ("requests", f"{s['requests']} {s['requests_by_topology']}"),
            ("faults", f"{len(s['faults'])} {s['faults_by_kind']}"),
            ("wrong answers (any token off)", s["wrong_tokens"]), ("hangs", f"{s['hangs']} (deadline "
                                                                     f"{s['settings']['deadline_s']} s)"),
            ("leaked blocks at rest", s["leaked_blocks"] or 0),
            ("invariants broken", len(s["invariant_failures_running"]) + len(s["invariants_broken_at_rest"])),
            ("crashes", len(s["crashes"])), ("oracle errors", s["oracle_errors"]),
            ("harness errors", len(s["harness_errors"])),
            ("client errors", s["client_errors"]),
            (f"  of them in stalls < {s['settings']['stall_threshold_s']:.0f} s", s["client_errors_short_stalls"]),
            ("streams in flight in a killed D's topology (failed)", f"{s['streams_in_flight_at_kill_d']} "
                                                       f"({s['streams_in_flight_at_kill_d_failed']})")]
    rows += [(f"  cause: {k}", v) for k, v in s["client_errors_by_cause"].items()]
    rows += [(f"  during: {k}", v) for k, v in s["client_errors_by_fault"].items()]
    w = max(len(str(k)) for k, _ in rows)
    print("\n" + "\n".join(f"{k:<{w}}  {v}" for k, v in rows))
    print(f"{'invariants':<{w}}  {'HOLD' if s['ok'] else 'BROKEN'}\n", flush=True)


FAULT_KINDS = ["proxy_delay", "proxy_truncate", "proxy_reset", "proxy_blackhole", "kill_d", "kill_p", "stop"]


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter,
                                 epilog="Exit status: 0 when every invariant held, 1 otherwise.")
    ap.add_argument("--duration", type=float, default=120, help="Seconds of traffic (default: 120).")
    ap.add_argument("--seed", type=int, default=0, help="Seeds the workload and the fault schedule (default: 0).")
    ap.add_argument("--topology", choices=["2p2d", "1p1d-spec", "both"], default="both",
                    help="2p2d: 2 P + 2 D; 1p1d-spec: 1 P + 1 D with n-gram spec decoding on D; both side by side.")
    ap.add_argument("--first-token", nargs="+", choices=["replay", "prefill"], default=["replay", "prefill"],
                    help="One router per topology and mode (--pd-first-token); a request picks one at random.")
    ap.add_argument("--fault-rate", type=float, default=1.2,
                    help="Mean fault starts per minute of gap, one fault at a time (default: 1.2; 0: none). A gap is\n"
                         "drawn (exponential, 2 s at least) after each fault ends, so long faults (a restart, a long\n"
                         "stall) lower the achieved rate: the JSON has the faults that ran.")
    ap.add_argument("--faults", nargs="+", choices=FAULT_KINDS, default=FAULT_KINDS,
                    help="Fault kinds, dealt in seeded rounds of each kind once (default: all).")
    ap.add_argument("--long-stall-fraction", type=float, default=0.25,
                    help="Share of SIGSTOP stalls longer than kv_transfer_timeout + kv_lease_seconds (default: "
                         "0.25); the others last 1 s to --short-stall-max.")
    ap.add_argument("--short-stall-max", type=float, default=12.0, help="Longest short stall, s (default: 12).")
    ap.add_argument("--fault-window", type=float, default=12.0,
                    help="Longest window of a KV-proxy fault, s (default: 12; each lasts 3 s to this).")
    ap.add_argument("--error-backoff", type=float, default=1.0,
                    help="Seconds a client waits after an error before its next request (default: 1).")
    ap.add_argument("--clients", type=int, default=4, help="Concurrent client threads (default: 4).")
    ap.add_argument("--deadline", type=float, default=150.0,
                    help="Client-side deadline per request, s: an answer not complete by then is a hang (default: "
                         "150; keep it above the longest stall plus a request's own time).")
    ap.add_argument("--max-migrations", type=int, default=2, help="The routers' --max-migrations (default: 2).")
    ap.add_argument("--kv-transfer-timeout", type=float, default=10.0, help="Every node's kv_transfer_timeout "
                                                                             "(default: 10, pdserve's).")
    ap.add_argument("--kv-lease-seconds", type=float, default=30.0, help="Every node's kv_lease_seconds "
                                                                          "(default: 30, pdserve's).")
    ap.add_argument("--model", default=None, help="Model dir (default: the tiny qwen3, made once under "
                                                    "PDSERVE_HOME by `pdserve make-model`).")
    ap.add_argument("--max-model-len", type=int, default=512, help="Every node's --max-model-len (default: 512).")
    ap.add_argument("--kv-cache-gb", type=float, default=0.05, help="Every node's --kv-cache-memory-gb "
                                                                     "(default: 0.05).")
    ap.add_argument("--startup-timeout", type=float, default=240.0, help="Seconds a node may take to start.")
    ap.add_argument("--corrupt-oracle-every", type=int, default=0, metavar="N",
                    help="Self-test: append a character to the oracle's answer of every Nth request, so the run "
                         "must report wrong answers and fail (default: 0, off).")
    ap.add_argument("--name", default="run", help="Run name, in the JSON (default: run).")
    ap.add_argument("--out", default=None, help="JSON file to write (e.g. benchmarks/results/soak_<name>.json).")
    ap.add_argument("--log-dir", default=None, help="Where the servers' logs go (default: a temp dir, kept when an "
                                                     "invariant breaks).")
    a = ap.parse_args(argv)
    threshold = a.kv_transfer_timeout + a.kv_lease_seconds
    if a.short_stall_max >= threshold:
        ap.error(f"--short-stall-max must stay under kv_transfer_timeout + kv_lease_seconds ({threshold:g} s)")
    if a.long_stall_fraction > 0 and "stop" in a.faults and a.deadline < threshold + 10 + 60:
        ap.error(f"--deadline must exceed the longest stall ({threshold + 10:g} s) by 60 s")
    return a


def run_soak(argv=None) -> dict:
    """Run a soak (argv as on the command line); returns the summary. Every process it started is gone when it
    returns or raises."""
    a = parse_args(argv)
    if a.model is None:
        from pdserve.model.make_model import ensure_model
        a.model = str(ensure_model("qwen3", "tiny", 0))
    log_dir = Path(a.log_dir or tempfile.mkdtemp(prefix="pdserve-soak-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    soak = Soak(a, log_dir)
    def interrupted(signum, frame):
        raise KeyboardInterrupt(signal.Signals(signum).name)

    old = {}
    if threading.current_thread() is threading.main_thread():
        # SIGTERM and SIGINT both end the run through the teardown below (a shell starts a background job with
        # SIGINT ignored, which Python would keep)
        old = {sig: signal.signal(sig, interrupted) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        s = soak.run()
    finally:
        soak.stop_traffic.set()
        soak.stop_all.set()
        soak.teardown()
        for sig, handler in old.items():
            signal.signal(sig, handler)
    s["log_dir"] = str(log_dir)
    print_table(s)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(s, indent=1) + "\n")
        log(f"wrote {a.out}")
    if s["ok"] and a.log_dir is None:
        import shutil
        shutil.rmtree(log_dir, ignore_errors=True)
    return s


if __name__ == "__main__":
    sys.exit(0 if run_soak()["ok"] else 1)
