"""Failure paths of a decode node (D, kv_consumer) before a P/D request's first token, in process (TestClient on the
thread backend, so coverage sees them): telling P to release its lease raises; P answers that its lease is gone; a
drain meets a request whose KV load is still out (and refuses new work with 503 while it drains); the request fails
before its first token (a 500, not a 200 stream with an error event); the client goes away before the first token
(499). No P runs: the params are signed here with D's token and name a port nobody listens on, and P's answer to
the load is steered by replacing the transfer (`SteeredLoads`). Each ends with D's KV pool whole."""
from __future__ import annotations

import asyncio
import json
import threading
import time
from contextlib import contextmanager

import pytest
from starlette.testclient import TestClient

from pdserve.config import EngineConfig
from pdserve.core.kv_gateway import KVGateway
from pdserve.serve.api_server import ServerState, build_app
from pdserve.serve.server_config import ServerConfig
from pdserve.transfer.channel.pool import SessionPool
from pdserve.transfer.channel.proof import prompt_hash, sign_params
from pdserve.transfer.channel.protocol import LeaseGone
from pdserve.transfer.tcp.consumer import TcpConsumer
from tests.server_harness import free_port
from tests.serve.test_failure_paths_serving import BODY, events, pool_whole

TOKEN = "failure-paths-token"


@contextmanager
def served(model, kv: dict | None = None, **cfg):
    """(client, state) of an in-process server; `kv`: a TcpConnector consumer's extra kv_transfer_config."""
    kwargs = dict(block_size=4, max_model_len=53)
    if kv is not None:
        kwargs["kv_transfer_config"] = {"kv_connector": "TcpConnector", "kv_role": "kv_consumer",
                                        "kv_auth_token": TOKEN, "kv_transfer_timeout": 1.0, **kv}
    state = ServerState(EngineConfig.from_kwargs(model, **kwargs),
                        ServerConfig(**{"enable_debug_routes": True, "engine_backend": "thread", **cfg}))
    app = build_app(state)
    with TestClient(app) as c:
        deadline = time.monotonic() + 60
        while c.get("/health").status_code != 200:
            assert time.monotonic() < deadline, "server not healthy"
            time.sleep(0.05)
        yield c, state


def engine_core(state):
    """The EngineCore behind a thread-backend server, once its engine exists."""
    core = state.engine._backend.core
    deadline = time.monotonic() + 5
    while core.engine is None:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    return core


def remote_params(prompt_ids, port=None) -> dict:
    """Remote-prefill params as a P would have signed them (for `prompt_ids`), naming a port nobody listens on."""
    return sign_params({"do_remote_prefill": True, "transfer_id": f"t-{time.monotonic_ns()}",
                        "remote_engine_id": "P0", "remote_request_id": "p-1", "remote_host": "127.0.0.1",
                        "remote_port": port or free_port(), "remote_block_ids": [1, 2],
                        "num_prompt_tokens": len(prompt_ids), "prompt_hash": prompt_hash(prompt_ids),
                        "lease_seconds": 30.0}, TOKEN)


@pytest.fixture
def releases(monkeypatch):
    """Request ids D told P to release a lease for (KVGateway.release_remote_kv, which still runs)."""
    seen: list[str] = []
    real = KVGateway.release_remote_kv

    def recording(self, request_id, params):
        seen.append(request_id)
        return real(self, request_id, params)
    monkeypatch.setattr(KVGateway, "release_remote_kv", recording)
    return seen


def wait_for(pred, timeout=5.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


class SteeredLoads:
    """D's KV transfers with no network: a load waits until `gate` opens (open unless `hold`), then P answers
    `expired` (LeaseGone); a bare `done` (ending P's lease) is recorded in `dones`."""

    def __init__(self, monkeypatch, hold: bool = False):
        self.asked, self.gate, self.dones = threading.Event(), threading.Event(), []
        if not hold:
            self.gate.set()
        monkeypatch.setattr(SessionPool, "call", lambda pool, host, port, until, fn: fn(None))
        monkeypatch.setattr(TcpConsumer, "_transfer", lambda consumer, session, job: self._transfer(job))

    def _transfer(self, job) -> None:
        if not job.dst_blocks:
            self.dones.append(job.request_id)
            return
        self.asked.set()
        self.gate.wait(10)
        raise LeaseGone(f"the producer no longer holds the KV of transfer {job.params['transfer_id']}")


async def asgi(app, method: str, path: str, body: bytes = b"", headers=(), chunks=None,
               disconnect_after: float | None = None, timeout: float = 10.0, truncated: bool = False) -> dict:
    """Drive the ASGI app by hand (TestClient cannot disconnect early): the body in `chunks` (default: one), then
    `http.disconnect` after `disconnect_after` s (never, if None); `truncated`: the last chunk says more is to
    come, so the client goes away mid-body. The status, the body, and the body bytes the app read."""
    it = iter(chunks if chunks is not None else [body])
    pending = next(it, b"")
    read, sent = [0], []

    async def receive():
        nonlocal pending
        if pending is not None:
            chunk, pending = pending, next(it, None)
            read[0] += len(chunk)
            return {"type": "http.request", "body": chunk, "more_body": pending is not None or truncated}
        if disconnect_after is None:
            await asyncio.Event().wait()
        await asyncio.sleep(disconnect_after)
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    hdrs = [(b"content-type", b"application/json"), *((k.encode(), v.encode()) for k, v in headers)]
    if chunks is None and not any(k == "content-length" for k, _ in headers):
        hdrs.append((b"content-length", str(len(body)).encode()))
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": method, "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
             "root_path": "", "headers": hdrs, "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 80)}
    t0 = time.monotonic()
    await asyncio.wait_for(app(scope, receive, send), timeout)
    start = next(m for m in sent if m["type"] == "http.response.start")
    return {"status": start["status"], "body": b"".join(m.get("body", b"") for m in sent
                                                      if m["type"] == "http.response.body"),
            "read": read[0], "seconds": time.monotonic() - t0}


PROMPT = [5, 6, 7, 8]
PD_BODY = {**BODY, "prompt": PROMPT}


def test_a_release_to_p_that_raises_still_answers_400(qwen3_tiny, monkeypatch):
    """D refuses a P/D request (params signed for another prompt) and telling P to release the lease raises: the
    client still gets its 400 naming the params, and the engine loop lives on (the exception is D's to log, never
    the loop's end). P answering the load that the KV is gone is no refusal: D prefills the prompt itself (streamed,
    with X-PD-KV-Unused), even with kv_load_failure_policy "fail", and tells P nothing more (it holds nothing)."""
    from pdserve.serve.server_timing import KV_UNUSED_HEADER
    tried: list[str] = []

    def broken(self, request_id, params):
        tried.append(request_id)
        raise ConnectionError("the KV session to P broke")
    monkeypatch.setattr(KVGateway, "release_remote_kv", broken)
    with served(qwen3_tiny, kv={"kv_load_failure_policy": "fail"}) as (c, state):
        r = c.post("/v1/completions", json={**PD_BODY, "kv_transfer_params": remote_params(PROMPT[:-1])})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert "kv_transfer_params are for another prompt" in err["message"] and err["param"] == "kv_transfer_params"
        loads = SteeredLoads(monkeypatch)  # P: no such lease any more
        r = c.post("/v1/completions", json={**PD_BODY, "stream": True, "kv_transfer_params": remote_params(PROMPT)})
        assert r.status_code == 200 and r.headers.get(KV_UNUSED_HEADER) == "1", r.text
        assert "[DONE]" in r.text and "error" not in r.text
        assert loads.asked.is_set() and loads.dones == [] and len(tried) == 1
        r = c.post("/v1/completions", json=BODY)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == BODY["max_tokens"]
        pool_whole(c)


@pytest.mark.parametrize("field,value", [("remote_port", "abc"), ("remote_port", None), ("remote_port", 70000),
                                         ("lease_seconds", "x"), ("transfer_id", 7), ("num_prompt_tokens", "4"),
                                         ("lease_seconds", True)])
def test_signed_params_of_the_wrong_type_are_a_400_and_the_engine_lives(qwen3_tiny, releases, field, value):
    """Params whose proof holds but whose fields D cannot act on (a P of another version, or someone with the KV
    token): a 400 naming the field, before the scheduler or a KV thread reads them. Before, a port "abc" raised
    inside the scheduler and ended D's engine loop: every later request got a 503. Nothing is released to a P
    named by such params, and D serves the next request with its pool whole."""
    with served(qwen3_tiny, kv={}) as (c, state):
        unsigned = {k: v for k, v in remote_params(PROMPT).items() if k != "kv_proof"}
        params = sign_params({**unsigned, field: value}, TOKEN)
        for stream in (False, True):
            r = c.post("/v1/completions", json={**PD_BODY, "stream": stream, "kv_transfer_params": params})
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == "kv_transfer_params" and f"malformed {field}" in err["message"], err
        r = c.post("/v1/completions", json=BODY)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == BODY["max_tokens"]
        assert c.get("/health").status_code == 200
        pool_whole(c)


def test_a_pd_request_served_without_ps_kv_says_so_for_the_router(qwen3_tiny):
    """P cannot be reached over the KV link (here nobody listens; a TLS mismatch looks the same): D prefills
    locally and answers X-PD-KV-Unused, streamed and not, so the router releases P's lease over HTTP (D's own
    `done` would take the broken link too). A request without P/D params never carries it."""
    from pdserve.serve.server_timing import KV_UNUSED_HEADER
    with served(qwen3_tiny, kv={}) as (c, state):
        r = c.post("/v1/completions", json={**PD_BODY, "kv_transfer_params": remote_params(PROMPT)})
        assert r.status_code == 200 and r.headers.get(KV_UNUSED_HEADER) == "1", r.headers
        assert r.json()["usage"]["completion_tokens"] == BODY["max_tokens"]
        with c.stream("POST", "/v1/completions", json={**PD_BODY, "stream": True,
                                                       "kv_transfer_params": remote_params(PROMPT)}) as r:
            assert r.status_code == 200 and r.headers.get(KV_UNUSED_HEADER) == "1"
            assert list(r.iter_lines())
        r = c.post("/v1/completions", json=PD_BODY)
        assert r.status_code == 200 and KV_UNUSED_HEADER not in r.headers
        pool_whole(c)


def test_a_drain_aborts_requests_waiting_on_their_kv_load(qwen3_tiny, monkeypatch):
    """A drain that times out while a P/D request still waits for its KV load: the request ends (finish_reason
    abort, no token), its blocks stay out of use until the load ends (it writes them), and while draining new work
    gets a 503 naming the shutdown."""
    loads = SteeredLoads(monkeypatch, hold=True)
    with served(qwen3_tiny, kv={}) as (c, state):
        out = {}
        client = threading.Thread(target=lambda: out.update(r=c.post(
            "/v1/completions", json={**PD_BODY, "kv_transfer_params": remote_params(PROMPT)})))
        client.start()
        try:
            assert loads.asked.wait(5)
            async def start_drain():  # its first step runs before any request sent after this returns
                return asyncio.ensure_future(state.engine.drain(0.3))
            drain = c.portal.call(start_drain)
            r = c.post("/v1/completions", json=BODY)
            assert r.status_code == 503 and "the server is shutting down" in r.json()["error"]["message"]
            r = c.get("/health")
            assert r.status_code == 503 and r.json() == {"status": "shutting down"}
            client.join(4)
            assert not client.is_alive(), "the drain did not abort the request"
            wait_for(drain.done, what="the drain to end")
            r = out["r"]
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            assert choice["finish_reason"] == "abort" and r.json()["usage"]["completion_tokens"] == 0
            assert engine_core(state).engine.scheduler.transfers.deferred_free  # the load still owns its blocks
        finally:
            loads.gate.set()
        core = engine_core(state)
        wait_for(lambda: not core.engine.scheduler.transfers.deferred_free, what="the load's blocks back")
        assert not core.engine.scheduler.requests
        pool_whole(c)


def test_an_error_before_the_first_token_of_a_pd_stream_is_a_500(qwen3_tiny):
    """P is gone (nothing listens where the params point) and D's policy is to fail: the stream's headers were
    held for the first token, so the client gets a 500 naming the failure, not a 200 stream with an error
    event."""
    with served(qwen3_tiny, kv={"kv_load_failure_policy": "fail"}) as (c, state):
        r = c.post("/v1/completions", json={**PD_BODY, "stream": True, "kv_transfer_params": remote_params(PROMPT)})
        assert r.status_code == 500, r.text
        err = r.json()["error"]
        assert err["code"] == 500 and err["message"].startswith("the request failed: ") and "Traceback" not in r.text
        assert "KV load failed (ConnectionRefusedError)" in err["message"], err
        pool_whole(c)
        r = c.post("/v1/completions", json={**BODY, "stream": True})
        assert r.status_code == 200 and events(r.text)[-1] == "[DONE]"
        pool_whole(c)


def test_a_client_gone_before_the_first_token_of_a_pd_stream_is_499(qwen3_tiny, monkeypatch):
    """The client goes away while D waits for its KV load (the stream's headers not sent yet): 499, the request is
    aborted, its blocks held until the load ends, then the pool whole."""
    loads = SteeredLoads(monkeypatch, hold=True)
    with served(qwen3_tiny, kv={}) as (c, state):
        core = engine_core(state)
        body = json.dumps({**PD_BODY, "stream": True, "kv_transfer_params": remote_params(PROMPT)}).encode()
        try:
            res = c.portal.call(lambda: asgi(c.app, "POST", "/v1/completions", body, disconnect_after=0.3,
                                             timeout=5))
            assert res["status"] == 499 and res["seconds"] < 3, res
            assert loads.asked.is_set()
            wait_for(lambda: not core.engine.scheduler.requests, what="the abort to reach the engine")
        finally:
            loads.gate.set()
        wait_for(lambda: not core.engine.scheduler.transfers.deferred_free, what="the load's blocks back")
        pool_whole(c)
        r = c.post("/v1/completions", json=BODY)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == BODY["max_tokens"]
