"""Speculative decoding through the server and the CLI: a request with logprobs, penalties and stop strings (streamed
and not) answers as the plain engine does; /metrics carries vLLM's spec-decode series; `bench serve` reports the
acceptance; every bad --speculative-config value is a CLI error naming the field, for serve, generate, bench pd."""
from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

from pdserve import LLM, SamplingParams
from tests.server_harness import REPO, ServerProcess, healthy, metric, metrics
from tests.spec_decode.test_spec_decode import spec

PROMPT = "x = 1\ny = 2\nx = 1\ny = 2\nx = 1\ny ="
SPEC = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}'


@pytest.fixture(scope="module")
def server(qwen3_tiny):
    srv = ServerProcess(qwen3_tiny, "--max-model-len", "256", "--num-gpu-blocks-override", "128",
                        "--served-model-name", "x", "--speculative-config", SPEC)
    with healthy(srv):
        yield srv


@pytest.fixture(scope="module")
def plain(qwen3_tiny):
    return LLM(qwen3_tiny, max_model_len=256)


def post(server, body):
    r = httpx.post(server.url + "/v1/completions", json={"model": "x", "prompt": PROMPT, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_penalties_and_stop_strings_as_plain(server, plain, stream):
    ref0 = plain.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)[0].outputs[0]
    stop = plain.get_tokenizer().decode(ref0.token_ids[5:7])
    body = dict(max_tokens=24, temperature=0.0, logprobs=2, frequency_penalty=0.5, repetition_penalty=1.2,
                stop=[stop])
    ref = plain.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=24, logprobs=2, frequency_penalty=0.5,
                                                  repetition_penalty=1.2, stop=[stop]), use_tqdm=False)[0].outputs[0]
    if stream:
        with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                          json={"model": "x", "prompt": PROMPT, "stream": True,
                                "stream_options": {"include_usage": True}, **body}) as r:
            chunks = [line[6:] for line in r.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]
        events = [json.loads(c) for c in chunks]
        text = "".join(e["choices"][0]["text"] for e in events if e["choices"])
        tokens = [t for e in events if e["choices"] for t in (e["choices"][0]["logprobs"] or {}).get("tokens", [])]
        finish = [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1]
        usage = events[-1]["usage"]
    else:
        out = post(server, body)
        c = out["choices"][0]
        text, tokens, finish, usage = c["text"], c["logprobs"]["tokens"], c["finish_reason"], out["usage"]
    assert text == ref.text and finish == ref.finish_reason
    assert len(tokens) == usage["completion_tokens"] == len(ref.token_ids)


def test_metrics_series_and_bench_serve_acceptance(server, qwen3_tiny):
    post(server, dict(max_tokens=32, temperature=0.0, ignore_eos=True))
    m = metrics(server.url)
    drafts = metric(m, "vllm:spec_decode_num_drafts_total")
    draft_tokens = metric(m, "vllm:spec_decode_num_draft_tokens_total")
    accepted = metric(m, "vllm:spec_decode_num_accepted_tokens_total")
    assert draft_tokens >= drafts > 0 and metric(m, "pdserve_spec_decode_num_placeholder_tokens_total") >= 0
    assert metric(m, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position="0") <= accepted
    out = subprocess.run([sys.executable, "-m", "pdserve.cli", "bench", "serve", "--base-url", server.url,
                          "--model", "x", "--tokenizer", qwen3_tiny, "--num-prompts", "4", "--ignore-eos",
                          "--random-input-len", "16", "--random-output-len", "8", "--disable-tqdm"],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "Mean acceptance length:" in out.stdout and "Acceptance rate (%):" in out.stdout, out.stdout


BAD = [('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
       ('{"method": "ngram", "num_speculative_tokens": 9}', "num_speculative_tokens"),
       ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}',
        "prompt_lookup_min"),
       ('{"method": "eagle", "num_speculative_tokens": 2}', "method"),
       ('{"num_speculative_tokens": 2}', "method"),
       ('{"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 1}', "disable_by_batch_size"),
       ('{"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 2}',
        "draft_tensor_parallel_size"),
       ('{"method": "ngram"', "not valid JSON")]


@pytest.mark.parametrize("bad,field", BAD)
def test_bad_values_are_cli_errors_naming_the_field(qwen3_tiny, bad, field, monkeypatch, capsys):
    """In process (the CLI's own main): what would run after a flag that passes is replaced by a failure."""
    import pdserve
    import pdserve.bench.pd
    import pdserve.serve.api_server
    from pdserve.cli import main

    def accepted(*a, **k):
        raise AssertionError(f"--speculative-config {bad} was accepted")
    for mod, name in ((pdserve.serve.api_server, "run_server"), (pdserve, "LLM"), (pdserve.bench.pd, "launch")):
        monkeypatch.setattr(mod, name, accepted)
    for cmd in (["serve", qwen3_tiny], ["generate", "--model", qwen3_tiny, "--prompt", "x"],
                ["bench", "pd", "--model", qwen3_tiny]):
        with pytest.raises(SystemExit) as e:
            main([*cmd, "--speculative-config", bad])
        err = capsys.readouterr().err
        assert e.value.code == 2 and "--speculative-config" in err and field in err, (cmd, err)


def test_budget_too_small_for_the_drafts_is_an_error(qwen3_tiny):
    with pytest.raises(ValueError, match="max_num_batched_tokens must be >= 1 \\+ speculative_config"):
        LLM(qwen3_tiny, speculative_config=spec(5), max_num_batched_tokens=5, max_num_seqs=1)
