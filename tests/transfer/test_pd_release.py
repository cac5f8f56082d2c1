"""P/D: a P's KV lease for a request no D takes ends at once, not at `kv_lease_seconds` (30 here, so a release seen
within a few seconds is never the expiry): D refuses the request (a 400 on a field, a 503 with its queue full), D
cannot be reached (it drops the connection, answers 503, or is down: connection refused), the client goes away
before D answers (at the router) or while D holds the request in its queue. Forged or unsigned params make D dial
nothing and release nothing; P's `POST /v1/kv/release` takes only router-signed params.

One deployment for the module: P, a D with one seat (so a request can be held in its queue) and `--max-waiting 1`,
a fake D the tests steer, and a router in front of each D. The tests run in file order (the fake D is closed by the
last of its tests); each ends with P's leases at 0 and the pools whole."""
from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from pdserve.transfer.channel.proof import PROOF_FIELD, sign_params
from pdserve.transfer.channel.proof import prompt_hash
from tests.server_harness import (KV_TOKEN, RouterProcess, ServerProcess, free_port, kv_config, kv_state, metric,
                                  metrics, wait_pools_whole)
from tests.server_harness import cleanup_all

LEASE = 30.0  # P's kv_lease_seconds: every release below must come well before it
PROMPT = "def release(lease):\n    return lease.blocks  # " + "x" * 40
COMMON = ("--kv-cache-memory-gb", "0.05", "--enable-debug-routes")


class FakeDecode:
    """A decode node the tests steer. /health answers 200; a POST is recorded, then per `mode`: "503" answers 503,
    "drop" closes the connection unanswered, "hold" keeps it open until the router drops it (`dropped` is set).
    `stop()` closes the port: from then on the router's connection is refused. Every response closes its
    connection, so the router holds no kept-alive one that would outlive `stop()`."""

    def __init__(self):
        self.mode = "503"
        self.bodies: list[dict] = []
        self.received, self.dropped = threading.Event(), threading.Event()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _answer(self, status: int, body: bytes = b"") -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Connection", "close")
                self.end_headers()
                self.wfile.write(body)
                self.close_connection = True

            def do_GET(self):
                self._answer(200 if self.path == "/health" else 404)

            def do_POST(self):
                fake.bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                fake.received.set()
                self.close_connection = True
                if fake.mode == "503":
                    self._answer(503, json.dumps({"error": {"message": "the server is overloaded", "code": 503}})
                                 .encode())
                elif fake.mode == "hold":
                    self.connection.settimeout(20)
                    try:
                        if self.rfile.read(1) == b"":
                            fake.dropped.set()
                    except OSError:
                        pass
                # "drop": return unanswered; the server closes the connection

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def steer(self, mode: str) -> None:
        self.mode = mode
        self.bodies.clear()
        self.received.clear()
        self.dropped.clear()

    def stop(self) -> None:
        if self.thread.is_alive():
            self.server.shutdown()
            self.server.server_close()


@pytest.fixture(scope="module")
def dep(qwen3_tiny):
    kv_port, trap_port = free_port(), free_port()
    s = {"P": ServerProcess(qwen3_tiny, *COMMON, "--max-model-len", "512", "--kv-transfer-config",
                            kv_config("kv_producer", kv_port=kv_port, kv_lease_seconds=LEASE)),
         # the trap port is a peer D may dial: a test listens there to see whether D dials it
         "D": ServerProcess(qwen3_tiny, *COMMON, "--max-model-len", "2048", "--max-num-seqs", "1", "--max-waiting",
                            "1", "--kv-transfer-config",
                            kv_config("kv_consumer", kv_peers=[f"127.0.0.1:{kv_port}", f"127.0.0.1:{trap_port}"]))}
    fake = FakeDecode()
    routers = {}
    try:
        for srv in s.values():
            srv.wait_healthy()
        routers = {"R": RouterProcess([s["P"].url], [s["D"].url]),
                   # one health round at start only: the fake D stays "healthy" in this router after it is closed
                   "R_fake": RouterProcess([s["P"].url], [fake.url], "--health-interval", "3600")}
        for r in routers.values():
            r.wait_healthy()
        yield {**s, **routers, "fake": fake, "trap_port": trap_port, "kv_port": kv_port}
    finally:
        fake.stop()
        cleanup_all(*routers.values(), *s.values())


def leased(dep) -> int:
    return kv_state(dep["P"])["leased_blocks"]


def wait_released(dep, within: float = 4.0) -> float:
    """P's leased blocks back to 0 within `within` s (far below the 30 s lease); returns how long it took."""
    t0 = time.monotonic()
    while (n := leased(dep)) > 0:
        assert time.monotonic() - t0 < within, f"P still holds {n} leased blocks {within} s on (lease {LEASE} s)"
        time.sleep(0.05)
    return time.monotonic() - t0


def prefilled(dep, prompt: str = PROMPT) -> dict:
    """Step 1 by hand: P prefills and leases the KV; the params come back signed, as the router would send them."""
    r = httpx.post(dep["P"].url + "/v1/completions", timeout=30, json={
        "model": "qwen3-tiny-s0", "prompt": prompt, "max_tokens": 1, "temperature": 0, "ignore_eos": True,
        "kv_transfer_params": {"do_remote_decode": True}})
    assert r.status_code == 200, r.text
    assert leased(dep) > 0
    return r.json()["kv_transfer_params"]  # signed by P


def release(dep, params, url=None) -> httpx.Response:
    return httpx.post((url or dep["P"].url) + "/v1/kv/release", json={"kv_transfer_params": params}, timeout=10)


def body(prompt=PROMPT, **extra) -> dict:
    return {"model": "qwen3-tiny-s0", "prompt": prompt, "max_tokens": 8, "temperature": 0, **extra}


def prefills(dep) -> float:
    return metric(dep["P"].url, "vllm:request_success_total")


def test_release_route_on_p(dep):
    """P's release: only for router-signed params, idempotent, a clear 404 for a lease it does not hold."""
    params = prefilled(dep)
    n = leased(dep)
    unsigned = {k: v for k, v in params.items() if k != PROOF_FIELD}
    assert release(dep, unsigned).status_code == 403
    assert release(dep, sign_params(unsigned, "not-the-kv-token")).status_code == 403
    assert release(dep, {**params, "transfer_id": "0" * 32}).status_code == 403  # the proof covers the id
    r = httpx.post(dep["P"].url + "/v1/kv/release", json={"kv_transfer_params": "x"}, timeout=10)
    assert r.status_code == 400
    unknown = release(dep, sign_params({**unsigned, "transfer_id": "0" * 32}, KV_TOKEN))
    assert unknown.status_code == 404 and "no open KV lease" in unknown.json()["error"]["message"]
    time.sleep(0.3)
    assert leased(dep) == n, "a refused release freed the lease"
    r = release(dep, params)
    assert r.status_code == 200 and r.json() == {"status": "released", "transfer_id": params["transfer_id"]}
    wait_released(dep)
    again = release(dep, params)
    assert again.status_code == 404, again.text  # a repeat is harmless and says so
    assert release(dep, params, dep["D"].url).status_code == 400  # a decode node keeps no leases
    wait_pools_whole(dep["P"], dep["D"])


@pytest.mark.parametrize("bad", [{"max_tokens": 4000}, {"min_tokens": 9, "max_tokens": 8}])
def test_decode_400_through_router(dep, bad):
    """The fields P never sees (P gets max_tokens=1 and no stop fields) are refused by D: P's lease ends at once."""
    before = prefills(dep)
    r = httpx.post(dep["R"].url + "/v1/completions", json=body(**bad), timeout=30)
    assert r.status_code == 400, r.text
    assert prefills(dep) == before + 1  # P prefilled and leased the KV
    wait_released(dep)
    wait_pools_whole(dep["P"], dep["D"])


def test_decode_400_direct_releases_itself(dep):
    """D on its own (no router to clean up after it): a refused request with authentic params sends P a bare
    `done`."""
    params = prefilled(dep)
    r = httpx.post(dep["D"].url + "/v1/completions", json=body(max_tokens=4000, kv_transfer_params=params),
                   timeout=30)
    assert r.status_code == 400, r.text
    wait_released(dep)
    wait_pools_whole(dep["P"], dep["D"])


def test_forged_params_dial_nothing_release_nothing(dep):
    """Params without a valid proof make D dial no host (not even a peer in kv_peers) and release no lease; signed
    params naming a host outside kv_peers are never dialed either. The control: signed params naming the trap (a
    peer D may dial) do reach it, so the trap would have seen the others."""
    d = dep["D"]
    prompt = list(range(200, 240))
    fake = {"do_remote_prefill": True, "do_remote_decode": False, "transfer_id": "f" * 32, "remote_engine_id": "P",
            "remote_request_id": "r", "remote_host": "127.0.0.1", "remote_port": dep["trap_port"],
            "remote_block_ids": [1, 2, 3], "num_prompt_tokens": len(prompt), "prompt_hash": prompt_hash(prompt),
            "lease_seconds": 30.0}
    outsider = socket.create_server(("127.0.0.1", 0))
    signed_outside = sign_params({**fake, "remote_port": outsider.getsockname()[1]}, KV_TOKEN)

    def post(params, **extra):
        return httpx.post(d.url + "/v1/completions", timeout=30,
                          json=body(prompt, kv_transfer_params=params, **extra))

    def dialed(sock) -> bool:
        sock.settimeout(1.0)
        try:
            sock.accept()[0].close()
            return True
        except socket.timeout:
            return False

    with socket.create_server(("127.0.0.1", dep["trap_port"])) as trap, outsider:
        for forged in (fake, sign_params(fake, "not-the-kv-token"), {**sign_params(fake, KV_TOKEN), "remote_port": 1}):
            for extra in ({}, {"max_tokens": 4000}):  # refused by the engine (no proof), or first on a field
                assert post(forged, **extra).status_code == 400
        assert not dialed(trap), "D dialed a host named by params without a valid proof"
        assert post(signed_outside, max_tokens=4000).status_code == 400
        assert post(signed_outside).status_code == 200  # not loaded from there: D prefills locally
        assert not dialed(outsider), "D dialed a KV endpoint outside kv_peers"
        assert post(sign_params(fake, KV_TOKEN), max_tokens=4000).status_code == 400
        assert dialed(trap), "the control: a refused request with authentic params tells its P"
    # P's own lease: its params with the proof taken off, refused by D, are not released
    params = prefilled(dep)
    n = leased(dep)
    unsigned = {k: v for k, v in params.items() if k != PROOF_FIELD}
    assert post(unsigned, max_tokens=4000).status_code == 400
    assert httpx.post(d.url + "/v1/completions", timeout=30,
                      json=body(kv_transfer_params=unsigned)).status_code == 400
    time.sleep(1.0)
    assert leased(dep) == n, "unsigned params released P's lease"
    assert release(dep, params).status_code == 200
    wait_released(dep)
    wait_pools_whole(dep["P"], dep["D"])


def test_decode_answers_503_through_router(dep):
    fake = dep["fake"]
    fake.steer("503")
    r = httpx.post(dep["R_fake"].url + "/v1/completions", json=body(), timeout=30)
    assert r.status_code == 503
    assert fake.bodies and fake.bodies[0]["kv_transfer_params"]["transfer_id"]  # D got P's params
    wait_released(dep)
    wait_pools_whole(dep["P"])


def test_decode_drops_connection_through_router(dep):
    """D drops the connection before answering, twice (asked once more): the P that prefilled the prompt serves the
    request whole (--prefill-fallback), and the lease no D took ends."""
    fake = dep["fake"]
    fake.steer("drop")
    before = metric(dep["R_fake"].url, "pdserve_router_prefill_fallbacks_total")
    r = httpx.post(dep["R_fake"].url + "/v1/completions", json=body(stream=True), timeout=30)
    assert r.status_code == 200 and "[DONE]" in r.text and '"error"' not in r.text, r.text
    assert fake.received.is_set()
    assert metric(dep["R_fake"].url, "pdserve_router_prefill_fallbacks_total") == before + 1
    wait_released(dep)
    wait_pools_whole(dep["P"])


def raw_request(url: str, payload: dict) -> socket.socket:
    """A POST sent on a plain socket, so the test can hang up at a moment of its choosing."""
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps(payload).encode()
    sock = socket.create_connection((host, int(port)), timeout=10)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
    return sock


def test_client_abort_before_decode_answers(dep):
    """The client hangs up after P answered, while the router waits for D: the router drops D's request and
    releases the lease on P."""
    fake = dep["fake"]
    fake.steer("hold")
    sock = raw_request(dep["R_fake"].url, body(stream=True))
    assert fake.received.wait(20), "the router never reached D"
    assert leased(dep) > 0
    sock.close()
    wait_released(dep)
    assert fake.dropped.wait(5), "the router kept its request to D open after the client left"
    wait_pools_whole(dep["P"])
    # the reclamation contract in /metrics: nothing held for no one at rest, and the released lease was reclaimed
    assert metric(dep["P"].url, "pdserve_kv_orphaned_blocks") == 0
    assert metric(dep["P"].url, "pdserve_kv_reclaim_seconds_count") >= 1


def test_decode_down_through_router(dep):
    """D's port is closed (the router has not noticed yet): connection refused, so D is out of rotation at once,
    and with no other D the P that prefilled serves the request whole; P's lease ends at once."""
    dep["fake"].stop()
    before = prefills(dep)
    r = httpx.post(dep["R_fake"].url + "/v1/completions", json=body(), timeout=30)
    assert r.status_code == 200 and r.json()["choices"][0]["text"], r.text
    assert prefills(dep) == before + 2  # P's prefill for D, then the whole request
    wait_released(dep)
    wait_pools_whole(dep["P"])
    assert metric(dep["P"].url, "pdserve_kv_orphaned_blocks") == 0


@contextlib.contextmanager
def seat_taken(d):
    """D's one seat held by a long local request while the block runs (D then queues what comes next)."""
    holder = body("hold the seat", max_tokens=2000, ignore_eos=True, stream=True)
    with httpx.stream("POST", d.url + "/v1/completions", json=holder, timeout=30) as seat:
        lines = seat.iter_lines()  # held: a dropped iterator closes the stream, and D aborts the holder
        assert next(x for x in lines if x.startswith("data: "))  # running: the seat is taken
        yield
        assert metric(d.url, "vllm:num_requests_running") == 1, "the seat holder ended early: the test is void"


def queue_on_decode(dep, prompt: str) -> socket.socket:
    """A P/D request sent straight to D, waiting in its queue (its load not asked for yet)."""
    d = dep["D"]
    sock = raw_request(d.url, body(prompt, stream=True, kv_transfer_params=prefilled(dep, prompt)))
    deadline = time.monotonic() + 10
    # once its KV is loaded (a deferred wait), it waits for the seat: a capacity wait
    while metric(d.url, "vllm:num_requests_waiting_by_reason", reason="capacity") < 1:
        assert time.monotonic() < deadline, "the P/D request never waited in D's queue"
        time.sleep(0.05)
    m = metrics(d.url)
    assert metric(m, "vllm:num_requests_waiting") == 1, m
    assert metric(m, "vllm:num_requests_waiting_by_reason", reason="deferred") == 0
    return sock


def test_decode_queue_full_503_releases(dep):
    """D's seat is taken and one P/D request waits (--max-waiting 1): the next is refused 503, and D tells P at
    once."""
    d = dep["D"]
    received = metric(d.url, "pdserve_kv_transfer_received_bytes_total")
    with seat_taken(d):
        queued = queue_on_decode(dep, PROMPT + " queued")
        try:
            n = leased(dep)
            refused = httpx.post(d.url + "/v1/completions", timeout=30,
                                 json=body(PROMPT + " refused", kv_transfer_params=prefilled(dep, PROMPT + " refused")))
            assert refused.status_code == 503, refused.text
            deadline = time.monotonic() + 4
            while leased(dep) > n:
                assert time.monotonic() < deadline, "the 503 did not release its lease on P"
                time.sleep(0.05)
        finally:
            queued.close()
        wait_released(dep)  # and the queued one's, aborted (see the next test)
    assert metric(d.url, "pdserve_kv_transfer_received_bytes_total") == received  # D pulled nothing
    wait_pools_whole(dep["P"], dep["D"])


def test_client_abort_while_decode_queues(dep):
    """The client of a P/D request waiting in D's queue hangs up: D aborts it and tells P at once."""
    d = dep["D"]
    received = metric(d.url, "pdserve_kv_transfer_received_bytes_total")
    with seat_taken(d):
        queue_on_decode(dep, PROMPT + " abandoned").close()
        wait_released(dep)
    assert metric(d.url, "pdserve_kv_transfer_received_bytes_total") == received  # D pulled nothing
    wait_pools_whole(dep["P"], dep["D"])
