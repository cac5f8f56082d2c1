"""The engine's tokenizer (core/tokenizer.py): decoding through the Rust backend alone gives transformers' text for
every id and for runs of ids, special tokens skipped or not; an engine that only decodes (token-id prompts, stop
strings, logprobs) never loads transformers' tokenizer; anything else loads it, and a model whose config does not
say `clean_up_tokenization_spaces: false` gets transformers' tokenizer at once."""
from __future__ import annotations

import json
import random
import shutil

import pytest
from transformers import AutoTokenizer

from pdserve import LLM, SamplingParams
from pdserve.core.tokenizer import LazyTokenizer, load_tokenizer


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_the_backend_decodes_as_transformers(tiny_models, arch):
    lazy, hf = load_tokenizer(tiny_models[arch]), AutoTokenizer.from_pretrained(tiny_models[arch])
    assert isinstance(lazy, LazyTokenizer)
    rng = random.Random(0)
    runs = [[i] for i in range(len(hf))] + [[rng.randrange(len(hf)) for _ in range(rng.randrange(2, 24))]
                                            for _ in range(500)]
    for skip in (True, False):
        assert [lazy._tokenizer.decode(ids, skip_special_tokens=skip) for ids in runs] == \
            [hf.decode(ids, skip_special_tokens=skip) for ids in runs]
    assert lazy._hf is None  # nothing so far needed transformers
    assert lazy("def f(x):\n").input_ids == hf("def f(x):\n").input_ids and lazy.eos_token_id == hf.eos_token_id
    assert lazy._hf is not None and len(lazy) == len(hf)


def test_an_engine_that_only_decodes_never_loads_transformers_tokenizer(qwen3_tiny):
    llm = LLM(qwen3_tiny, max_model_len=256, kv_cache_memory_gb=0.02)
    tok = llm.engine.tokenizer
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=["\n\n"], logprobs=2)
    out = llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], sp, use_tqdm=False)[0].outputs[0]
    assert isinstance(tok, LazyTokenizer) and tok._hf is None
    hf = AutoTokenizer.from_pretrained(qwen3_tiny)
    assert out.text == hf.decode(out.token_ids, skip_special_tokens=True)[:len(out.text)] and out.text
    llm.generate(["def f(x):"], SamplingParams(max_tokens=2), use_tqdm=False)  # a text prompt: encoded by it
    assert tok._hf is not None


@pytest.mark.parametrize("cfg", [{"clean_up_tokenization_spaces": True}, {}])
def test_without_an_explicit_no_clean_up_transformers_decides(qwen3_tiny, tmp_path, cfg):
    model = tmp_path / "m"
    shutil.copytree(qwen3_tiny, model)
    path = model / "tokenizer_config.json"
    tc = {k: v for k, v in json.loads(path.read_text()).items() if k != "clean_up_tokenization_spaces"}
    path.write_text(json.dumps({**tc, **cfg}))
    assert not isinstance(load_tokenizer(str(model)), LazyTokenizer)
