"""Speculative decoding in the engine: greedy tokens equal transformers' and the plain engine's for K = 1, 3, 5 with
chunked prefill, prefix caching and preemption; the end of the context at odd max_model_len; penalties, min_tokens,
stop strings and logprobs as without speculation; seeded requests reproducible; sampling unchanged in distribution
(chi-square with a power check); drafting rows on FULL graphs; metrics."""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.spec_decode import verifier
from tests.oracle import hf_greedy, make_prompts
from tests.spec_decode.test_spec_decode_units import accept_always, chi2_p

NEW_TOKENS = 24


def spec(k, lo=1, hi=3, **extra):
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": lo, "prompt_lookup_max": hi,
            **extra}


def whole(llm):
    e = llm.engine
    e.check_invariants()
    assert e.kv.num_free_blocks() == e.num_blocks - 1, "blocks leaked"


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_greedy_equals_transformers_with_and_without_spec_decode(tiny_models, arch):
    """float64, the HF-oracle prompts (stdlib source: n-gram drafts hit) plus a repetitive one; every K and config
    gives transformers' tokens exactly, drafts were accepted, and the pools end whole."""
    model = tiny_models[arch]
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model)
    prompts = make_prompts(tok, [1, 5, 16, 17, 33, 100, 150], seed=3)
    prompts.append(tok("for i in range(10):\n    x = x + i\nfor i in range(10):\n    x =").input_ids)
    ref = [hf_greedy(model, torch.float64, p, NEW_TOKENS)[0] for p in prompts]
    sp = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    configs = [dict(max_num_batched_tokens=64, block_size=16),  # chunked prefill
               dict(max_num_batched_tokens=256, block_size=16, num_gpu_blocks_override=30, max_num_seqs=8,
                    max_model_len=256)]  # preemption
    accepted = 0
    for k in (1, 3, 5):
        for cfg in configs:
            llm = LLM(model, dtype="float64", speculative_config=spec(k), **cfg)
            for rnd in range(2):  # the second round hits the prefix cache
                outs = llm.generate(prompts, sp, use_tqdm=False)
                assert tokens(outs) == ref, (k, cfg, rnd)
            assert sum(o.num_cached_tokens for o in outs) > 0
            if "num_gpu_blocks_override" in cfg:
                assert llm.engine.scheduler.num_preemptions > 0
            st = llm.engine.spec_decode_stats()
            assert st["num_drafts"] > 0 and len(st["accepted_per_pos"]) == k
            accepted += st["num_accepted_tokens"]
            whole(llm)
    assert accepted > 0, "no draft was ever accepted: the test would not see a wrong acceptance"


@pytest.mark.parametrize("max_model_len,block_size", [(37, 4), (61, 16), (18, 1)])
def test_rows_at_the_end_of_the_context(qwen3_tiny, max_model_len, block_size):
    """Requests that run into max_model_len (odd lengths, blocks that do not divide them): drafts are clipped so no
    position past the context is computed; tokens equal the plain engine's, pools whole."""
    prompt = "a b a b a b a b"
    sp = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=None)  # what the context leaves
    kw = dict(dtype="float64", max_model_len=max_model_len, block_size=block_size, max_num_seqs=4)
    ref = tokens(LLM(qwen3_tiny, **kw).generate([prompt, prompt + " a"], sp, use_tqdm=False))
    for k in (1, 4, 8):
        llm = LLM(qwen3_tiny, speculative_config=spec(k), **kw)
        outs = llm.generate([prompt, prompt + " a"], sp, use_tqdm=False)
        assert tokens(outs) == ref
        assert all(len(o.prompt_token_ids) + len(o.outputs[0].token_ids) == max_model_len for o in outs)
        assert outs[0].outputs[0].finish_reason == "length"
        whole(llm)


PENALISED = [dict(repetition_penalty=1.3), dict(frequency_penalty=0.7, presence_penalty=0.4),
             dict(min_tokens=10), dict(repetition_penalty=0.8, frequency_penalty=-0.3, min_tokens=5),
             dict(logit_bias={str(t): 4.0 for t in range(200, 260)} | {"11": -100}),
             dict(allowed_token_ids=list(range(200, 400)) + [2210, 2531, 965], repetition_penalty=1.2)]


def test_penalties_min_tokens_and_stops_match_plain(qwen3_tiny):
    """Greedy with penalties and min_tokens (each position penalised as if its earlier drafts were emitted), stop
    token ids and stop strings cut mid-draft, logprobs per emitted token: all as without speculation."""
    llm0 = LLM(qwen3_tiny, dtype="float64")
    tok = llm0.get_tokenizer()
    prompt = "x = 1\ny = 2\nx = 1\ny = 2\nx = 1\ny ="
    plain = llm0.generate([prompt], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0]
    stop_str = tok.decode(plain.token_ids[6:8])  # ends inside what a draft would cover
    params = [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, **kw) for kw in PENALISED]
    params += [SamplingParams(temperature=0.0, max_tokens=30, stop=[stop_str], logprobs=3),
               SamplingParams(temperature=0.0, max_tokens=30, stop=[stop_str], include_stop_str_in_output=True),
               SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[plain.token_ids[9]], logprobs=2),
               SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True, logprobs=0),
               SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True,  # words greedy would write
                              bad_words=[tok.decode(plain.token_ids[2:4]), tok.decode(plain.token_ids[6:7])])]
    ref = llm0.generate([prompt] * len(params), params, use_tqdm=False)
    assert ref[-1].outputs[0].token_ids[:6] != plain.token_ids[:6]  # the bad words did steer it
    for k in (2, 5):
        llm = LLM(qwen3_tiny, dtype="float64", speculative_config=spec(k))
        outs = llm.generate([prompt] * len(params), params, use_tqdm=False)
        for o, r in zip(outs, ref):
            a, b = o.outputs[0], r.outputs[0]
            assert (a.token_ids, a.text, a.finish_reason, a.stop_reason) == (b.token_ids, b.text, b.finish_reason,
                                                                             b.stop_reason)
            if b.logprobs is not None:
                assert len(a.logprobs) == len(a.token_ids)
                for x, y in zip(a.logprobs, b.logprobs):
                    assert x.keys() == y.keys()
                    assert all(abs(x[t].logprob - y[t].logprob) < 1e-9 and x[t].rank == y[t].rank for t in x)
        assert llm.engine.spec_decode_stats()["num_accepted_tokens"] > 0
        whole(llm)


def test_seeded_requests_are_reproducible_and_equal_plain(qwen3_tiny):
    """A seeded request gives the same tokens on every run, alone or in a batch, and the same as without spec
    decode (its stream is consumed one uniform per emitted token)."""
    prompt = "def f(x):\n    return x\ndef f(x):\n    return"
    sps = [SamplingParams(temperature=t, top_k=k, top_p=p, seed=s, max_tokens=20, ignore_eos=True)
           for t, k, p, s in ((0.8, 0, 1.0, 11), (1.2, 5, 0.9, 12), (0.5, 20, 1.0, 13))]
    ref = tokens(LLM(qwen3_tiny, dtype="float64").generate([prompt] * 3, sps, use_tqdm=False))
    llm = LLM(qwen3_tiny, dtype="float64", speculative_config=spec(3))
    filler = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    for batch in ([prompt] * 3, [prompt] * 3 + ["other text"] * 2):
        outs = llm.generate(batch, sps + [filler] * (len(batch) - 3), use_tqdm=False)
        assert tokens(outs)[:3] == ref
    whole(llm)


def draftable_prompt(llm, k: int) -> list[int]:
    """A prompt whose first step can only sample tokens (its top k) that it already holds, each followed there by
    one of the top k after it: so the verify step has a real draft, often accepted. Built by prepending
    (token, its likeliest successor) pairs until none is missing (~20-40 rounds here)."""
    def top(p):
        o = llm.generate([p], SamplingParams(temperature=0.0, max_tokens=1, logprobs=k), use_tqdm=False)
        return [t for t, lp in o[0].outputs[0].logprobs[0].items() if lp.rank <= k]
    prompt = llm.get_tokenizer()("x = 1\ny = 2\n").input_ids
    for _ in range(60):
        pairs = []
        for a in top(prompt):
            nxt = top(prompt + [a])
            if a not in prompt[:-1] or prompt[prompt.index(a) + 1] not in nxt:
                pairs += [a, nxt[0]]
        if not pairs:
            return prompt
        prompt = pairs + prompt
    raise AssertionError("no draftable prompt found")


def first_two(model, k, prompt, n=4000):
    """First two tokens of n unseeded requests (temperature 0.9, top_k 3) with or without spec decode."""
    kw = dict(dtype="float32", max_num_seqs=512, max_num_batched_tokens=16384, seed=7, max_model_len=256)
    llm = LLM(model, speculative_config=spec(k, 1, 1) if k else None, **kw)
    sp = SamplingParams(temperature=0.9, top_k=3, max_tokens=2, ignore_eos=True)
    outs = llm.generate([prompt] * n, sp, use_tqdm=False)
    return Counter(tuple(o.outputs[0].token_ids) for o in outs), llm.engine.spec_decode_stats()


def test_first_two_tokens_match_plain_by_chi_square_with_power(qwen3_tiny, monkeypatch):
    """The second token comes from a verify step (the first is the prompt's); with a deliberately wrong acceptance
    rule (every real draft taken) the same test fails. 4000 requests a side: the wrong rule's p-value is already
    below 1e-300 there (and the right one's ~0.97), so 20000 (73 s of make test) bought no power."""
    prompt = draftable_prompt(LLM(qwen3_tiny, dtype="float32", max_model_len=256), 3)
    plain, _ = first_two(qwen3_tiny, 0, prompt)
    spec_counts, st = first_two(qwen3_tiny, 2, prompt)
    assert st["num_drafts"] == 4000 and st["num_accepted_tokens"] > 2000, st
    assert chi2_p(spec_counts, plain) >= 0.01
    monkeypatch.setattr(verifier, "rejection_sample", accept_always)
    wrong, _ = first_two(qwen3_tiny, 2, prompt)
    assert chi2_p(wrong, plain) < 1e-6


def test_drafting_rows_ride_full_graphs_and_metrics(qwen3_tiny):
    """Decode steps with drafts are uniform at q = 1 + K and FULL; the counters follow vLLM's definitions."""
    llm = LLM(qwen3_tiny, speculative_config=spec(3))
    rows = []
    execute = llm.engine.runner.execute
    llm.engine.runner.execute = lambda rs, b: rows.extend(r for r in rs if r.draft_token_ids) or execute(rs, b)
    prompts = ["def foo(x):\n    return x + 1\n\ndef foo(x):\n    return", "import os\nimport sys\nimport os\nimport"]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True), use_tqdm=False)
    g = llm.engine.graph_stats()
    assert g["non_full_by_reason"] == {"prefill": 1} and g["full_steps"] > 0
    assert all(len(r.draft_token_ids) == 3 and r.num_scheduled_tokens == 4 for r in rows)
    st = llm.engine.spec_decode_stats()
    assert st["num_draft_tokens"] + st["num_placeholder_tokens"] == 3 * len(rows)
    assert st["num_drafts"] == sum(1 for r in rows if max(r.draft_token_ids) >= 0)
    assert st["num_accepted_tokens"] == sum(st["accepted_per_pos"]) > 0
    assert st["accepted_per_pos"] == sorted(st["accepted_per_pos"], reverse=True)
    kept = sum(len(o.outputs[0].token_ids) - 1 for o in outs)  # the prefill's token is not verified
    assert kept <= st["num_accepted_tokens"] + len(rows) < kept + 2 * 4  # at most the last step's tail is cut
    whole(llm)


@pytest.mark.parametrize("sp", [dict(repetition_penalty=1.5), dict(frequency_penalty=0.9, presence_penalty=0.3),
                                dict(min_tokens=5), dict(repetition_penalty=0.7, frequency_penalty=-0.4,
                                                         presence_penalty=0.2, min_tokens=4, stop_token_ids=[9]),
                                dict(repetition_penalty=1.5, logit_bias={3: 2.0, 7: -1.5})])
def test_each_position_is_penalised_as_if_its_drafts_were_emitted(sp):
    """Exact: position j of a drafting row gets the logits the plain sampler gives a request whose output already
    ends with drafts 0..j-1 (counts, presence, seen ids, min_tokens), placeholders never counted."""
    from pdserve.model.sampler import Sampler
    from pdserve.request import Request
    from pdserve.spec_decode.rejection_sampler import PLACEHOLDER_TOKEN_ID as PH
    g = torch.Generator().manual_seed(0)
    vocab, prompt, output = 24, [1, 2, 3, 2], [4, 5, 4]
    drafts = [[6, 4, 3, 6, PH], [PH] * 5, [5, 5, 7, PH, PH]]
    reqs = []
    for _ in drafts:
        r = Request("r", prompt, SamplingParams(temperature=0.0, max_tokens=20, **sp), frozenset({0}))
        for t in output:
            r.append_output_token(t)
        reqs.append(r)
    logits = torch.randn(len(drafts) * 6, vocab, generator=g, dtype=torch.float64)
    sampler = Sampler(torch.device("cpu"), 0)
    ours = verifier.penalised_logits(sampler, logits, reqs, drafts)
    for i, d in enumerate(drafts):
        for j in range(6):
            r = Request("x", prompt, reqs[i].sampling_params, frozenset({0}))
            for t in output + [t for t in d[:j] if t != PH]:
                r.append_output_token(t)
            want = sampler._apply_penalties(logits[i * 6 + j:i * 6 + j + 1].clone(), [r], [0])
            assert torch.equal(ours[i * 6 + j], want[0]), (i, j)
    blind = sampler._apply_penalties(logits.clone(), [r for r in reqs for _ in range(6)], list(range(18)))
    assert not torch.equal(ours, blind)  # the drafts did change some target: the test sees them ignored


def test_a_bad_word_is_banned_after_a_draft_that_starts_it():
    """Position j of a drafting row bans a bad word's last token when the output plus drafts 0..j-1 end with the
    rest of the word, and only there."""
    from pdserve.model.sampler import Sampler
    from pdserve.request import Request
    from pdserve.spec_decode.rejection_sampler import PLACEHOLDER_TOKEN_ID as PH
    r = Request("r", [1, 2], SamplingParams(temperature=0.0, max_tokens=20, bad_words=["w"]), frozenset({0}))
    r.append_output_token(4)
    r.bad_words_token_ids = [[6, 7], [4, 9, 8]]
    out = verifier.penalised_logits(Sampler(torch.device("cpu"), 0), torch.zeros(4, 24, dtype=torch.float64),
                                    [r], [[6, 9, PH]])
    banned = [(out[j] == float("-inf")).nonzero().flatten().tolist() for j in range(4)]
    assert banned == [[], [7], [], []], banned


def test_disable_by_batch_size_drafts_nothing_and_stays_on_q1_graphs(qwen3_tiny):
    """With 3 running and disable_by_batch_size 3, no step drafts; the q = 1 decode steps still ride FULL. Once
    requests finish (the short ones), the rest draft again."""
    llm = LLM(qwen3_tiny, speculative_config=spec(3, disable_by_batch_size=3))
    rows = []
    execute = llm.engine.runner.execute
    llm.engine.runner.execute = lambda rs, b: rows.append([len(r.draft_token_ids) for r in rs]) or execute(rs, b)
    prompts = ["a b a b a", "c d c d", "e f e f"]
    sps = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (30, 4, 4)]
    ref = tokens(LLM(qwen3_tiny).generate(prompts, sps, use_tqdm=False))
    assert tokens(llm.generate(prompts, sps, use_tqdm=False)) == ref
    assert all(set(r) == {0} for r in rows if len(r) == 3) and any(set(r) == {3} for r in rows if len(r) == 1)
    assert llm.engine.graph_stats()["non_full_by_reason"] == {"prefill": 1}
    whole(llm)


def test_drafts_that_do_not_fit_are_dropped_not_the_row(qwen3_tiny):
    """A budget of 10 with K = 3 fits two drafting rows: the third decodes without drafts, every step (it was
    skipped until the others finished); a pool too small for the lookahead drops drafts instead of preempting."""
    llm = LLM(qwen3_tiny, max_num_batched_tokens=10, max_num_seqs=4, speculative_config=spec(3))
    e = llm.engine
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for p in ["a b c", "d e f", "g h i"]:
        e.add_request(p, sp)
    e.step()
    while e.scheduler.running and len(e.scheduler.running) == 3:
        before = [r.num_output_tokens for r in e.scheduler.running]
        e.step()
        assert all(r.num_output_tokens > b for r, b in zip(e.scheduler.running, before) if not r.is_finished)
    prompts = [f"{w} x {w} y {w}" for w in ("a", "b", "c", "d")]
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    kw = dict(block_size=4, num_gpu_blocks_override=20, max_num_seqs=4, max_model_len=40)
    plain = LLM(qwen3_tiny, **kw)
    ref = tokens(plain.generate(prompts, sp, use_tqdm=False))
    llm = LLM(qwen3_tiny, speculative_config=spec(3), **kw)
    llm.engine.scheduler.proposer.propose_padded_for = lambda req, k: [-1] * k  # placeholders: plain's tokens/step
    assert tokens(llm.generate(prompts, sp, use_tqdm=False)) == ref
    assert llm.engine.scheduler.num_preemptions <= plain.engine.scheduler.num_preemptions
    whole(llm)


def scripted(llm, script: list[int]):
    """Replace the model by a script: each step's rows get the script's next tokens in order (a drafting row as
    many as it has drafts + 1), so a plain and a drafting engine emit the same tokens in different steps.
    Returns the list of each step's draft counts."""
    from pdserve.sched_output import ModelRunnerOutput
    todo, drafts = list(script), []

    def run(step):  # the model's half of a step, with or without async scheduling
        rows, sampled = step.rows, []
        drafts.append([len(r.draft_token_ids) for r in rows])
        for r in rows:
            if not r.samples:
                sampled.append(None)
            elif r.draft_token_ids:
                n = len(r.draft_token_ids) + 1
                sampled.append(todo[:n])
                del todo[:n]
            else:
                sampled.append(todo.pop(0))
        return ModelRunnerOutput(sampled, [None] * len(rows))
    llm.engine.runner.run = run
    return drafts


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_found_by_the_final_flush_keeps_the_stop_token(qwen3_tiny, include):
    """A stop string matched only when an incomplete UTF-8 tail is flushed, in the step whose token (a stop token
    id) ends the request: a drafting row emitting the tail byte and that token together keeps both, as plain
    decoding does over two steps; and a stop string completed mid-draft still drops the tokens after it."""
    tok = LLM(qwen3_tiny).get_tokenizer()
    a, b, stop_id = (tok.convert_tokens_to_ids(t) for t in ("a", "b", "z"))
    byte = tok.convert_tokens_to_ids("Ã")  # 0xC3: a UTF-8 lead byte, incomplete alone
    prompt = [a, b] * 6 + [a]  # the n-gram proposer drafts from the second step on
    cases = [([b, byte, stop_id], "\ufffd"), ([b, a, b, stop_id], "ba")]
    for script, stop in cases:
        sp = SamplingParams(max_tokens=10, stop=[stop], stop_token_ids=[stop_id], include_stop_str_in_output=include)
        got = []
        for cfg in ({}, {"speculative_config": spec(3)}):
            llm = LLM(qwen3_tiny, **cfg)
            drafts = scripted(llm, script + [a] * 8)
            o = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0].outputs[0]
            got.append((o.token_ids, o.text, o.finish_reason, o.stop_reason))
            whole(llm)
        assert drafts == [[0], [3]]  # the drafting engine emitted all but the first token in one step
        assert got[0] == got[1], (script, stop, got)
    # plain decoding, for the record: the flushed tail keeps the stop token, the mid-output string drops it
    assert got[0][0] == [b, a] and got[0][3] == "ba"
