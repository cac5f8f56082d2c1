"""Bad input the suite never sent: each is refused with a 400 naming the field (OpenAI-shaped, no traceback), the
engine never sees it, and the server goes on serving with its KV pool whole. In process (TestClient)."""
from __future__ import annotations

import json

import pytest

from tests.serve.test_failure_paths_serving import BODY, pool_whole, server

CASES = [
    ("completions", {"prompt": [5, "x"]}, "token ids must be integers"),
    ("completions", {"prompt": [[5, 6], [7, "x"]]}, "prompt[1]: token ids must be integers"),
    ("completions", {"prompt": ["ab", 7]}, "prompt[1]: must be a string or a list of token ids"),
    ("completions", {"prompt": [[5, 6], []]}, "prompt[1] is empty"),
    ("completions", {"best_of": 2}, "best_of: only 1 is supported"),
    ("completions", {"stream_options": {"include_usage": True}}, "stream_options: only allowed when stream is true"),
    ("chat/completions", {"response_format": {"type": "json_object"}}, "response_format: only type 'text'"),
    ("completions", {"prompt_logprobs": 21}, "prompt_logprobs must be in [0, 20]"),
    ("chat/completions", {"prompt_logprobs": -1}, "prompt_logprobs must be in [0, 20]"),
    ("completions", {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs: not available when stream is true"),
    ("completions", {"prompt_logprobs": "2"}, "prompt_logprobs"),
    ("chat/completions", {"echo": "sometimes"}, "echo"),  # was never read as a field: any value turned it on
]


@pytest.fixture(scope="module")
def client(qwen3_tiny):
    with server(qwen3_tiny) as c:
        yield c


@pytest.mark.parametrize("kind,fields,why", CASES, ids=[c[2].split(":")[0][:24] for c in CASES])
def test_bad_input_is_a_clear_400(client, kind, fields, why):
    body = {**BODY, **fields}
    if kind == "chat/completions":
        body = {k: v for k, v in body.items() if k != "prompt"} | {"messages": [{"role": "user", "content": "hi"}]}
    r = client.post(f"/v1/{kind}", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == 400 and why in err["message"] and "Traceback" not in r.text
    pool_whole(client)
    r = client.post("/v1/completions", json=BODY)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == BODY["max_tokens"]


def test_serve_refuses_a_model_whose_generation_config_is_invalid(qwen3_tiny, tmp_path):
    """The model's defaults apply to every request that does not set them: a bad one is the deployment's mistake,
    refused at start-up naming the file, not a 400 blaming each client's top_p. (A subprocess with a timeout: a
    server that did start would otherwise serve on.)"""
    import shutil
    import subprocess
    import sys
    model = tmp_path / "model"
    shutil.copytree(qwen3_tiny, model)
    cfg = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**cfg, "top_p": 0.0}))
    p = subprocess.run([sys.executable, "-m", "pdserve.cli", "serve", str(model), "--port", "0"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2, p.stderr[-2000:]
    assert "pdserve serve: error:" in p.stderr and "generation_config.json" in p.stderr and "top_p" in p.stderr
