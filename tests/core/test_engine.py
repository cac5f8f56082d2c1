"""Engine behaviour on a tiny model: sampling, streaming text, stop conditions, errors, block accounting."""
from __future__ import annotations

import json

import pytest

from pdserve import LLM, SamplingParams
from pdserve.request import RequestStatus


@pytest.fixture(scope="module")
def llm(qwen3_tiny):
    return LLM(qwen3_tiny, max_num_batched_tokens=64, max_model_len=512)


def _drain(engine):
    """Step until idle; per request: concatenated deltas, last output."""
    streamed, final = {}, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            streamed[out.request_id] = streamed.get(out.request_id, "") + out.outputs[0].delta_text
            final[out.request_id] = out
    return streamed, final


def _assert_clean(engine):
    engine.check_invariants()
    assert engine.kv.num_free_blocks() == engine.num_blocks - 1


def test_seeded_sampling_reproducible(llm):
    sp = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=20, ignore_eos=True)
    a = llm.generate(["def main():"], sp, use_tqdm=False)[0].outputs[0].token_ids
    # Same seed, now batched with unseeded random requests: the seeded stream must not change.
    noisy = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    outs = llm.generate(["import re", "def main():", "x = 1"], [noisy, sp, noisy], use_tqdm=False)
    assert outs[1].outputs[0].token_ids == a
    c = llm.generate(["def main():"], SamplingParams(temperature=1.0, seed=99, max_tokens=20, ignore_eos=True),
                     use_tqdm=False)[0].outputs[0].token_ids
    assert c != a
    _assert_clean(llm.engine)


def test_min_p_and_top_k_1_are_greedy_like(llm):
    greedy = llm.generate(["class A:"], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0].token_ids
    k1 = llm.generate(["class A:"], SamplingParams(temperature=0.8, top_k=1, seed=3, max_tokens=12, ignore_eos=True),
                      use_tqdm=False)[0].outputs[0].token_ids
    assert k1 == greedy


def test_streamed_text_equals_final_text_multibyte(llm):
    e = llm.engine
    prompts = ["héllo 世界 🙂 ", "日本語のテキスト", "emoji 🙂🙃🙂 and more", "def f():"]
    for i, p in enumerate(prompts):
        e.add_request(p, SamplingParams(temperature=1.0, seed=i, max_tokens=40, ignore_eos=True), request_id=f"mb{i}")
    streamed, final = _drain(e)
    for rid, out in final.items():
        assert out.finished
        assert streamed[rid] == out.outputs[0].text
        assert "\ufffd" not in streamed[rid] or "\ufffd" in e.tokenizer.decode(out.outputs[0].token_ids)
    _assert_clean(e)


def test_stop_string_holdback_and_truncation(llm):
    e = llm.engine
    base = llm.generate(["import os\n"], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    text = base.text
    assert len(text) > 12, text
    stop = text[8:12]  # a stop string that appears mid-output, likely spanning tokens
    e.add_request("import os\n", SamplingParams(temperature=0, max_tokens=30, stop=[stop], ignore_eos=True),
                  request_id="stop")
    e.add_request("import os\n", SamplingParams(temperature=0, max_tokens=30, stop=[stop], ignore_eos=True,
                                                include_stop_str_in_output=True), request_id="stop-incl")
    streamed, final = _drain(e)
    out = final["stop"].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[:text.index(stop)] and streamed["stop"] == out.text
    incl = final["stop-incl"].outputs[0]
    assert incl.text == text[:text.index(stop) + len(stop)] and streamed["stop-incl"] == incl.text
    _assert_clean(e)


def test_stop_token_ids_and_length(llm):
    base = llm.generate(["for i in"], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    assert base.finish_reason == "length" and len(base.token_ids) == 10
    target = base.token_ids[3]
    first = base.token_ids.index(target)
    out = llm.generate(["for i in"], SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[target]),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == target and out.token_ids == base.token_ids[:first + 1]
    mt = llm.generate(["for i in"], SamplingParams(temperature=0, max_tokens=10, min_tokens=8,
                                                   stop_token_ids=[target]), use_tqdm=False)[0].outputs[0]
    assert len(mt.token_ids) >= 8


def test_stop_string_waits_for_min_tokens(llm):
    # Greedy output here is " noti" + "fic" * 7 + ...: "fic" first ends in token 2.
    sp = dict(temperature=0, max_tokens=12, ignore_eos=True, stop=["fic"])
    base = llm.generate(["def f(x):"], SamplingParams(**sp), use_tqdm=False)[0].outputs[0]
    assert base.text == " noti" and base.finish_reason == "stop" and len(base.token_ids) == 2
    # As vLLM: the text of the first 3 tokens is not searched; the match ends in token 4.
    out = llm.generate(["def f(x):"], SamplingParams(min_tokens=3, **sp), use_tqdm=False)[0].outputs[0]
    assert (out.text, out.finish_reason, out.stop_reason, len(out.token_ids)) == (" notificfic", "stop", "fic", 4)
    _assert_clean(llm.engine)


def test_stop_string_in_last_allowed_token_is_stop(llm):
    # The last token allowed by max_tokens, and by max_model_len (max_tokens None), completes a stop string:
    # the stop wins over the length cap (as vLLM), the text is cut at it.
    sp = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True, stop=["unexpected"])
    out = llm.generate(["def f(x):"], sp, use_tqdm=False)[0].outputs[0]
    assert (out.text, out.finish_reason, out.stop_reason) == (" noti" + "fic" * 7, "stop", "unexpected")
    assert len(out.token_ids) == 9
    ids = llm.get_tokenizer()("def f(x):\n    return x\n" * 80).input_ids[:500]  # greedy: 12 tokens, ending "EH"
    sp = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True, stop=["EH"])
    out = llm.generate([ids], sp, use_tqdm=False)[0].outputs[0]
    assert (out.finish_reason, out.stop_reason, len(out.token_ids)) == ("stop", "EH", 12)
    assert out.text == "codecEGbreaks subclasscompletecsiso lateext differences SIXORD"
    _assert_clean(llm.engine)


def test_logprobs(llm):
    out = llm.generate(["x ="], SamplingParams(temperature=0, max_tokens=5, logprobs=3, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == 5
    for tok, entry in zip(out.token_ids, out.logprobs):
        assert entry[tok].rank == 1  # greedy picks the top token
        assert len(entry) == 3
        assert all(lp.logprob <= 0 and lp.decoded_token is not None for lp in entry.values())


def test_token_id_prompts_and_chat(llm):
    ids = llm.get_tokenizer()("def f(x):").input_ids
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    a = llm.generate("def f(x):", sp, use_tqdm=False)[0]
    b = llm.generate({"prompt_token_ids": ids}, sp, use_tqdm=False)[0]
    assert a.outputs[0].token_ids == b.outputs[0].token_ids and a.prompt_token_ids == ids
    chat = llm.chat([{"role": "user", "content": "hello"}], sp, use_tqdm=False)[0]
    assert "<|im_start|>assistant" in llm.get_tokenizer().decode(chat.prompt_token_ids)
    assert len(chat.outputs[0].token_ids) == 8


def test_bad_inputs_raise_clear_errors(llm, tmp_path):
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        llm.generate("x", SamplingParams(top_p=0))
    with pytest.raises(ValueError, match="max_tokens.*max_model_len|max_model_len"):
        llm.generate("x", SamplingParams(max_tokens=10_000), use_tqdm=False)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([[1, 2, 10**6]], SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], SamplingParams(max_tokens=2), use_tqdm=False)
    _assert_clean(llm.engine)
    with pytest.raises(ValueError, match="does not exist"):
        LLM(str(tmp_path / "nope"))
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="Qwen3ForCausalLM.*LlamaForCausalLM"):
        LLM(str(tmp_path))
    with pytest.raises(TypeError, match="unknown engine argument"):
        LLM(str(tmp_path), not_a_flag=1)


def test_abort_frees_blocks(llm):
    e = llm.engine
    for i in range(4):
        e.add_request("def g():\n" * 10, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True),
                      request_id=f"ab{i}")
    e.step()
    e.step()
    out = e.abort_request("ab1")
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert e.abort_request("ab1") is None
    e.abort_request("ab3")
    _, final = _drain(e)
    assert final["ab0"].outputs[0].finish_reason == "length"
    assert e.scheduler.requests == {} and not any(s == RequestStatus.RUNNING for s in [])
    _assert_clean(e)


def test_output_kinds(llm):
    """DELTA outputs carry only each step's text, tokens and logprobs; they add up to the CUMULATIVE ones. FINAL_ONLY
    gives one output, at the end, equal to the last CUMULATIVE one."""
    from pdserve.sampling_params import RequestOutputKind as K
    e = llm.engine
    outs = {}
    for kind in (K.CUMULATIVE, K.DELTA, K.FINAL_ONLY):
        sp = SamplingParams(temperature=0, max_tokens=12, logprobs=2, ignore_eos=True, output_kind=kind)
        e.add_request("def fibonacci(n):", sp, request_id=kind.name)
        seen = []
        while e.has_unfinished_requests():
            seen += [o for o in e.step() if o.request_id == kind.name]
        outs[kind] = seen
    cum, delta, final = outs[K.CUMULATIVE], outs[K.DELTA], outs[K.FINAL_ONLY]
    assert len(final) == 1 and len(delta) == len(cum) == 12
    last = cum[-1].outputs[0]
    for got in (final[0].outputs[0],):
        assert (got.text, got.token_ids, got.finish_reason) == (last.text, last.token_ids, last.finish_reason)
        assert [sorted(x) for x in got.logprobs] == [sorted(x) for x in last.logprobs]
    assert "".join(o.outputs[0].text for o in delta) == last.text
    assert [t for o in delta for t in o.outputs[0].token_ids] == last.token_ids
    assert all(len(o.outputs[0].logprobs) == len(o.outputs[0].token_ids) == 1 for o in delta)
    assert all(lp.decoded_token is not None for o in delta for lp in o.outputs[0].logprobs[0].values())
    _assert_clean(e)


def test_stop_token_text_left_out(llm):
    """As vLLM: the text of the stop token id that ended a request is not in its output (unless
    include_stop_str_in_output); the id itself is in token_ids. Also when it is the last allowed token."""
    base = llm.generate(["for i in"], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    target = base.token_ids[3]
    first = base.token_ids.index(target)
    tok = llm.engine.tokenizer
    assert tok.decode(base.token_ids[first:first + 1]), "the stop token must have text for this test"
    for max_tokens in (10, first + 1):
        for incl in (False, True):
            sp = SamplingParams(temperature=0, max_tokens=max_tokens, stop_token_ids=[target],
                                include_stop_str_in_output=incl)
            out = llm.generate(["for i in"], sp, use_tqdm=False)[0]
            c = out.outputs[0]
            assert (c.finish_reason, c.stop_reason, c.token_ids) == ("stop", target, base.token_ids[:first + 1])
            assert c.text == tok.decode(base.token_ids[:first + (1 if incl else 0)])


def test_n_choices_offline_are_the_seeded_children(llm):
    """LLM.generate with n = 3: one output per prompt with three completions by index, completion i the same as
    an n = 1 request seeded seed + i (vLLM's); the engine itself takes n = 1 requests only."""
    sp = SamplingParams(n=3, temperature=1.0, seed=2 ** 63 - 2, max_tokens=6, ignore_eos=True)
    outs = llm.generate(["def f(x):", "import os"], sp, use_tqdm=False)
    assert [len(o.outputs) for o in outs] == [3, 3] and [c.index for c in outs[0].outputs] == [0, 1, 2]
    for i, seed in enumerate((2 ** 63 - 2, 2 ** 63 - 1, -2 ** 63)):  # seed + i wraps in the 64-bit range
        one = llm.generate(["import os"], SamplingParams(temperature=1.0, seed=seed, max_tokens=6, ignore_eos=True),
                           use_tqdm=False)[0]
        assert one.outputs[0].token_ids == outs[1].outputs[i].token_ids
    assert len({tuple(c.token_ids) for c in outs[0].outputs}) > 1
    with pytest.raises(ValueError, match="n = 2"):
        llm.engine.add_request("x", SamplingParams(n=2))
    with pytest.raises(ValueError, match="n must be at least 1"):
        SamplingParams(n=0)
    with pytest.raises(ValueError):  # the second prompt is refused: nothing of the batch stays in the engine
        llm.generate(["def f(x):", list(range(3, 600))], sp, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.kv.num_free_blocks() == llm.engine.num_blocks - 1


def test_cache_salt_shares_prefix_blocks_only_within_a_salt(qwen3_tiny):
    """vLLM's cache_salt: a repeated prompt hits the prefix cache under the same salt only (not under another salt,
    nor unsalted), and the tokens do not depend on it; an empty salt is refused."""
    llm = LLM(qwen3_tiny, max_model_len=512, block_size=16, enable_prefix_caching=True)
    prompt = list(range(40, 90))  # 50 tokens: 3 full blocks can hit
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)

    def run(salt=None):
        out = llm.generate([{"prompt_token_ids": prompt} | ({"cache_salt": salt} if salt else {})], sp,
                           use_tqdm=False)[0]
        return out.num_cached_tokens, out.outputs[0].token_ids

    first = run("tenant-a")
    assert first[0] == 0
    assert run("tenant-a") == (48, first[1])
    assert run("tenant-b") == (0, first[1]) and run() == (0, first[1])
    assert run() == (48, first[1]) and run("tenant-b")[0] == 48
    with pytest.raises(ValueError, match="cache_salt"):
        llm.engine.add_request(prompt, sp, cache_salt="")
    _assert_clean(llm.engine)


def test_bad_words_outside_the_models_vocabulary_are_refused(llm, monkeypatch):
    """A tokenizer larger than the model's vocabulary: a bad word it tokenizes past the logits is refused at
    add_request, not an IndexError that fails the step."""
    tok = type(getattr(llm.engine.tokenizer, "hf", llm.engine.tokenizer))  # transformers' (the lazy one's, loaded)
    monkeypatch.setattr(tok, "encode", lambda self, text, add_special_tokens=False: [llm.engine.vocab_size + 3])
    with pytest.raises(ValueError, match="bad_words: token id"):
        llm.engine.add_request([5, 6, 7], SamplingParams(max_tokens=3, bad_words=["w"]))
    assert not llm.engine.has_unfinished_requests()
