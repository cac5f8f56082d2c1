"""Issue 37: nothing a client sends stalls the server's event loop. Oversized input is refused before it is
tokenized or rendered (a 4xx naming the field), and the tokenization and chat templating that do run happen on a
worker thread, so the event loop keeps answering while they work. One request's `n` is bounded too.

The event loop's time is measured by a probe coroutine on the server's own loop (in process, thread backend): the
longest gap between its 2 ms sleeps while the request is handled. The issue's target is 100 ms; the bound here is
0.5 s because the test box is shared, while the old code stalled the loop for seconds on each of these bodies."""
from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from contextlib import contextmanager

import pytest
import httpx
from starlette.testclient import TestClient

from pdserve.config import EngineConfig
from pdserve.serve import offload
from pdserve.serve.api_server import ServerState, build_app
from pdserve.serve.request_context import request_id_var
from pdserve.serve.server_config import ServerConfig
from tests.server_harness import ServerProcess, healthy
from tests.transfer.test_failure_paths_pd import asgi

MAX_MODEL_LEN = 256
MAX_NUM_SEQS = 8
MAX_LAG = 0.5  # seconds: see the docstring


@contextmanager
def server(model, **cfg):
    state = ServerState(EngineConfig.from_kwargs(model, block_size=16, max_model_len=MAX_MODEL_LEN,
                                                 max_num_seqs=MAX_NUM_SEQS),
                        ServerConfig(**{"enable_debug_routes": True, "engine_backend": "thread", **cfg}))
    with TestClient(build_app(state)) as c:
        deadline = time.monotonic() + 60
        while c.get("/health").status_code != 200:
            assert time.monotonic() < deadline, "server not healthy"
            time.sleep(0.05)
        yield c, state


@pytest.fixture(scope="module")
def srv(qwen3_tiny):
    with server(qwen3_tiny) as s:
        yield s


async def _with_lag(coro) -> tuple:
    """(what `coro` returned, the event loop's longest stall in seconds while it ran)."""
    lag, done = 0.0, False

    async def probe():
        nonlocal lag
        last = time.perf_counter()
        while not done:
            await asyncio.sleep(0.002)
            now = time.perf_counter()
            lag = max(lag, now - last - 0.002)
            last = now
    task = asyncio.ensure_future(probe())
    await asyncio.sleep(0.01)
    try:
        res = await coro
    finally:
        done = True
        await task
    return res, lag


def post(c, path: str, body, chunked: bool = False, timeout: float = 120.0, headers=()) -> tuple[dict, float]:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    kw = {"chunks": [raw[i:i + (1 << 16)] for i in range(0, len(raw), 1 << 16)]} if chunked else {"body": raw}
    kw["headers"] = headers
    return c.portal.call(lambda: _with_lag(asgi(c.app, "POST", path, timeout=timeout, **kw)))


def error_of(res: dict, status: int) -> dict:
    assert res["status"] == status, (res["status"], res["body"][:300])
    err = json.loads(res["body"])["error"]
    assert err["code"] == status
    return err


def served_still(c):
    r = c.post("/v1/completions", json={"prompt": "hello there", "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text


def test_a_20_mib_body_is_refused_without_stalling_the_loop(srv):
    """A 20 MiB body streamed without a length: 413 naming the flag (read only up to the limit and its slack)."""
    c, _ = srv
    res, lag = post(c, "/v1/completions", {"prompt": "x" * (20 << 20)}, chunked=True)
    assert "--max-body-bytes" in error_of(res, 413)["message"]
    assert lag < MAX_LAG, lag
    served_still(c)


@pytest.mark.parametrize("path", ["/v1/completions", "/tokenize"])
def test_a_prompt_that_cannot_fit_is_refused_before_it_is_tokenized(srv, path):
    """12 MiB of text, under the body limit but thousands of times what max_model_len tokens can hold: a 400
    naming `prompt` and the flag, answered before tokenization (which took the old code seconds of event loop)."""
    c, _ = srv
    res, lag = post(c, path, {"prompt": "many words " * ((12 << 20) // 11), "max_tokens": 4}
                    if path != "/tokenize" else {"prompt": "many words " * ((12 << 20) // 11)})
    err = error_of(res, 400)
    assert err["param"] == "prompt" and "--max-prompt-chars" in err["message"], err
    assert lag < MAX_LAG, lag
    served_still(c)


def test_the_flag_sets_the_limit(qwen3_tiny):
    with server(qwen3_tiny, max_prompt_chars=100) as (c, _):
        r = c.post("/tokenize", json={"prompt": "a" * 100})
        assert r.status_code == 200, r.text
        for path, body, param in [("/tokenize", {"prompt": "a" * 101}, "prompt"),
                                  ("/v1/completions", {"prompt": ["hi", "a" * 101]}, "prompt"),
                                  ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a" * 99}]},
                                   "messages")]:  # 99 characters and one for the message: 100 is allowed
            r = c.post(path, json=body)
            assert r.status_code == (200 if param == "messages" else 400), r.text
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "a" * 100}]})
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "messages" and "(100, --max-prompt-chars" in err["message"]
        r = c.post("/v1/completions", json={"prompt": ["hi", "a" * 101]})
        assert "prompt[1]: 101 characters" in r.json()["error"]["message"]


def test_a_prompt_at_the_limit_is_tokenized(srv):
    """The derived limit (32 characters per token of max_model_len) refuses no prompt that could fit: one of
    exactly that many characters is tokenized and judged by its tokens (too many for the context here)."""
    c, state = srv
    limit = state.serving.info.max_prompt_chars
    assert limit == 32 * MAX_MODEL_LEN
    r = c.post("/v1/completions", json={"prompt": "a" * limit, "max_tokens": 4})
    assert r.status_code == 400 and "--max-prompt-chars" not in r.json()["error"]["message"], r.text
    assert "tokens but the context length" in r.json()["error"]["message"]
    r = c.post("/v1/completions", json={"prompt": "a" * (limit + 1), "max_tokens": 4})
    assert r.status_code == 400 and "--max-prompt-chars" in r.json()["error"]["message"], r.text


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
LISTS = {
    "batch": ("/v1/completions", {"prompt": ["hello world"] * 100_000, "max_tokens": 4}, "prompt"),
    "token_ids": ("/v1/completions", {"prompt": [5] * 100_000, "max_tokens": 4}, "prompt"),
    "messages": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello world"}] * 100_000,
                                          "max_tokens": 4}, "messages"),
    "content_parts": ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "hello world"}] * 100_000}], "max_tokens": 4}, "messages"),
    # the request lists capped in sampling_params.py (issue 37 item 3)
    "stop": ("/v1/chat/completions", CHAT | {"stop": ["x"] * 100_000}, "stop"),
    "stop_token_ids": ("/v1/chat/completions", CHAT | {"stop_token_ids": [5] * 100_000}, "stop_token_ids"),
    "logit_bias": ("/v1/chat/completions", CHAT | {"logit_bias": {str(i): 1 for i in range(100_000)}},
                   "logit_bias"),
    "bad_words": ("/v1/chat/completions", CHAT | {"bad_words": ["x"] * 100_000}, "bad_words"),
}


@pytest.mark.parametrize("case", list(LISTS))
def test_a_100k_item_list_is_refused_before_any_work(srv, case):
    """A 100,000-item list: a batch of prompts (more than the server ever queues), a list of token ids (more than
    the context), chat messages or content parts (more than the context can hold), a sampling list over its cap:
    each a 400 naming its field, answered without tokenizing or rendering the items one by one on the event loop."""
    c, _ = srv
    path, body, param = LISTS[case]
    res, lag = post(c, path, body)
    assert error_of(res, 400)["param"] == param
    assert lag < MAX_LAG, lag
    served_still(c)


class _SlowTokenizer:
    """The server's tokenizer, taking `delay` seconds more for each text it tokenizes or renders (time.sleep lets
    the GIL go, as the Rust tokenizer's encoding does)."""

    def __init__(self, real, delay: float):
        self._real, self._delay = real, delay

    def __call__(self, *a, **kw):
        self.request_id = request_id_var.get()  # what the log lines written here are stamped with
        time.sleep(self._delay)
        return self._real(*a, **kw)

    def apply_chat_template(self, *a, **kw):
        time.sleep(self._delay)
        return self._real.apply_chat_template(*a, **kw)

    def __getattr__(self, name):
        return getattr(self._real, name)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize"])
def test_tokenization_and_templating_run_off_the_event_loop(srv, monkeypatch, path):
    """A slow tokenizer (1 s a call) delays only its own request: the event loop keeps running meanwhile."""
    c, state = srv
    tok = _SlowTokenizer(state.serving.info.tokenizer, 1.0)
    monkeypatch.setattr(state.serving.info, "tokenizer", tok)
    body = {"messages": [{"role": "user", "content": "hello"}]} if "chat" in path else {"prompt": "hello"}
    if path != "/tokenize":
        body |= {"max_tokens": 2, "temperature": 0}
    res, lag = post(c, path, body, headers=[("x-request-id", "off-loop-1")])
    assert res["status"] == 200, res["body"][:300]
    assert res["seconds"] >= 1.0  # it did go through the slow tokenizer
    assert lag < MAX_LAG, lag
    assert tok.request_id == "off-loop-1"  # the worker thread runs in the request's context


def test_n_is_bounded_by_max_num_seqs(srv):
    """n choices run as n requests: more than one step's batch (--max-num-seqs) is refused, naming `n`, so one
    request cannot take over the waiting queue (the old bound was --max-waiting, 1024 by default)."""
    c, _ = srv
    body = {"prompt": "hello", "max_tokens": 2, "temperature": 0}
    r = c.post("/v1/completions", json=body | {"n": MAX_NUM_SEQS + 1})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "n" and "--max-num-seqs" in err["message"], err
    r = c.post("/v1/completions", json=body | {"n": MAX_NUM_SEQS})
    assert r.status_code == 200 and len(r.json()["choices"]) == MAX_NUM_SEQS, r.text


class _GatedTokenizer:
    """The server's tokenizer, holding every text longer than 1000 characters until `gate` opens."""

    def __init__(self, real, gate):
        self._real, self.gate, self.held = real, gate, 0

    def __call__(self, text, *a, **kw):
        if len(text) > 1000:
            self.held += 1
            assert self.gate.wait(30)
        return self._real(text, *a, **kw)

    def __getattr__(self, name):
        return getattr(self._real, name)


def test_small_requests_never_queue_behind_big_ones(srv, monkeypatch):
    """Eight big bodies (past offload.BULK_BYTES) whose tokenizing hangs take every thread they may have; a small
    request still gets its answer meanwhile, and the big ones theirs once their tokenizing goes on."""
    c, state = srv
    gate = threading.Event()
    tok = _GatedTokenizer(state.serving.info.tokenizer, gate)
    monkeypatch.setattr(state.serving.info, "tokenizer", tok)
    big = {"prompt": "many words " * 200, "max_tokens": 2, "padding": "x" * offload.BULK_BYTES}
    small = {"prompt": "hello", "max_tokens": 2, "temperature": 0}

    async def scenario():
        bigs = [asyncio.ensure_future(asgi(c.app, "POST", "/v1/completions", json.dumps(big).encode(),
                                           timeout=60)) for _ in range(8)]
        deadline = time.monotonic() + 10
        while tok.held < 2 and time.monotonic() < deadline:  # the bulk pool's threads are all held
            await asyncio.sleep(0.01)
        try:
            first = await asgi(c.app, "POST", "/v1/completions", json.dumps(small).encode(), timeout=5)
        finally:
            gate.set()
        return first, await asyncio.gather(*bigs)

    first, bigs = c.portal.call(scenario)
    assert tok.held >= 2
    assert first["status"] == 200, first
    assert [b["status"] for b in bigs] == [400] * 8  # their prompts are over max_model_len, once tokenized
    assert all(b"tokens but the context length" in b["body"] for b in bigs)


def test_a_stream_goes_on_while_hostile_bodies_are_refused(qwen3_tiny):
    """End to end on a `pdserve serve` process (engine in its own process, default limits): while the issue's
    bodies arrive one after another (a 20 MiB body, a prompt that cannot fit, 100,000-item lists), a stream's
    tokens keep coming: no gap between two of its chunks reaches 2 s (the old code held it for the seconds each
    tokenization took on the event loop), and each body is a 4xx."""
    hostile = [
        ("/v1/completions", {"prompt": "x" * (20 << 20)}),
        ("/v1/completions", {"prompt": "many words " * ((12 << 20) // 11)}),
        ("/v1/completions", {"prompt": ["hello world"] * 100_000}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello world"}] * 100_000}),
    ]
    bodies = [(path, json.dumps(body | {"max_tokens": 4}).encode()) for path, body in hostile]
    srv = ServerProcess(qwen3_tiny, "--max-model-len", "2048")
    with healthy(srv):
        statuses, started = [], threading.Event()

        def attack():
            started.wait(60)
            with httpx.Client(base_url=srv.url, timeout=120) as h:
                for path, raw in bodies:
                    statuses.append(h.post(path, content=raw, headers={"content-type": "application/json"}))
        sender = threading.Thread(target=attack)
        sender.start()
        arrivals = []
        try:
            with httpx.stream("POST", srv.url + "/v1/completions", timeout=120, json={
                    "prompt": "def f(x):", "max_tokens": 1500, "ignore_eos": True, "temperature": 0,
                    "stream": True}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        arrivals.append(time.monotonic())
                        started.set()
                        if len(statuses) == len(bodies):
                            break  # every hostile body was answered while the stream ran
        finally:
            started.set()
            sender.join(180)
    gap = max(b - a for a, b in zip(arrivals, arrivals[1:]))
    assert gap < 2.0, gap
    assert [s.status_code for s in statuses] == [413, 400, 400, 400], [s.text[:200] for s in statuses]
    assert [s.json()["error"]["param"] for s in statuses[1:]] == ["prompt", "prompt", "messages"]


def test_a_dense_body_is_parsed_off_the_loop(srv):
    """15 MiB of a 7.5M-value list: seconds of json.loads, which holds the GIL, so a thread would stall the loop as
    much. It is parsed in a worker process (serve/json_body.py) and refused there for its values: the loop stays
    free, and the 400 says why."""
    c, _ = srv
    raw = b'{"prompt": [' + b"0," * (15 << 19) + b'0], "max_tokens": 4}'
    res, lag = post(c, "/v1/completions", raw)
    assert "values, more than the" in error_of(res, 400)["message"]
    assert lag < MAX_LAG, lag
    served_still(c)


@pytest.mark.parametrize("raw", [b'{"prompt": "' + b"a" * (300 << 10) + b'"}', b'[1, 2]', b'{"a": ',
                                 b'{"p": "\\ud800"}', b'{"p": "\\ud83d\\ude00' + b" " * (300 << 10) + b'"}',
                                 b"[" * 100_000 + b"]" * 100_000])
def test_a_body_parses_the_same_in_the_worker_and_here(raw):
    """The worker's answer (big bodies) equals the in-process one (small bodies), dict or refusal alike."""
    from pdserve.serve import json_body
    raw += b" " * json_body.OFFLOAD_BYTES  # big enough for the worker
    json_body.start()
    try:
        got = asyncio.run(json_body.parse_off_loop(raw))
        assert json_body._pool.submit(json_body._worker_pid).result() != os.getpid()
    finally:
        json_body.stop()
    assert got == json_body.parse(raw)


def test_a_requests_own_chat_template_is_refused_naming_the_flag(srv):
    """vLLM's rule (issue 37 item 1): a request's template is code the server would run; refused unless the server
    trusts its clients, in either place a request can put one, and on completions, which take none."""
    c, _ = srv
    own = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}"
    for body, param in (({"chat_template": own}, "chat_template"),
                        ({"chat_template_kwargs": {"chat_template": own}}, "chat_template_kwargs")):
        r = c.post("/v1/chat/completions", json=CHAT | body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        assert "--trust-request-chat-template" in r.json()["error"]["message"]
    r = c.post("/tokenize", json={"messages": CHAT["messages"], "chat_template": own})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template", r.text
    r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "chat_template": own})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template", r.text


def test_a_trusting_server_renders_the_requests_own_template(qwen3_tiny):
    """--trust-request-chat-template: the request's template, not the model's, makes the prompt (the answer equals
    a completions request for the text it renders), from either field; a template that fails is a 400."""
    own = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}"
    messages = [{"role": "user", "content": "def f(x):"}]
    with server(qwen3_tiny, trust_request_chat_template=True) as (c, _):
        plain = c.post("/v1/completions", json={"prompt": "<<def f(x):>>", "max_tokens": 6, "temperature": 0,
                                                "add_special_tokens": False}).json()
        ids = c.post("/tokenize", json={"prompt": "<<def f(x):>>", "add_special_tokens": False}).json()["tokens"]
        assert c.post("/tokenize", json={"messages": messages, "chat_template": own}).json()["tokens"] == ids
        for body in ({"chat_template": own}, {"chat_template_kwargs": {"chat_template": own}}):
            r = c.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 6, "temperature": 0, **body})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["prompt_tokens"] == len(ids)
            assert r.json()["choices"][0]["message"]["content"] == plain["choices"][0]["text"]
        r = c.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2,
                                                 "chat_template": "{{ raise_exception('no') }}"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
