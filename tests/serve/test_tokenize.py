"""POST /tokenize and /detokenize (serve/tokenize.py), in process through starlette's TestClient: the ids are the ones
the generation routes count (text and chat), add_special_tokens and return_token_strs do what they say, detokenize
inverts tokenize, and every refusal is the server's usual one (400 naming the field, 404, 401, 503).

The model is qwen3_tiny with a tokenizer that adds a BOS, as Llama's does: the tiny tokenizer adds nothing, and
with it add_special_tokens would change nothing a test could see."""
from __future__ import annotations

import shutil

import pytest
from starlette.testclient import TestClient

from pdserve.config import EngineConfig
from pdserve.serve.api_server import ServerState, build_app
from pdserve.serve.server_config import ServerConfig
from tests.serve.test_failure_paths_serving import server

KEY = "sk-tokenize-test"
BOS = "<|endoftext|>"
TEXTS = ["def fibonacci(n):\n    return n", "héllo wörld, ça va? — «ünïcode» ✓", "日本語のテキスト 🙂 ok",
         "<|im_start|>user\nhi<|im_end|>\n", "  two  spaces\tand a tab "]
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "héllo there"},
        {"role": "assistant", "content": "Hi, I"}]


@pytest.fixture(scope="module")
def bos_model(qwen3_tiny, tmp_path_factory):
    from tokenizers import Tokenizer, processors
    d = tmp_path_factory.mktemp("tok") / "tiny-bos"
    shutil.copytree(qwen3_tiny, d)
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A $B",
                                                       special_tokens=[(BOS, tok.token_to_id(BOS))])
    tok.save(str(d / "tokenizer.json"))
    return str(d)


@pytest.fixture(scope="module")
def hf_tok(bos_model):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(bos_model)


@pytest.fixture(scope="module")
def c(bos_model):
    with server(bos_model, api_key=KEY) as client:
        client.headers["Authorization"] = f"Bearer {KEY}"
        yield client


def ok(c, route, body) -> dict:
    r = c.post(route, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def refused(c, route, body, status=400, **kw):
    r = c.post(route, json=body, **kw) if not isinstance(body, bytes) else c.post(route, content=body, **kw)
    assert r.status_code == status, r.text
    assert "Traceback" not in r.text
    err = r.json()["error"]
    assert err["code"] == status
    return err


def test_text_form_counts_and_ids_as_completions(c, hf_tok):
    bos = hf_tok.convert_tokens_to_ids(BOS)
    for text in TEXTS:
        tok = ok(c, "/tokenize", {"prompt": text})
        assert set(tok) == {"count", "max_model_len", "tokens", "token_strs"}
        assert tok["max_model_len"] == 53 and tok["token_strs"] is None
        assert tok["tokens"][0] == bos and tok["count"] == len(tok["tokens"]) > 1
        comp = ok(c, "/v1/completions", {"prompt": text, "max_tokens": 1, "return_token_ids": True})
        assert tok["count"] == comp["usage"]["prompt_tokens"]
        assert tok["tokens"] == comp["choices"][0]["prompt_token_ids"]


@pytest.mark.parametrize("flags", [{}, {"add_generation_prompt": False}, {"continue_final_message": True},
                                   {"chat_template_kwargs": {"enable_thinking": False}}])
def test_chat_form_counts_and_ids_as_chat_completions(c, flags):
    tok = ok(c, "/tokenize", {"messages": CHAT, **flags})
    chat = ok(c, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 1, "return_token_ids": True, **flags})
    assert tok["count"] == chat["usage"]["prompt_tokens"] == len(tok["tokens"])
    assert tok["tokens"] == chat["prompt_token_ids"]


def test_generation_prompt_and_final_message_flags_change_the_ids(c, hf_tok):
    default = ok(c, "/tokenize", {"messages": CHAT})["tokens"]
    bare = ok(c, "/tokenize", {"messages": CHAT, "add_generation_prompt": False})["tokens"]
    cont = ok(c, "/tokenize", {"messages": CHAT, "continue_final_message": True})["tokens"]
    assert hf_tok.decode(default).endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert default[:len(bare)] == bare and len(default) > len(bare)
    assert hf_tok.decode(cont).endswith("<|im_start|>assistant\nHi, I")


def test_add_special_tokens(c, hf_tok):
    bos = hf_tok.convert_tokens_to_ids(BOS)
    text = TEXTS[1]
    with_bos = ok(c, "/tokenize", {"prompt": text, "add_special_tokens": True})["tokens"]
    assert with_bos == ok(c, "/tokenize", {"prompt": text})["tokens"]  # true is the text form's default
    without = ok(c, "/tokenize", {"prompt": text, "add_special_tokens": False})["tokens"]
    assert with_bos == [bos] + without and bos not in without
    chat = ok(c, "/tokenize", {"messages": CHAT})["tokens"]  # false is the chat form's default
    assert chat == ok(c, "/tokenize", {"messages": CHAT, "add_special_tokens": False})["tokens"]
    assert ok(c, "/tokenize", {"messages": CHAT, "add_special_tokens": True})["tokens"] == [bos] + chat
    assert bos not in chat


def test_return_token_strs(c, hf_tok):
    for body in ({"prompt": TEXTS[1]}, {"messages": CHAT}):
        tok = ok(c, "/tokenize", {**body, "return_token_strs": True})
        assert tok["token_strs"] == hf_tok.convert_ids_to_tokens(tok["tokens"])
        assert len(tok["token_strs"]) == tok["count"] and all(isinstance(s, str) for s in tok["token_strs"])
        assert ok(c, "/tokenize", {**body, "return_token_strs": False})["token_strs"] is None
    assert ok(c, "/tokenize", {"prompt": "hello world", "return_token_strs": True})["token_strs"][0] == BOS


def test_detokenize_inverts_tokenize(c):
    for text in TEXTS:
        ids = ok(c, "/tokenize", {"prompt": text, "add_special_tokens": False})["tokens"]
        assert ok(c, "/detokenize", {"tokens": ids}) == {"prompt": text}
        ids = ok(c, "/tokenize", {"prompt": text})["tokens"]
        assert ok(c, "/detokenize", {"tokens": ids})["prompt"] == BOS + text  # special tokens are kept
    assert ok(c, "/detokenize", {"tokens": []}) == {"prompt": ""}
    assert ok(c, "/detokenize", {"model": "tiny-bos", "tokens": [100]})["prompt"]


MSG = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("route,body,param", [
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"prompt": ["a"]}, "prompt"),
    ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, "add_special_tokens"),
    ("/tokenize", {"prompt": "x", "return_token_strs": 1}, "return_token_strs"),
    ("/tokenize", {"prompt": "x", "model": 3}, "model"),
    ("/tokenize", {"messages": "hi"}, "messages"),
    ("/tokenize", {"messages": []}, "messages"),
    ("/tokenize", {"messages": [{"role": "user", "content": 7}]}, "messages[0].content"),
    ("/tokenize", {"messages": MSG, "add_generation_prompt": 1}, "add_generation_prompt"),
    ("/tokenize", {"messages": MSG, "add_special_tokens": None}, "add_special_tokens"),
    ("/tokenize", {"messages": MSG, "chat_template_kwargs": []}, "chat_template_kwargs"),
    ("/tokenize", {"messages": MSG, "continue_final_message": True, "add_generation_prompt": True},
     "continue_final_message"),
    ("/tokenize", {"messages": MSG, "chat_template": "{{ messages }}"}, "chat_template"),
    ("/tokenize", {"messages": MSG, "tools": [{"type": "function"}]}, "tools"),
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"model": "tiny-bos", "add_special_tokens": True}, "prompt"),
    ("/tokenize", {"prompt": "x", "messages": MSG}, "messages"),
    ("/tokenize", b"{not json", None),
    ("/tokenize", b"[1, 2]", None),
    ("/detokenize", {}, "tokens"),
    ("/detokenize", {"tokens": "1 2"}, "tokens"),
    ("/detokenize", {"tokens": [1, "2"]}, "tokens.1"),
    ("/detokenize", {"tokens": [1, 2.0]}, "tokens.1"),
    ("/detokenize", {"tokens": [True]}, "tokens.0"),
    ("/detokenize", {"tokens": [1, -1]}, "tokens"),
    ("/detokenize", {"tokens": [8192]}, "tokens"),
    ("/detokenize", {"tokens": [1, 2 ** 70]}, "tokens"),
])
def test_bad_requests_are_400s_naming_the_field(c, route, body, param):
    err = refused(c, route, body)
    assert err["param"] == param, err


def test_ids_outside_the_vocabulary(c):
    err = refused(c, "/detokenize", {"tokens": [5, 8192, 6]})
    assert err["param"] == "tokens" and "8192" in err["message"] and "vocabulary" in err["message"]
    assert ok(c, "/detokenize", {"tokens": [8191]})  # the last id is in


def test_both_chat_flags_only_when_the_client_set_both(c):
    err = refused(c, "/tokenize", {"messages": CHAT, "continue_final_message": True, "add_generation_prompt": True})
    assert "continue_final_message" in err["message"] and "add_generation_prompt" in err["message"]
    ok(c, "/tokenize", {"messages": CHAT, "continue_final_message": True, "add_generation_prompt": False})


@pytest.mark.parametrize("route,body", [("/tokenize", {"prompt": "x"}), ("/tokenize", {"messages": MSG}),
                                        ("/detokenize", {"tokens": [1]})])
def test_unknown_model_is_404_and_the_served_name_is_taken(c, route, body):
    err = refused(c, route, {**body, "model": "gpt-4"}, 404)
    assert err["param"] == "model" and "gpt-4" in err["message"]
    ok(c, route, {**body, "model": "tiny-bos"})


@pytest.mark.parametrize("route,body", [("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})])
def test_api_key(c, route, body):
    refused(c, route, body, 401, headers={"Authorization": "Bearer wrong"})
    r = c.post(route, json=body, headers={"Authorization": ""})
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    refused(c, route, b"{not json", 401, headers={"Authorization": "Bearer wrong"})  # the key is checked first


def test_503_until_the_engine_is_up(bos_model):
    state = ServerState(EngineConfig.from_kwargs(bos_model, block_size=4, max_model_len=53),
                        ServerConfig(engine_backend="thread"))
    client = TestClient(build_app(state))  # no lifespan: the engine is never started
    for route, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})):
        err = refused(client, route, body, 503)
        assert "starting" in err["message"]
    refused(client, "/tokenize", b"{not json", 503)  # before the body is read, as the generation routes
