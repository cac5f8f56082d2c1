"""Tokenize once (issue 35, item 6): P signs the prompt's token ids with the digest of its prompt input, and D, when
its own body's digest matches, takes them and runs neither the chat template nor its tokenizer.

In process: P, D and a collocated server C (float64, greedy, thread backends), each a real engine and HTTP app; the
P/D flow driven by hand as vllm-router drives it (P's params relayed verbatim to D with the client's body) and
through pdserve's router in both first-token modes. D's prompt tokenization is counted on its serving layer's
tokenizer. Every case ends with every pool whole (P's leases released)."""
from __future__ import annotations

import asyncio
import json
import time
from contextlib import ExitStack, contextmanager

import httpx
import pytest
from starlette.testclient import TestClient

from pdserve.config import EngineConfig
from pdserve.router.app import Router
from pdserve.router.app import build_app as build_router
from pdserve.serve.api_server import ServerState, build_app
from pdserve.serve.server_config import ServerConfig
from pdserve.transfer.channel.prompt_ids import PROMPT_INPUT_DIGEST, PROMPT_TOKEN_IDS, pack_token_ids, \
    unpack_token_ids
from pdserve.transfer.channel.proof import NOT_VERIFIED, PROOF_FIELD, sign_params
from tests.router.fake_upstream import MockUpstream
from tests.server_harness import free_port
from tests.serve.test_failure_paths_serving import pool_whole

TOKEN = "tokenize-once-token"
B = 4  # block size
MODEL = "qwen3-tiny-s0"
PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n    return"
MESSAGES = [{"role": "user", "content": PROMPT}]
SYSTEM = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "Sort a list."}]


class CountingTokenizer:
    """D's serving-layer tokenizer, counting what tokenizes a prompt (encoding and chat templates)."""

    def __init__(self, tok):
        self.tok, self.calls = tok, 0

    def __call__(self, *a, **kw):
        self.calls += 1
        return self.tok(*a, **kw)

    def apply_chat_template(self, *a, **kw):
        self.calls += 1
        return self.tok.apply_chat_template(*a, **kw)

    def encode(self, *a, **kw):
        self.calls += 1
        return self.tok.encode(*a, **kw)

    def __getattr__(self, name):
        return getattr(self.tok, name)


@contextmanager
def node(model, kv=None):
    kwargs = dict(block_size=B, max_model_len=256, dtype="float64", kv_cache_memory_gb=0.05)
    if kv is not None:
        kwargs["kv_transfer_config"] = {"kv_connector": "TcpConnector", "kv_auth_token": TOKEN, **kv}
    state = ServerState(EngineConfig.from_kwargs(model, **kwargs),
                        ServerConfig(enable_debug_routes=True, engine_backend="thread"))
    with TestClient(build_app(state)) as c:
        deadline = time.monotonic() + 60
        while c.get("/health").status_code != 200 or state.serving is None:
            assert time.monotonic() < deadline, "server not healthy"
            time.sleep(0.05)
        yield c, state


class ToApps(httpx.AsyncBaseTransport):
    """pdserve's router's HTTP client, reaching the in-process apps (each on its TestClient's own loop)."""

    def __init__(self, clients: dict):
        self.clients = clients

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        body = await request.aread()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host", "content-length")}
        r = await asyncio.to_thread(self.clients[request.url.host].request, request.method, request.url.path,
                                    content=body, headers=headers)
        out = [(k, v) for k, v in r.headers.items() if k.lower() not in ("content-length", "content-encoding")]
        return httpx.Response(r.status_code, headers=out, stream=httpx.ByteStream(r.content))


@pytest.fixture(scope="module")
def dep(qwen3_tiny):
    kv_port = free_port()
    with ExitStack() as stack:
        P, _ = stack.enter_context(node(qwen3_tiny, {"kv_role": "kv_producer", "kv_port": kv_port}))
        D, d_state = stack.enter_context(node(qwen3_tiny, {"kv_role": "kv_consumer",
                                                           "kv_peers": [f"127.0.0.1:{kv_port}"]}))
        C, _ = stack.enter_context(node(qwen3_tiny))
        tok = d_state.serving.info.tokenizer = CountingTokenizer(d_state.serving.info.tokenizer)
        routers = {}
        for mode in ("replay", "prefill"):
            # D asked after P answered: with early decode (the router's default) D has no ids of P's yet, and
            # tokenizes while P prefills
            router = Router(["http://p.test"], ["http://d.test"], "round-robin", health_interval=3600,
                            pd_first_token=mode, early_decode=False)
            router.client = MockUpstream(ToApps({"p.test": P, "d.test": D}))
            routers[mode] = stack.enter_context(TestClient(build_router(router)))
        yield {"P": P, "D": D, "C": C, "tok": tok, "d_info": d_state.serving.info, **routers}


def body_of(chat: bool, prompt, stream: bool, **extra) -> dict:
    body = {"model": MODEL, "max_tokens": 8, "temperature": 0, "stream": stream, "return_token_ids": True,
            **({"stream_options": {"include_usage": True}} if stream else {}), **extra}
    return body | ({"messages": prompt} if chat else {"prompt": prompt})


def path(chat: bool) -> str:
    return "/v1/chat/completions" if chat else "/v1/completions"


def answer(r, chat: bool, stream: bool) -> dict:
    """What the client gets, however it came: text, finish reason, output and prompt token ids, usage."""
    assert r.status_code == 200, r.text
    if not stream:
        j = r.json()
        c = j["choices"][0]
        return {"text": c["message"]["content"] if chat else c["text"], "finish": c["finish_reason"],
                "ids": c["token_ids"], "prompt_ids": j.get("prompt_token_ids") or c.get("prompt_token_ids"),
                "prompt_tokens": j["usage"]["prompt_tokens"]}
    out = {"text": "", "finish": None, "ids": [], "prompt_ids": None, "prompt_tokens": None}
    for line in r.text.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        obj = json.loads(line[6:])
        assert "error" not in obj, obj
        out["prompt_ids"] = obj.get("prompt_token_ids") or out["prompt_ids"]
        if obj.get("usage"):
            out["prompt_tokens"] = obj["usage"]["prompt_tokens"]
        for c in obj["choices"]:
            out["text"] += (c["delta"].get("content") or "") if chat else c["text"]
            out["ids"] += c.get("token_ids") or []
            out["prompt_ids"] = c.get("prompt_token_ids") or out["prompt_ids"]
            out["finish"] = c.get("finish_reason") or out["finish"]
    return out


def prefill(dep, chat: bool, prompt, **extra):
    """P's answer to a router's prefill request (as vllm-router asks it): its kv_transfer_params, or None."""
    body = body_of(chat, prompt, False, **{"max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True},
                                           **extra})
    body.pop("return_token_ids")
    r = dep["P"].post(path(chat), json=body)
    assert r.status_code == 200, r.text
    return r.json().get("kv_transfer_params")


def decode(dep, chat: bool, prompt, stream: bool, params, **extra):
    """D's answer to the client's body with `params`, and how many times D tokenized a prompt for it."""
    before = dep["tok"].calls
    r = dep["D"].post(path(chat), json=body_of(chat, prompt, stream, kv_transfer_params=params, **extra))
    return r, dep["tok"].calls - before


def collocated(dep, chat: bool, prompt, stream: bool = False) -> dict:
    return answer(dep["C"].post(path(chat), json=body_of(chat, prompt, stream)), chat, stream)


def whole(dep) -> None:
    for name in ("P", "D", "C"):
        pool_whole(dep[name])


def exact(dep, n: int) -> str:
    """A text prompt of exactly n tokens."""
    for word in (" x", " a", " the", "1"):
        text = "x" + word * (n - 1)
        r = dep["C"].post("/tokenize", json={"model": MODEL, "prompt": text}).json()
        if r["count"] == n:
            return text
    raise AssertionError(f"no {n}-token prompt found")


# ---- the wire half ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("ids", [[0], [1, 2, 3], [65535, 0, 7], [65536, 3], [151_000, 2**31, 0]])
def test_packed_ids_round_trip(ids):
    packed = pack_token_ids(ids)
    assert packed.startswith("u16le:" if max(ids) < 65536 else "u32le:")
    assert unpack_token_ids(packed) == ids


@pytest.mark.parametrize("bad", [None, 5, "", "u16le", "u8:AAAA", "u16le:!!", "u16le:AA==", "u32le:AAA=",
                                 ["u16le:AAAA"]])
def test_unpacking_anything_else_is_none(bad):
    assert unpack_token_ids(bad) is None


# ---- D takes P's ids and answers as collocated --------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_d_uses_ps_ids_and_answers_as_collocated(dep, chat, stream):
    prompt = MESSAGES if chat else PROMPT
    want = collocated(dep, chat, prompt)
    params = prefill(dep, chat, prompt)
    assert PROMPT_TOKEN_IDS in params and PROMPT_INPUT_DIGEST in params
    assert unpack_token_ids(params[PROMPT_TOKEN_IDS]) == want["prompt_ids"]
    r, tokenized = decode(dep, chat, prompt, stream, params)
    assert answer(r, chat, stream) == (collocated(dep, chat, prompt, stream) if stream else want)
    assert tokenized == 0, "D tokenized a prompt P handed over"
    whole(dep)


@pytest.mark.parametrize("mode", ["replay", "prefill"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_through_pdserves_router(dep, mode, chat, stream):
    prompt = SYSTEM if chat else PROMPT
    want = collocated(dep, chat, prompt, stream)
    before = dep["tok"].calls
    got = answer(dep[mode].post(path(chat), json=body_of(chat, prompt, stream)), chat, stream)
    assert got == want
    assert dep["tok"].calls == before, "D tokenized a prompt P handed over"
    whole(dep)


def test_d_tokenizing_itself_answers_the_same(dep):
    """P's params without the ids (as an older P signs them): D tokenizes, and the answer is the same."""
    want = collocated(dep, False, PROMPT)
    params = prefill(dep, False, PROMPT)
    older = sign_params({k: v for k, v in params.items() if k not in (PROOF_FIELD, PROMPT_TOKEN_IDS,
                                                                       PROMPT_INPUT_DIGEST)}, TOKEN)
    r, tokenized = decode(dep, False, PROMPT, False, older)
    assert answer(r, False, False) == want and tokenized == 1
    whole(dep)


# ---- what D does not trust ----------------------------------------------------------------------------------------
def test_another_prompt_in_the_body_is_tokenized_and_the_hash_decides(dep):
    params = prefill(dep, False, PROMPT)
    r, tokenized = decode(dep, False, PROMPT + " pass", False, params)
    assert tokenized == 1 and r.status_code == 400 and "another prompt" in r.json()["error"]["message"]
    # chat: the same words as text parts render the same prompt: tokenized here, then the hash lets it through
    params = prefill(dep, True, MESSAGES)
    parts = [{"role": "user", "content": [{"type": "text", "text": PROMPT[:10]},
                                          {"type": "text", "text": PROMPT[10:]}]}]
    r, tokenized = decode(dep, True, parts, False, params)
    assert tokenized == 2 and answer(r, True, False) == collocated(dep, True, MESSAGES)  # template, then tokenizer
    # a field that changes the rendering (no generation prompt) is another prompt input
    params = prefill(dep, True, MESSAGES)
    r, tokenized = decode(dep, True, MESSAGES, False, params, add_generation_prompt=False)
    assert tokenized == 2 and r.status_code == 400 and "another prompt" in r.json()["error"]["message"]
    whole(dep)


def test_altered_ids_fail_the_proof(dep):
    params = prefill(dep, False, PROMPT)
    ids = unpack_token_ids(params[PROMPT_TOKEN_IDS])
    altered = {**params, PROMPT_TOKEN_IDS: pack_token_ids(ids[:-1] + [ids[-1] + 1])}
    r, tokenized = decode(dep, False, PROMPT, False, altered)
    assert r.status_code == 400 and r.json()["error"]["message"].startswith(NOT_VERIFIED)
    assert tokenized == 1  # not trusted: tokenized here, and the engine's check of the proof refuses
    # D cannot end a lease on params whose proof fails: the router releases it on P, with P's own params
    assert dep["P"].post("/v1/kv/release", json={"kv_transfer_params": params}).status_code == 200
    whole(dep)


def test_unsigned_ids_beside_signed_params_are_not_taken(dep):
    """Ids and a matching digest added beside params P signed without them (a router's, a client's) are dropped:
    D tokenizes, and the prompt hash decides (here the unsigned ids are another prompt's, which D never uses)."""
    params = prefill(dep, False, PROMPT)
    signed = sign_params({k: v for k, v in params.items() if k not in (PROOF_FIELD, PROMPT_TOKEN_IDS)}, TOKEN)
    other = collocated(dep, False, exact(dep, 5))["prompt_ids"]
    r, tokenized = decode(dep, False, PROMPT, False, {**signed, PROMPT_TOKEN_IDS: pack_token_ids(other)})
    assert tokenized == 1 and answer(r, False, False) == collocated(dep, False, PROMPT)
    whole(dep)


def test_a_clients_own_digest_is_not_passed_on_by_p(dep):
    r = dep["P"].post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 1,
                                               "kv_transfer_params": {"do_remote_decode": True,
                                                                      PROMPT_INPUT_DIGEST: "forged"}})
    params = r.json()["kv_transfer_params"]
    assert params[PROMPT_INPUT_DIGEST] != "forged"
    r, tokenized = decode(dep, False, PROMPT, False, params)
    assert tokenized == 0 and r.status_code == 200
    # a token-id prompt has its ids already: nothing handed over, whatever digest the client sent
    params = prefill(dep, False, [5, 6, 7, 8, 9], kv_transfer_params={"do_remote_decode": True,
                                                                      PROMPT_INPUT_DIGEST: "forged"})
    assert PROMPT_INPUT_DIGEST not in params and PROMPT_TOKEN_IDS not in params
    assert dep["P"].post("/v1/kv/release", json={"kv_transfer_params": params}).status_code == 200
    whole(dep)


def test_what_d_still_checks_and_echoes_without_tokenizing(dep):
    """With P's ids D still sizes the text (--max-prompt-chars), checks the context (max_tokens), echoes the prompt
    and counts it in usage, as when it tokenizes itself."""
    info = dep["d_info"]
    limit, info.max_prompt_chars = info.max_prompt_chars, len(PROMPT) - 1
    try:
        r, tokenized = decode(dep, False, PROMPT, False, prefill(dep, False, PROMPT))
    finally:
        info.max_prompt_chars = limit
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt" and tokenized == 0
    assert "--max-prompt-chars" in r.json()["error"]["message"]
    r, tokenized = decode(dep, False, PROMPT, False, prefill(dep, False, PROMPT), max_tokens=250)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens" and tokenized == 0
    want = answer(dep["C"].post("/v1/completions", json=body_of(False, PROMPT, False, echo=True)), False, False)
    assert want["text"].startswith(PROMPT)
    r, tokenized = decode(dep, False, PROMPT, False, prefill(dep, False, PROMPT), echo=True)
    assert answer(r, False, False) == want and tokenized == 0
    whole(dep)


# ---- edge prompts -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 2, B, B + 1])
def test_edge_prompt_lengths(dep, n):
    prompt = exact(dep, n)
    want = collocated(dep, False, prompt)
    assert want["prompt_tokens"] == n
    params = prefill(dep, False, prompt)
    if n == 1:  # nothing to hand over (D replays its one token itself): P answers without params
        assert params is None
    for stream in (False, True):
        r, tokenized = decode(dep, False, prompt, stream, prefill(dep, False, prompt) if stream else params)
        assert tokenized == (1 if n == 1 else 0)
        assert answer(r, False, stream) == collocated(dep, False, prompt, stream)
    for mode in ("replay", "prefill"):  # through the router too, the first-token mode handing over all n
        before = dep["tok"].calls
        assert answer(dep[mode].post("/v1/completions", json=body_of(False, prompt, False)), False, False) == want
        assert dep["tok"].calls - before == (1 if n == 1 and mode == "replay" else 0)
    whole(dep)


def test_chat_with_a_system_message(dep):
    for stream in (False, True):
        params = prefill(dep, True, SYSTEM)
        r, tokenized = decode(dep, True, SYSTEM, stream, params)
        assert tokenized == 0 and answer(r, True, stream) == collocated(dep, True, SYSTEM, stream)
    whole(dep)
