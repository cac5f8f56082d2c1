"""The OpenAI-compatible server end to end: one `pdserve serve` subprocess on the tiny model for this module, driven
with the official `openai` client and raw HTTP, checked against the offline `LLM` on the same greedy requests."""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve import SamplingParams
from tests.server_harness import ServerProcess, healthy

API_KEY = "test-key"
MAX_MODEL_LEN = 512
ENGINE_ARGS = dict(max_model_len=MAX_MODEL_LEN, num_gpu_blocks_override=512, max_num_seqs=64)
PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n", "class HTTPServer:"]


@pytest.fixture(scope="module", params=["process", "thread", "process-async"])
def server(qwen3_tiny, request):
    """Every test here runs against both engine backends: the engine loop in its own process (the default) and on
    a thread of the server's; and once more with async scheduling (off by default on CPU) in the process backend."""
    backend, _, overlap = request.param.partition("-")
    srv = ServerProcess(qwen3_tiny, "--engine-backend", backend, "--enable-debug-routes", "--max-model-len",
                        str(MAX_MODEL_LEN),
                        "--num-gpu-blocks-override", "512", "--max-num-seqs", "64", "--max-body-bytes", "65536",
                        "--served-model-name", "tiny", "tiny-alias", *(["--async-scheduling"] if overlap else []),
                        api_key=API_KEY)
    with healthy(srv):
        assert f"async scheduling {'on' if overlap else 'off'}" in srv.log()  # the ready line says the mode
        yield srv


@pytest.fixture(scope="module")
def llm(qwen3_tiny):
    from pdserve import LLM
    return LLM(qwen3_tiny, **ENGINE_ARGS)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=60) as c:
        yield c


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens)


def metrics(http) -> dict:
    text = http.get("/metrics").text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def total(m: dict, name: str, **labels) -> float:
    return sum(v for (n, lab), v in m.items() if n == name and all(dict(lab).get(k) == x for k, x in labels.items()))


def kv(http) -> dict:
    r = http.get("/debug/kv")
    assert r.status_code == 200, r.text
    return r.json()


# ------------------------------------------------------------------ basics

def test_health_version_models(server, http, client):
    assert server.seen_503_before_ready or http.get("/health").status_code == 200
    assert http.get("/health").status_code == 200
    assert http.get("/version").json()["version"]
    ids = [m.id for m in client.models.list().data]
    assert ids == ["tiny", "tiny-alias"]
    assert set(kv(http)) >= {"total_blocks", "free_blocks", "used_blocks", "cached_blocks", "invariants_ok"}


def test_completion_matches_offline(client, llm):
    for prompt in PROMPTS:
        want = llm.generate(prompt, greedy(24), use_tqdm=False)[0].outputs[0]
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0,
                                      extra_body={"return_token_ids": True})
        c = r.choices[0]
        assert c.model_extra["token_ids"] == want.token_ids
        assert c.text == want.text
        assert c.finish_reason == want.finish_reason
        assert r.usage.completion_tokens == len(want.token_ids)
        assert r.usage.prompt_tokens == len(llm.get_tokenizer()(prompt).input_ids)


def test_completion_stream_matches_offline(client, llm):
    prompt = PROMPTS[0]
    want = llm.generate(prompt, greedy(20), use_tqdm=False)[0].outputs[0]
    stream = client.completions.create(model="tiny-alias", prompt=prompt, max_tokens=20, temperature=0, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"return_token_ids": True})
    text, ids, usage, finish = "", [], None, None
    for chunk in stream:
        assert chunk.model == "tiny"
        if chunk.choices:
            text += chunk.choices[0].text
            ids += chunk.choices[0].model_extra.get("token_ids") or []
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage:
            usage = chunk.usage
    assert ids == want.token_ids and text == want.text and finish == want.finish_reason
    assert usage.completion_tokens == len(want.token_ids)


def test_token_id_prompt(client, llm):
    ids_in = llm.get_tokenizer()("for i in range(10):").input_ids
    want = llm.generate([ids_in], greedy(12), use_tqdm=False)[0].outputs[0]
    r = client.completions.create(model="tiny", prompt=ids_in, max_tokens=12, temperature=0,
                                  extra_body={"return_token_ids": True})
    assert r.choices[0].model_extra["token_ids"] == want.token_ids


def test_chat_matches_offline(client, llm):
    msgs = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "Sort a list."}]
    want = llm.chat(msgs, greedy(16), use_tqdm=False)[0].outputs[0]
    r = client.chat.completions.create(model="tiny", messages=msgs, max_completion_tokens=16, temperature=0,
                                       extra_body={"return_token_ids": True})
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].model_extra["token_ids"] == want.token_ids
    assert r.choices[0].message.content == want.text
    stream = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=16, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want.token_ids)


def test_chat_echo_as_vllm(http):
    """vLLM's chat `echo`: the last message's content first, when its role is the answer's (assistant, or with
    no generation prompt the last message's own), the same in the stream and the whole answer; otherwise nothing.
    (Before: the whole templated prompt, special tokens included, in the whole answer only.)"""
    def chat(msgs, stream=False, **kw):
        body = {"model": "tiny", "messages": msgs, "max_tokens": 6, "temperature": 0, "ignore_eos": True, **kw}
        if not stream:
            r = http.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["message"]["content"]
        r = http.post("/v1/chat/completions", json={**body, "stream": True})
        events = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]
        return "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])

    partial = [{"role": "user", "content": "Sort a list."}, {"role": "assistant", "content": "def sort_it"}]
    plain = chat(partial, continue_final_message=True, add_generation_prompt=False)
    for stream in (False, True):
        assert chat(partial, stream, echo=True, continue_final_message=True,
                    add_generation_prompt=False) == "def sort_it" + plain
        user_last = [{"role": "user", "content": "Sort a list."}]
        assert chat(user_last, stream, echo=True) == chat(user_last)  # not the answer's role: nothing echoed


def test_raw_sse_framing(server, http):
    body = {"prompt": "x = 1", "max_tokens": 5, "temperature": 0, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    payloads = [json.loads(e[6:]) for e in events[:-1]]
    assert payloads[-1]["choices"] == [] and payloads[-1]["usage"]["completion_tokens"] == 5
    assert payloads[-2]["choices"][0]["finish_reason"] == "length"


def test_logprobs_stop_seed(client):
    r = client.completions.create(model="tiny", prompt="def f(x):", max_tokens=6, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert all(len(t) >= 3 for t in lp.top_logprobs) and all(v <= 0 for v in lp.token_logprobs)
    c = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                       temperature=0, logprobs=True, top_logprobs=2)
    content = c.choices[0].logprobs.content
    assert len(content) == 4 and all(len(e.top_logprobs) == 2 for e in content)
    # a stop string taken from the greedy text ends the output before it
    full = client.completions.create(model="tiny", prompt="import os", max_tokens=16, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = full[len(full) // 2:len(full) // 2 + 3]
    if stop.strip():
        s = client.completions.create(model="tiny", prompt="import os", max_tokens=16, temperature=0, stop=[stop],
                                      extra_body={"ignore_eos": True}).choices[0]
        assert s.finish_reason == "stop" and stop not in s.text and full.startswith(s.text)
    sampled = [client.completions.create(model="tiny", prompt="import os", max_tokens=8, temperature=1.0, seed=7,
                                         extra_body={"top_k": 50, "min_p": 0.01, "repetition_penalty": 1.1,
                                                     "min_tokens": 2}).choices[0].text for _ in range(2)]
    assert sampled[0] == sampled[1]


# ------------------------------------------------------------------ concurrency, disconnects, metrics

def test_32_concurrent_streams(server):
    async def one(ac, i):
        n = 4 + i % 9
        body = {"model": "tiny", "prompt": f"# request {i}\ndef f{i}(x):", "max_tokens": n, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
                "return_token_ids": True}
        ids, usage, done = [], None, False
        async with ac.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line:
                    continue
                if line == "data: [DONE]":
                    done = True
                    continue
                obj = json.loads(line[6:])
                if obj["choices"]:
                    ids += obj["choices"][0].get("token_ids") or []
                if obj.get("usage"):
                    usage = obj["usage"]
        return n, ids, usage, done

    async def main():
        async with httpx.AsyncClient(base_url=server.url, headers=server.headers, timeout=120) as ac:
            return await asyncio.gather(*(one(ac, i) for i in range(32)))

    for n, ids, usage, done in asyncio.run(main()):
        assert done and len(ids) == n
        assert usage["completion_tokens"] == n and usage["total_tokens"] == usage["prompt_tokens"] + n


def test_n_choices_are_the_seeded_children(server, http):
    """n = 3: three choices by index, choice i the same as an n = 1 request seeded seed + i (vLLM's children); the
    usage counts the prompt once and every choice; the stream carries the same texts, by index, [DONE] once."""
    body = {"prompt": "def f(x):", "n": 3, "max_tokens": 6, "temperature": 1.0, "seed": 11, "ignore_eos": True}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    texts = [c["text"] for c in out["choices"]]
    assert [c["index"] for c in out["choices"]] == [0, 1, 2] and len(set(texts)) > 1, texts
    single = http.post("/v1/completions", json={**body, "n": 1, "seed": 12}).json()
    assert single["choices"][0]["text"] == texts[1]
    assert out["usage"]["completion_tokens"] == 18 and out["usage"]["prompt_tokens"] == \
        single["usage"]["prompt_tokens"]
    streamed, done, usage = ["", "", ""], 0, None
    with http.stream("POST", "/v1/completions", json={**body, "stream": True,
                                                      "stream_options": {"include_usage": True}}) as s:
        for line in s.iter_lines():
            if line == "data: [DONE]":
                done += 1
            elif line.startswith("data: "):
                chunk = json.loads(line[6:])
                for c in chunk["choices"]:
                    streamed[c["index"]] += c["text"]
                usage = chunk.get("usage") or usage
    assert streamed == texts and done == 1 and usage["completion_tokens"] == 18
    seen = [0, 0, 0]  # continuous usage: the chunk's own choice so far, as vLLM's
    # a loaded server may put two steps' tokens of a choice in one chunk: count its token ids, not its chunks
    with http.stream("POST", "/v1/completions", json={**body, "stream": True, "return_token_ids": True,
                                                      "stream_options": {"include_usage": True,
                                                                         "continuous_usage_stats": True}}) as s:
        for line in s.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                for c in chunk["choices"]:
                    seen[c["index"]] += len(c["token_ids"])
                    assert chunk["usage"]["completion_tokens"] == seen[c["index"]], (chunk, seen)
    assert seen == [6, 6, 6] and chunk["usage"]["completion_tokens"] == 18  # the last chunk: every choice
    chat = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "n": 2,
                                                   "max_tokens": 3, "temperature": 1.0, "seed": 5}).json()
    assert [c["index"] for c in chat["choices"]] == [0, 1] and all(c["message"]["role"] == "assistant"
                                                                   for c in chat["choices"])
    k = kv(http)
    assert k["used_blocks"] == 0 and k["invariants_ok"], k


def test_a_prompt_batch_is_one_request_per_prompt(server, http, llm):
    """A completions batch (vLLM's list of prompts, text and token ids mixed here) with n = 2: choice j * n + i is
    prompt j's child i, the same as that prompt sent alone with seed + i; greedy choices equal the offline engine;
    usage counts each prompt once; echo starts each choice with its own prompt; the stream carries the same texts
    by index and [DONE] once; a prompt too long is a 400 naming its index, and nothing of the batch runs."""
    prompts = ["def f(x):", [5, 6, 7, 8, 9], "class A:"]
    body = {"prompt": prompts, "n": 2, "max_tokens": 5, "temperature": 1.0, "seed": 3, "ignore_eos": True}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert [c["index"] for c in out["choices"]] == list(range(6))
    prompt_tokens = 0
    for j, p in enumerate(prompts):
        alone = http.post("/v1/completions", json={**body, "prompt": p, "n": 1, "seed": 4}).json()
        assert out["choices"][2 * j + 1]["text"] == alone["choices"][0]["text"], j
        prompt_tokens += alone["usage"]["prompt_tokens"]
    assert out["usage"]["prompt_tokens"] == prompt_tokens and out["usage"]["completion_tokens"] == 30
    greedy_body = {"prompt": PROMPTS, "max_tokens": 6, "temperature": 0.0, "echo": True}
    got = http.post("/v1/completions", json=greedy_body).json()["choices"]
    want = [o.outputs[0].text for o in llm.generate(PROMPTS, greedy(6))]
    assert [c["text"] for c in got] == [p + w for p, w in zip(PROMPTS, want)]
    streamed, done = [""] * len(PROMPTS), 0
    with http.stream("POST", "/v1/completions", json={**greedy_body, "stream": True}) as s:
        for line in s.iter_lines():
            if line == "data: [DONE]":
                done += 1
            elif line.startswith("data: "):
                for c in json.loads(line[6:])["choices"]:
                    streamed[c["index"]] += c["text"]
    assert streamed == [c["text"] for c in got] and done == 1
    waiting = total(metrics(http), "vllm:request_success_total")
    r = http.post("/v1/completions", json={**body, "prompt": ["x", [7] * MAX_MODEL_LEN]})
    assert r.status_code == 400 and "prompt[1] has 512 tokens" in r.json()["error"]["message"], r.text
    assert total(metrics(http), "vllm:request_success_total") == waiting
    k = kv(http)
    assert k["used_blocks"] == 0 and k["invariants_ok"], k


def test_logit_bias_steers_the_choice_as_offline(http, llm):
    """logit_bias (OpenAI's and vLLM's: string token ids, clamped to [-100, 100]): +100 on one token makes greedy
    pick it at every step; -100 on greedy's first pick makes it never picked, the output as the offline engine's
    with the same bias; logprobs stay those of the raw model (vLLM's default)."""
    body = {"prompt": PROMPTS[0], "max_tokens": 5, "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}
    first = http.post("/v1/completions", json=body).json()["choices"][0]["token_ids"][0]
    forced = http.post("/v1/completions", json={**body, "logit_bias": {"4321": 150}}).json()
    assert forced["choices"][0]["token_ids"] == [4321] * 5, forced
    banned = http.post("/v1/completions", json={**body, "logit_bias": {str(first): -100}, "logprobs": 1}).json()
    ids = banned["choices"][0]["token_ids"]
    want = llm.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True,
                                                     logit_bias={first: -100.0}))[0].outputs[0]
    assert first not in ids and ids == list(want.token_ids)
    top = banned["choices"][0]["logprobs"]["top_logprobs"][0]
    assert len(top) == 2  # the sampled token and the raw model's own top one, which the bias banned
    chat = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                                                   "temperature": 0.0, "logit_bias": {"77": 100},
                                                   "return_token_ids": True}).json()
    assert chat["choices"][0]["token_ids"] == [77] * 3, chat


def test_prompt_logprobs_and_echo_with_logprobs_as_vllm(http, llm):
    """prompt_logprobs: the choice's `prompt_logprobs` (null, then {id: {logprob, rank, decoded_token}} per prompt
    token) equal the offline engine's; echo with logprobs (lm-eval's loglikelihood request: a batch, max_tokens 1)
    leads the legacy logprobs with the prompt's tokens, the first without a logprob; streamed, the prompt and its
    logprobs come with the first token; chat answers them at the top level; a repeat is computed again, not cached."""
    prompt = PROMPTS[1]
    want = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=2))[0]
    n_prompt = len(want.prompt_token_ids)
    for _ in range(2):
        out = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2, "temperature": 0.0,
                                                 "prompt_logprobs": 2}).json()
        plp = out["choices"][0]["prompt_logprobs"]
        assert len(plp) == n_prompt and plp[0] is None and "prompt_tokens_details" not in out["usage"], out
        for k in range(1, n_prompt):
            tok = want.prompt_token_ids[k]
            got = plp[k][str(tok)]
            assert abs(got["logprob"] - want.prompt_logprobs[k][tok].logprob) < 1e-5
            assert got["rank"] == want.prompt_logprobs[k][tok].rank and len(plp[k]) in (2, 3)
            assert got["decoded_token"] == want.prompt_logprobs[k][tok].decoded_token
        assert out["choices"][0]["logprobs"] is None
    body = {"prompt": [prompt, PROMPTS[2]], "max_tokens": 1, "temperature": 0.0, "echo": True, "logprobs": 1}
    full = http.post("/v1/completions", json=body).json()["choices"]
    c = full[0]
    lp = c["logprobs"]
    assert c["text"].startswith(prompt) and len(lp["tokens"]) == n_prompt + 1 == len(lp["token_logprobs"])
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert "".join(lp["tokens"]) == c["text"] and lp["text_offset"][0] == 0
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(lp["tokens"]))]
    assert all(abs(lp["token_logprobs"][k] - want.prompt_logprobs[k][want.prompt_token_ids[k]].logprob) < 1e-5
               for k in range(1, n_prompt))
    assert full[1]["text"].startswith(PROMPTS[2]) and full[1]["logprobs"]["token_logprobs"][0] is None
    body3 = {**body, "prompt": prompt, "max_tokens": 3}
    whole = http.post("/v1/completions", json=body3).json()["choices"][0]
    chunks = []
    with http.stream("POST", "/v1/completions", json={**body3, "stream": True}) as st:
        for line in st.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:])["choices"][0])
    assert "".join(ch["text"] for ch in chunks) == whole["text"] and chunks[0]["text"].startswith(prompt)
    streamed = {k: [x for ch in chunks for x in ch["logprobs"][k]] for k in whole["logprobs"]}
    assert streamed == whole["logprobs"] and len(streamed["tokens"]) == n_prompt + 3  # offsets run on across chunks
    # max_tokens 0 with echo (scoring a text, as vLLM): the prompt and its logprobs alone, full or streamed
    only = {**body, "prompt": prompt, "max_tokens": 0, "return_token_ids": True}
    scored = http.post("/v1/completions", json=only).json()
    sc = scored["choices"][0]
    assert sc["text"] == prompt and sc["token_ids"] == [] and scored["usage"]["completion_tokens"] == 0
    assert sc["logprobs"]["tokens"] == lp["tokens"][:n_prompt] and sc["logprobs"]["token_logprobs"][0] is None
    with http.stream("POST", "/v1/completions", json={**only, "stream": True}) as st:
        events = [json.loads(x[6:])["choices"][0] for x in st.iter_lines() if x.startswith("data: {")]
    assert "".join(e["text"] for e in events) == prompt and [t for e in events for t in e["logprobs"]["tokens"]] \
        == sc["logprobs"]["tokens"]
    r = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 0})
    assert r.status_code == 400 and "0 only with echo" in r.json()["error"]["message"]
    # an explicit, larger prompt_logprobs: its own field has them all, the legacy shape `logprobs` + 1 at most
    wide = http.post("/v1/completions", json={**body, "prompt": prompt, "prompt_logprobs": 5}).json()["choices"][0]
    assert max(len(e) for e in wide["prompt_logprobs"][1:]) >= 5
    assert max(len(t) for t in wide["logprobs"]["top_logprobs"][1:]) <= 2
    ok = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2, "prompt_logprobs": 0, "stream": True})
    assert ok.status_code == 200 and ok.text.endswith("data: [DONE]\n\n")  # as vLLM: 0 streams (unsent)
    chat = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                                                   "prompt_logprobs": 0}).json()
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"] and chat["prompt_logprobs"][0] is None
    assert all(len(e) == 1 for e in chat["prompt_logprobs"][1:])  # 0: the prompt token's own only
    echo_chat = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                        "max_tokens": 1, "echo": True, "logprobs": True,
                                                        "top_logprobs": 2}).json()
    plp = echo_chat["prompt_logprobs"]  # as vLLM: chat echo scores the prompt with top_logprobs
    assert len(plp) == chat["usage"]["prompt_tokens"] and plp[0] is None and min(len(e) for e in plp[1:]) >= 2
    k = kv(http)
    assert k["used_blocks"] == 0 and k["invariants_ok"], k


def test_allowed_token_ids_truncation_and_vllm_defaults(http):
    """allowed_token_ids: every token sampled from them; truncate_prompt_tokens: the prompt's last k ids (first k
    with truncation_side right), as if sent so; cache_salt: a prompt hits the prefix cache under its own salt only;
    return_tokens_as_token_ids: vLLM's "token_id:<id>" in every logprobs shape (its offsets count them); bad_words:
    the word greedy would write next is not completed (a word of no token is a 400);
    vLLM's not-served fields at their defaults are accepted."""
    body = {"prompt": PROMPTS[0], "max_tokens": 6, "temperature": 1.0, "seed": 1, "ignore_eos": True,
            "return_token_ids": True}
    got = http.post("/v1/completions", json={**body, "allowed_token_ids": [77, 78, 4000]}).json()
    assert set(got["choices"][0]["token_ids"]) <= {77, 78, 4000}, got
    ids = got["choices"][0]["prompt_token_ids"]
    for side, part in (("left", ids[-3:]), ("right", ids[:3])):
        cut = http.post("/v1/completions", json={**body, "truncate_prompt_tokens": 3, "truncation_side": side,
                                                 "echo": True}).json()
        alone = http.post("/v1/completions", json={**body, "prompt": part}).json()
        assert cut["usage"]["prompt_tokens"] == 3 and cut["choices"][0]["prompt_token_ids"] == part
        assert cut["choices"][0]["token_ids"] == alone["choices"][0]["token_ids"]
        assert cut["choices"][0]["text"].endswith(alone["choices"][0]["text"])
    whole = http.post("/v1/completions", json={**body, "truncate_prompt_tokens": -1}).json()  # max_model_len
    assert whole["usage"]["prompt_tokens"] == len(ids)
    salted = {**body, "prompt": list(range(300, 400)), "temperature": 0.0}  # 6 full blocks of 16 to hit
    cached = [http.post("/v1/completions", json={**salted, **({"cache_salt": s} if s else {})}).json()["usage"].get(
        "prompt_tokens_details", {}).get("cached_tokens", 0) for s in ("s-1", "s-1", "s-2", None, None, "s-2")]
    assert cached[0] == cached[2] == cached[3] == 0 and cached[1] == cached[4] == cached[5] > 0, cached
    as_ids = http.post("/v1/completions", json={**body, "logprobs": 2, "echo": True, "max_tokens": 2,
                                                "return_tokens_as_token_ids": True}).json()["choices"][0]
    ids = as_ids["prompt_token_ids"] + as_ids["token_ids"]
    lp = as_ids["logprobs"]
    assert lp["tokens"] == [f"token_id:{t}" for t in ids] and lp["text_offset"][1] == len(f"token_id:{ids[0]}")
    assert all(k.startswith("token_id:") for top in lp["top_logprobs"][1:] for k in top)
    chat = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                                   "logprobs": True, "top_logprobs": 1, "return_token_ids": True,
                                                   "return_tokens_as_token_ids": True}).json()["choices"][0]
    assert [c["token"] for c in chat["logprobs"]["content"]] == [f"token_id:{t}" for t in chat["token_ids"]]
    texts = [bytes(c["bytes"]).decode(errors="replace") for c in chat["logprobs"]["content"]]
    assert "".join(texts) == chat["message"]["content"]  # the chosen token's bytes stay its text's, as vLLM's
    greedy = http.post("/v1/completions", json={**body, "temperature": 0.0}).json()["choices"][0]
    word = http.post("/detokenize", json={"tokens": greedy["token_ids"][1:3]}).json()["prompt"]
    steered = http.post("/v1/completions", json={**body, "temperature": 0.0, "bad_words": [word]}).json()
    got = steered["choices"][0]["token_ids"]
    assert got[:1] == greedy["token_ids"][:1] and got[1:3] != greedy["token_ids"][1:3], (word, got)
    r = http.post("/v1/completions", json={**body, "bad_words": ["   "]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "bad_words", r.text
    defaults = {"use_beam_search": False, "length_penalty": 1.0, "bad_words": [], "priority": 0,
                "structured_outputs": None, "return_tokens_as_token_ids": False}
    assert http.post("/v1/completions", json={**body, **defaults}).status_code == 200


def cut_stream(server, body: dict, after: int) -> None:
    """Read `after` SSE events, then close the connection mid-stream."""
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=30) as c:
        with c.stream("POST", "/v1/completions", json=body) as r:
            got = 0
            for line in r.iter_lines():
                got += line.startswith("data: ")
                if got >= after:
                    break


def wait_blocks_free(http, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        k = kv(http)
        if k["used_blocks"] == 0 or time.monotonic() > deadline:
            return k
        time.sleep(0.05)


@pytest.mark.parametrize("prompt", ["while True:", ["while True:", [5, 6, 7]]], ids=["one-prompt", "batch"])
@pytest.mark.parametrize("stream", [True, False])
def test_n_choices_client_gone_aborts_every_child(server, http, stream, prompt):
    n = 4 if isinstance(prompt, str) else 2
    body = {"prompt": prompt, "n": n, "max_tokens": 400, "ignore_eos": True, "stream": stream}
    aborts = total(metrics(http), "vllm:request_success_total", finished_reason="abort")
    if stream:
        cut_stream(server, body, after=6)
    else:
        with httpx.Client(base_url=server.url, headers=server.headers, timeout=httpx.Timeout(30, read=0.3)) as c:
            with pytest.raises(httpx.ReadTimeout):
                c.post("/v1/completions", json=body)
    k = wait_blocks_free(http)
    assert k["used_blocks"] == 0 and k["invariants_ok"], k
    assert total(metrics(http), "vllm:request_success_total", finished_reason="abort") == aborts + 4


def test_disconnect_mid_stream_frees_blocks(server, http):
    before = metrics(http)
    body = {"prompt": "while True:", "max_tokens": 400, "ignore_eos": True, "stream": True}
    cut_stream(server, body, after=3)
    k = wait_blocks_free(http)
    assert k["used_blocks"] == 0 and k["free_blocks"] == k["total_blocks"] and k["invariants_ok"], k
    after = metrics(http)
    assert total(after, "vllm:request_success_total", finished_reason="abort") == \
        total(before, "vllm:request_success_total", finished_reason="abort") + 1
    for name in ("vllm:request_prompt_tokens_count", "vllm:request_num_preemptions_count"):  # as vLLM: no aborts
        assert total(after, name) == total(before, name), name
    assert total(after, "vllm:num_requests_running") == 0


def test_metrics_move(client, http):
    before = metrics(http)
    client.completions.create(model="tiny", prompt="def g(y):", max_tokens=7, temperature=0,
                              extra_body={"ignore_eos": True})
    after = metrics(http)

    def delta(name, **labels):
        return total(after, name, **labels) - total(before, name, **labels)

    assert delta("vllm:generation_tokens_total") == 7
    assert delta("vllm:prompt_tokens_total") > 0
    assert delta("vllm:request_success_total", finished_reason="length") == 1
    assert delta("vllm:time_to_first_token_seconds_count") == 1
    assert delta("vllm:inter_token_latency_seconds_count") == 6
    assert delta("vllm:e2e_request_latency_seconds_count") == 1
    assert delta("vllm:request_time_per_output_token_seconds_count") == 1
    assert delta("pdserve_cudagraph_steps_total") >= 7
    assert delta("pdserve_cudagraph_steps_total", mode="FULL", reason="none") >= 5
    assert total(after, "pdserve_cudagraph_info", device="cpu", captured="false") == 1
    for name in ("vllm:request_queue_time_seconds_count", "vllm:request_prefill_time_seconds_count",
                 "vllm:request_decode_time_seconds_count", "vllm:request_inference_time_seconds_count"):
        assert delta(name) == 1, name
    assert delta("vllm:prefix_cache_queries_total") >= delta("vllm:prompt_tokens_total")
    src = {s: delta("vllm:prompt_tokens_by_source_total", source=s)
           for s in ("local_compute", "local_cache_hit", "external_kv_transfer")}
    assert sum(src.values()) == delta("vllm:prompt_tokens_total") and src["external_kv_transfer"] == 0, src
    assert delta("vllm:prompt_tokens_cached_total") == src["local_cache_hit"]
    assert not any(n.startswith("vllm:external_prefix_cache") for n, _ in after)  # no KV connector here
    assert delta("vllm:request_prompt_tokens_count") == 1
    assert delta("vllm:request_prompt_tokens_sum") == delta("vllm:prompt_tokens_total")
    assert delta("vllm:request_generation_tokens_sum") == 7 and delta("vllm:request_params_max_tokens_sum") == 7
    # vLLM's 1-2-5 token buckets up to max_model_len (the fixture's 512): a 7-token answer lands in le=10
    assert total(after, "process_resident_memory_bytes") > 0 and any(n == "python_info" for n, _ in after)
    info = [dict(lab) for n, lab in after if n == "vllm:cache_config_info"]
    assert len(info) == 1 and info[0]["block_size"] == "16" and info[0]["num_gpu_blocks"] == "512", info
    assert info[0]["enable_prefix_caching"] == "True" and info[0]["engine"] == "0"
    les = sorted(float(dict(lab)["le"]) for n, lab in after if n == "vllm:request_generation_tokens_bucket")
    assert les == [1, 2, 5, 10, 20, 50, 100, 200, 500, float("inf")], les
    assert delta("vllm:request_generation_tokens_bucket", le="10.0") == 1
    assert delta("vllm:request_generation_tokens_bucket", le="5.0") == 0
    computed = delta("vllm:prompt_tokens_total") - delta("vllm:prompt_tokens_cached_total")
    assert delta("vllm:request_prefill_kv_computed_tokens_sum") == computed
    # one step finished the prefill with the first token, six more gave one token each
    assert delta("vllm:iteration_tokens_total_count") == 7 and delta("vllm:iteration_tokens_total_sum") == computed + 7
    assert delta("vllm:iteration_tokens_total_bucket", le="1.0") == 6
    assert delta("vllm:request_num_preemptions_count") == 1 and delta("vllm:request_num_preemptions_bucket",
                                                                         le="1.0") == 1
    for name in ("vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "vllm:num_preemptions_total",
                 "vllm:prefix_cache_hits_total", "pdserve_cudagraph_padded_tokens_total"):
        assert any(n == name for n, _ in after), name
    # vLLM's names and labels: dashboards and autoscalers built for vLLM select on model_name and engine
    for (n, lab) in after:
        if n.startswith(("vllm:", "pdserve_cudagraph")) and n != "vllm:cache_config_info":  # vLLM's has none
            assert dict(lab).get("model_name") == "tiny" and dict(lab).get("engine") == "0", (n, lab)


def test_unset_max_tokens_is_observed_as_what_the_context_leaves(server, http):
    """A chat request without max_tokens is observed with what the context leaves, as vLLM's server sets it (a
    completion's default is 16, as OpenAI's)."""
    before = metrics(http)
    body = {"messages": [{"role": "user", "content": "hi"}], "temperature": 0,
            "allowed_token_ids": [77], "stop_token_ids": [77]}  # stops at its first token
    r = httpx.post(server.url + "/v1/chat/completions", json=body, headers=server.headers, timeout=30)
    assert r.status_code == 200, r.text
    n_prompt = r.json()["usage"]["prompt_tokens"]
    after = metrics(http)
    assert total(after, "vllm:request_params_max_tokens_count") - \
        total(before, "vllm:request_params_max_tokens_count") == 1
    assert total(after, "vllm:request_params_max_tokens_sum") - \
        total(before, "vllm:request_params_max_tokens_sum") == MAX_MODEL_LEN - n_prompt


def test_prefix_cache_hits_are_counted(client, http):
    prompt = "def add(a, b):\n    return a + b\n" * 6  # several full blocks
    before = metrics(http)
    for _ in range(2):
        client.completions.create(model="tiny", prompt=prompt, max_tokens=1, temperature=0)
    after = metrics(http)
    hits = total(after, "vllm:prefix_cache_hits_total") - total(before, "vllm:prefix_cache_hits_total")
    queries = total(after, "vllm:prefix_cache_queries_total") - total(before, "vllm:prefix_cache_queries_total")
    assert 0 < hits < queries, (hits, queries)  # the second request hit the first one's full blocks
    local = total(after, "vllm:prompt_tokens_by_source_total", source="local_cache_hit") - \
        total(before, "vllm:prompt_tokens_by_source_total", source="local_cache_hit")
    assert local == hits


def test_request_id_echoed_and_logged(server, http):
    r = http.post("/v1/completions", json={"prompt": "a", "max_tokens": 2}, headers={"X-Request-Id": "rid-xyz-42"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "rid-xyz-42"
    assert r.json()["id"] == "cmpl-rid-xyz-42"
    r2 = http.post("/v1/completions", json={"prompt": "a", "max_tokens": 2})
    assert len(r2.headers["x-request-id"]) >= 16

    async def same_id_twice():  # a request id already in flight still works: the engine gets a unique one
        async with httpx.AsyncClient(base_url=server.url, headers=server.headers, timeout=60) as ac:
            return await asyncio.gather(*(ac.post("/v1/completions", headers={"X-Request-Id": "dup-id"},
                                                  json={"prompt": "b", "max_tokens": 8, "ignore_eos": True})
                                          for _ in range(2)))

    rs = asyncio.run(same_id_twice())
    assert [r.status_code for r in rs] == [200, 200] and all(r.headers["x-request-id"] == "dup-id" for r in rs)
    assert len({r.json()["id"] for r in rs}) == 2
    time.sleep(0.2)
    lines = [ln for ln in server.log().splitlines() if "[rid-xyz-42]" in ln]
    assert any("completion request" in ln for ln in lines) and any("POST /v1/completions 200" in ln for ln in lines)


# ------------------------------------------------------------------ errors

LONG_IDS = list(range(10, 110))  # 100 prompt tokens
ERROR_CASES = [
    # (id, path, body (bytes: sent raw), status, words the message must contain, param)
    ("bad-json", "/v1/completions", b'{"prompt": "x",', 400, ["not valid JSON"], None),
    ("not-object", "/v1/completions", b'["prompt"]', 400, ["JSON object"], None),
    ("wrong-type", "/v1/completions", {"prompt": "x", "max_tokens": "ten"}, 400, ["max_tokens", "integer"],
     "max_tokens"),
    ("wrong-type-bool", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stream": "yes"},
     400, ["stream"], "stream"),
    ("float-for-int", "/v1/completions", {"prompt": "x", "seed": 1.5}, 400, ["seed"], "seed"),
    ("out-of-range-logprobs", "/v1/completions", {"prompt": "x", "logprobs": 50}, 400, ["logprobs", "20"],
     "logprobs"),
    ("out-of-range-top-logprobs", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 99}, 400, ["top_logprobs"],
     "top_logprobs"),
    ("top-logprobs-alone", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}, 400, ["top_logprobs", "logprobs"],
     "top_logprobs"),
    ("temperature", "/v1/completions", {"prompt": "x", "temperature": -1}, 400, ["temperature"], "temperature"),
    ("temperature-infinity", "/v1/completions", b'{"prompt": "x", "temperature": Infinity}', 400,
     ["temperature", "finite"], "temperature"),
    ("top_p", "/v1/completions", {"prompt": "x", "top_p": 1.5}, 400, ["top_p"], "top_p"),
    ("min_p", "/v1/completions", {"prompt": "x", "min_p": 2}, 400, ["min_p"], "min_p"),
    ("rep-penalty", "/v1/completions", {"prompt": "x", "repetition_penalty": 0}, 400, ["repetition_penalty"],
     "repetition_penalty"),
    ("max_tokens-zero", "/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, ["max_tokens"], "max_tokens"),
    ("n", "/v1/completions", {"prompt": "x", "n": 0}, 400, ["n must be at least 1"], "n"),
    ("n-over-seqs", "/v1/completions", {"prompt": "x", "n": 65}, 400, ["n: 65 choices", "--max-num-seqs 64"], "n"),
    ("n-over-queue", "/v1/completions", {"prompt": "x", "n": 100000}, 400, ["n: 100000", "--max-num-seqs"], "n"),
    ("batch-over-queue", "/v1/completions", {"prompt": ["x"] * 20, "n": 60}, 400,
     ["20 prompts x n = 60 (1200 requests)", "--max-waiting"], "prompt"),
    ("batch-over-queue-alone", "/v1/completions", {"prompt": ["x"] * 1025}, 400,
     ["batch of 1025 prompts", "--max-waiting 1024"], "prompt"),
    ("token-out-of-vocab", "/v1/completions", {"prompt": [1, 2, 999999]}, 400, ["999999", "vocabulary"], "prompt"),
    ("logit-bias-key", "/v1/completions", {"prompt": "x", "logit_bias": {"abc": 1}}, 400, ["logit_bias", "'abc'"],
     "logit_bias"),
    ("logit-bias-value", "/v1/completions", {"prompt": "x", "logit_bias": {"5": "high"}}, 400,
     ["logit_bias (token 5)", "finite number"], "logit_bias"),
    ("logit-bias-out-of-vocab", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "logit_bias": {"999999": 1}}, 400, ["999999", "vocabulary"],
     "logit_bias"),
    ("logit-bias-not-object", "/v1/completions", {"prompt": "x", "logit_bias": [1]}, 400, ["logit_bias"],
     "logit_bias"),
    ("cache-salt-empty", "/v1/completions", {"prompt": "x", "cache_salt": ""}, 400, ["cache_salt"], "cache_salt"),
    ("allowed-empty", "/v1/completions", {"prompt": "x", "allowed_token_ids": []}, 400, ["allowed_token_ids"],
     "allowed_token_ids"),
    ("allowed-out-of-vocab", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "allowed_token_ids": [5, 999999]}, 400,
     ["999999", "vocabulary"], "allowed_token_ids"),
    ("truncate-zero", "/v1/completions", {"prompt": "x", "truncate_prompt_tokens": 0}, 400,
     ["truncate_prompt_tokens"], "truncate_prompt_tokens"),
    ("truncate-below", "/v1/completions", {"prompt": "x", "truncate_prompt_tokens": -2}, 400,
     ["truncate_prompt_tokens"], "truncate_prompt_tokens"),
    ("truncation-side", "/v1/completions", {"prompt": "x", "truncation_side": "middle"}, 400, ["truncation_side"],
     "truncation_side"),
    # vLLM's fields that change the answer and are not served: refused, never quietly dropped
    ("beam-search", "/v1/completions", {"prompt": "x", "use_beam_search": True}, 400, ["use_beam_search"],
     "use_beam_search"),
    ("bad-words", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "bad_words": "a"}, 400,
     ["bad_words"], "bad_words"),
    ("structured-outputs", "/v1/completions", {"prompt": "x", "structured_outputs": {"regex": "a+"}}, 400,
     ["structured_outputs"], "structured_outputs"),
    ("guided-json", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "guided_json": {}}, 400,
     ["guided_json"], "guided_json"),
    ("priority", "/v1/completions", {"prompt": "x", "priority": 3}, 400, ["priority"], "priority"),
    ("functions", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                           "functions": [{"name": "f", "parameters": {}}]}, 400, ["functions"],
     "functions"),
    ("chat-template", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ messages }}"}, 400, ["chat_template"],
     "chat_template"),
    ("json-completions", "/v1/completions", {"prompt": "x", "response_format": {"type": "json_object"}}, 400,
     ["response_format"], "response_format"),
    ("token-negative", "/v1/completions", {"prompt": [5, -1]}, 400, ["-1", "vocabulary"], "prompt"),
    ("kv-transfer-params", "/v1/completions", {"prompt": "x", "kv_transfer_params": {"do_remote_decode": True}}, 400,
     ["kv_transfer_params", "connector"], "kv_transfer_params"),
    ("unknown-model", "/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404, ["gpt-4", "does not exist"],
     "model"),
    ("over-context", "/v1/completions", {"prompt": LONG_IDS, "max_tokens": 450}, 400,
     ["100", "450", str(MAX_MODEL_LEN)], "max_tokens"),
    ("over-context-chat", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 600}, 400,
     ["600", str(MAX_MODEL_LEN)], "max_completion_tokens"),
    ("prompt-too-long", "/v1/completions", {"prompt": list(range(5, 600))}, 400, ["595", str(MAX_MODEL_LEN)],
     "prompt"),
    ("empty-prompt", "/v1/completions", {"prompt": ""}, 400, ["empty"], "prompt"),
    ("no-messages", "/v1/chat/completions", {"model": "tiny"}, 400, ["messages"], "messages"),
    ("bad-message", "/v1/chat/completions", {"messages": [{"content": "x"}]}, 400, ["messages[0]"], "messages[0]"),
    ("no-content", "/v1/chat/completions", {"messages": [{"role": "user"}]}, 400, ["messages[0].content"],
     "messages[0].content"),
    ("null-content", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": None}]}, 400,
     ["messages[1].content"], "messages[1].content"),
    ("number-content", "/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400,
     ["messages[0].content"], "messages[0].content"),
    ("image-part", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400,
     ["text"], "messages[0].content"),
    ("tools", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                       "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, ["tool"],
     "tools"),
    ("oversized-body", "/v1/completions", {"prompt": "x" * 70000}, 413, ["65536"], None),
    # each of these below failed the whole engine step (and every request in it) or answered 500
    ("seed-over-64-bit", "/v1/completions", {"prompt": "x", "seed": 2 ** 64}, 400, ["seed", "64-bit"], "seed"),
    ("seed-under-64-bit", "/v1/completions", {"prompt": "x", "seed": -2 ** 63 - 1}, 400, ["seed"], "seed"),
    ("stop-id-out-of-vocab", "/v1/completions", {"prompt": "x", "stop_token_ids": [100000], "min_tokens": 2}, 400,
     ["100000", "vocabulary"], "stop_token_ids"),
    ("stop-id-huge", "/v1/completions", {"prompt": "x", "stop_token_ids": [2 ** 70]}, 400, ["vocabulary"],
     "stop_token_ids"),
    ("lone-surrogate-prompt", "/v1/completions", b'{"prompt": "a\\ud800b"}', 400, ["surrogate"], None),
    ("lone-surrogate-model", "/v1/completions", b'{"prompt": "a", "model": "\\udfff"}', 400, ["surrogate"], None),
    ("lone-surrogate-chat", "/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": "\\ud800"}]}', 400, ["surrogate"], None),
    ("deeply-nested", "/v1/completions", b'{"prompt": "x", "x": ' + b"[" * 30000 + b"]" * 30000 + b"}", 400,
     ["nested"], None),
]


@pytest.mark.parametrize("case", ERROR_CASES, ids=[c[0] for c in ERROR_CASES])
def test_error_cases(server, http, case):
    _, path, body, status, words, param = case
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = http.post(path, timeout=10, headers={"Content-Type": "application/json"}, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "code"} and err["code"] == status
    for w in words:
        assert w in err["message"], (w, err["message"])
    if param is not None:
        assert err["param"] == param
    assert "Traceback" not in r.text and r.headers.get("x-request-id")


def test_auth_routes_and_unknown_fields(server, http):
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "x"}, timeout=10)
    assert r.status_code == 401 and r.json()["error"]["code"] == 401
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "x"}, timeout=10,
                   headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200  # not behind the key
    # the KV pool's state is the node's: behind the key like the API (it was open to anyone)
    assert httpx.get(server.url + "/debug/kv", timeout=10).status_code == 401
    assert httpx.get(server.url + "/debug/kv", headers={"Authorization": "Bearer wrong"}, timeout=10).status_code == 401
    # a right key that is one byte longer or shorter is still wrong (the comparison is of the whole header)
    for bad in (f"Bearer {API_KEY}x", f"Bearer {API_KEY[:-1]}"):
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "x"}, timeout=10, headers={"Authorization": bad})
        assert r.status_code == 401
    for method, path, status in (("GET", "/nope", 404), ("GET", "/v1/completions", 405)):
        r = http.request(method, path, timeout=10)
        assert r.status_code == status and r.json()["error"]["code"] == status
    r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "frobnicate": 1, "zzz_extra": "a"},
                  headers={"X-Request-Id": "rid-unknown-fields"}, timeout=30)
    assert r.status_code == 200
    time.sleep(0.2)
    assert any("[rid-unknown-fields]" in ln and "frobnicate, zzz_extra" in ln for ln in server.log().splitlines())


def test_bad_request_does_not_disturb_others(server, http):
    async def main():
        async with httpx.AsyncClient(base_url=server.url, headers=server.headers, timeout=60) as ac:
            good = [ac.post("/v1/completions", json={"prompt": f"x{i}", "max_tokens": 6, "ignore_eos": True})
                    for i in range(4)]
            bad = [ac.post("/v1/completions", json={"prompt": [999999]}),
                   ac.post("/v1/completions", content=b"{oops")]
            return await asyncio.gather(*good, *bad)

    rs = asyncio.run(main())
    assert [r.status_code for r in rs] == [200] * 4 + [400, 400]
    assert all(r.json()["usage"]["completion_tokens"] == 6 for r in rs[:4])
    assert kv(http)["invariants_ok"]


def test_token_count_buckets_stop_at_max_model_len():
    from pdserve.serve.metrics import _1_2_5
    assert _1_2_5(1) == [1.0] and _1_2_5(4) == [1.0, 2.0]
    assert _1_2_5(100) == [1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0] and _1_2_5(199)[-1] == 100.0


def test_hostile_lists_and_templates_are_400s_naming_the_field(server, http):
    """Lists every token or step of a request would walk, past their caps, and a request's own chat template
    (through chat_template_kwargs), are refused with a 400 naming the field, quickly, and the node serves on."""
    body = {"prompt": PROMPTS[0], "max_tokens": 2}
    for field, value in (("stop", [f"s{i}" for i in range(5000)]),  # (the body limit here is 64 KiB)
                         ("stop_token_ids", list(range(5, 5 + 5000))),
                         ("logit_bias", {str(i): 1.0 for i in range(1025)})):
        t = time.monotonic()
        r = http.post("/v1/completions", json={**body, field: value}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (field, r.text[:300])
        assert time.monotonic() - t < 5, field
    hostile = "{% for x in range(10**9) %}{% for y in range(10**9) %}{% endfor %}{% endfor %}"
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                                "chat_template_kwargs": {"chat_template": hostile}}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs", r.text
    ok = http.post("/v1/completions", json={**body, "stop": [f"s{i}" for i in range(128)],
                                            "logit_bias": {str(i): 0.5 for i in range(1024)}}, timeout=30)
    assert ok.status_code == 200, ok.text
