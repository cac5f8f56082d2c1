"""Speculative decoding's units: vLLM's config rules; the n-gram proposer against a line-for-line port of vLLM's
algorithm and a brute force; the rejection sampler exactly (enumerated uniforms), in distribution (chi-square, with
a power check), greedy and seeded against plain decoding."""
from __future__ import annotations

from collections import Counter
from fractions import Fraction

import numpy as np
import pytest
import torch

from pdserve.model.probs import filtered_probs, inverse_cdf
from pdserve.model.sampler import GREEDY_EPS, Sampler
from pdserve.request import Request
from pdserve.sampling_params import SamplingParams
from pdserve.spec_decode import (MAX_SPECULATIVE_TOKENS, PLACEHOLDER_TOKEN_ID as PH, NgramProposer, RowDraws,
                                 SpeculativeConfig, pad_drafts, propose, propose_batch, rejection_sample,
                                 target_tokens)

CPU = torch.device("cpu")


def cfg(**d):
    return SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3, **d})


def test_config_defaults_and_copies_as_vllm():
    assert (cfg().prompt_lookup_min, cfg().prompt_lookup_max, cfg().disable_by_batch_size) == (5, 5, None)
    assert (cfg(prompt_lookup_min=2).prompt_lookup_max, cfg(prompt_lookup_max=7).prompt_lookup_min) == (2, 7)
    c = cfg(prompt_lookup_min=1, prompt_lookup_max=4, disable_by_batch_size=2, rejection_sample_method="standard",
            draft_tensor_parallel_size=None)
    assert (c.prompt_lookup_min, c.prompt_lookup_max, c.num_lookahead_slots) == (1, 4, 3)
    assert c.speculates(1) and not c.speculates(2) and cfg().speculates(10 ** 6)
    for d in ({"model": "[ngram]"}, {"model": "ngram"}, {"method": "[ngram]"}, {"method": "ngram", "model": "ngram"}):
        assert SpeculativeConfig.from_dict({"num_speculative_tokens": 2, **d}).method == "ngram"
    assert SpeculativeConfig.from_json('{"method": "ngram", "num_speculative_tokens": 8}').num_speculative_tokens == 8
    with pytest.raises(AttributeError):
        c.num_speculative_tokens = 4  # frozen
    for s in ("{not json", "[1, 2]", '"ngram"'):
        with pytest.raises(ValueError, match="speculative_config (is not valid JSON|must be a JSON object)"):
            SpeculativeConfig.from_json(s)


@pytest.mark.parametrize("d, msg", [
    ({"num_speculative_tokens": 0}, "num_speculative_tokens must be in 1..8"), ({"num_speculative_tokens": -2}, "nu"),
    ({"num_speculative_tokens": MAX_SPECULATIVE_TOKENS + 1}, "num_speculative_tokens must be in"),
    ({"num_speculative_tokens": True}, "num_speculative_tokens must be an integer"),
    ({"num_speculative_tokens": "3"}, "num_speculative_tokens must be an int"),
    ({"num_speculative_tokens": 2.0}, "num_speculative_tokens must be an int"),
    ({"num_speculative_tokens": None}, "num_speculative_tokens is required"),
    ({"prompt_lookup_min": 0}, "prompt_lookup_min must be >= 1"), ({"prompt_lookup_max": 0}, "prompt_lookup_max mu"),
    ({"prompt_lookup_min": 0, "prompt_lookup_max": 0}, "prompt_lookup_min must be >= 1"),
    ({"prompt_lookup_min": 4, "prompt_lookup_max": 3}, "prompt_lookup_min=4 must be <= prompt_lookup_max=3"),
    ({"prompt_lookup_min": "2"}, "prompt_lookup_min must be an integer"),
    ({"prompt_lookup_max": 2.5}, "prompt_lookup_max must be an integer"),
    ({"disable_by_batch_size": 1}, "disable_by_batch_size must be > 1"), ({"disable_by_batch_size": 0}, "disable_b"),
    ({"disable_by_batch_size": True}, "disable_by_batch_size must be an integer"),
    ({"method": "eagle"}, "method='eagle' is not supported yet"), ({"method": "medusa"}, "method='medusa' is not"),
    ({"method": "draft_model"}, "method='draft_model' is not supported yet"),
    ({"method": "suffix"}, "method='suffix' is not"), ({"method": "ngram_gpu"}, "method='ngram_gpu' is not"),
    ({"method": "n-gram"}, "method must be 'ngram'"), ({"method": None}, "method is required"),
    ({"model": "meta-llama/Llama-3.2-1B"}, "model='meta-llama/Llama-3.2-1B': draft models are not supported yet"),
    ({"method": None, "model": "yuhuili/EAGLE-LLaMA3-Instruct-8B"}, "model='yuhuili/EAGLE"),
    ({"draft_tensor_parallel_size": 2}, "draft_tensor_parallel_size=2 is not supported yet"),
    ({"rejection_sample_method": "synthetic"}, "rejection_sample_method='synthetic' is not supported yet"),
    ({"disable_logprobs": True}, "disable_logprobs=True is not supported yet"),
    ({"lookahead": 3}, "unknown field.*lookahead"),
])
def test_config_bad_values_name_the_field(d, msg):
    with pytest.raises(ValueError, match="speculative_config" + (r"\S* " if "unknown" in msg else r"\.") + msg):
        cfg(**d)


def vllm_kmp(origin, min_n, max_n, k):
    """vLLM V1's _find_longest_matched_ngram_and_propose_tokens, line for line (max_model_len unbounded)."""
    total = len(origin)
    if total < min_n or k <= 0:
        return []
    tokens, lps, longest, position, prev, i = origin[::-1], [0] * max_n, 0, 0, 0, 1
    while i < total:
        if tokens[prev] == tokens[i]:
            prev += 1
            if prev >= longest:
                longest, position = prev, i
            if i < max_n:
                lps[i] = prev
            if prev == max_n:
                prev = lps[max_n - 1]
            i += 1
        elif prev != 0:
            prev = lps[prev - 1]
        else:
            i += 1
    if longest < min_n:
        return []
    start = total - 1 - position + longest
    return list(origin[start:start + min(k, total - start)])


def brute(t, k, n_min, n_max):
    """The definition: the longest n first, then the earliest occurrence ending before the last token."""
    for n in range(min(n_max, len(t) - 1), n_min - 1, -1):
        for s in range(len(t) - n):
            if t[s:s + n] == t[len(t) - n:]:
                return t[s + n:s + n + k]
    return []


@pytest.mark.parametrize("t, k, lo, hi, want", [
    ([1, 2, 3, 4, 2, 3], 4, 2, 3, [4, 2, 3]),  # vLLM's docstring example: fewer than k follow
    ([9, 1, 2, 7, 1, 2, 8, 1, 2], 2, 2, 2, [7, 1]),  # two occurrences: the earliest
    ([1, 2, 3, 9, 2, 3, 7, 1, 2, 3], 2, 2, 3, [9, 2]),  # the longer n wins over the later, shorter one
    ([5, 6, 0, 0, 5, 6], 3, 2, 2, [0, 0, 5]),  # match at position 0; token 0 is a token
    ([1, 2, 1, 2, 1, 2], 3, 1, 4, [1, 2]),  # the 4-gram at 0 overlaps the suffix; 2 tokens follow it
    ([3, 3, 3, 3], 5, 1, 3, [3]), ([1, 2], 3, 3, 5, []), ([1, 2, 3, 4], 3, 1, 2, []), ([7], 3, 1, 1, []),
    ([4, 4], 0, 1, 1, []),  # a run; shorter than n_min; no match; one token; k = 0
])
def test_proposer_hand_made(t, k, lo, hi, want):
    assert propose(np.array(t, np.int64), k, lo, hi).tolist() == want == vllm_kmp(t, lo, hi, k) == brute(t, k, lo, hi)


def test_proposer_random_against_vllm_and_brute_force():
    rng = np.random.default_rng(0)
    for _ in range(3000):
        t = rng.integers(0, int(rng.integers(1, 5)), int(rng.integers(0, 40))).tolist()
        lo = int(rng.integers(1, 4))
        hi, k = lo + int(rng.integers(0, 4)), int(rng.integers(1, 7))
        got = propose(np.array(t, np.int32), k, lo, hi)
        assert got.tolist() == vllm_kmp(t, lo, hi, k) == brute(t, k, lo, hi) and got.dtype == np.int32, (t, lo, hi)


def test_proposer_batch_pad_and_context_limit():
    seqs = [np.array([1, 2, 3, 1, 2]), np.array([5, 6]), np.array([0, 0, 0])]
    assert [d.tolist() for d in propose_batch(seqs, [2, 2, 1], 1, 2)] == [[3, 1], [], [0]]
    assert pad_drafts(propose_batch(seqs, 3, 1, 2), 3).tolist() == [[3, 1, 2], [PH] * 3, [0, PH, PH]]
    p = NgramProposer(SpeculativeConfig(3, prompt_lookup_min=1, prompt_lookup_max=2), max_model_len=7)
    assert p.propose(seqs[0]).tolist() == [3, 1]  # 5 tokens, 7 max: at most 2 drafts
    assert p.propose_padded(seqs, ks=[1, 3, 3]).tolist() == [[3, PH, PH], [PH] * 3, [0, PH, PH]]


def law(ps, drafts):
    """The rule in closed form: P(emitted sequence), acceptance p_j(d), the residual renormalised."""
    out, pre = {}, Fraction(1)
    for j, d in enumerate(drafts):
        a = ps[j][d] if d >= 0 else Fraction(0)
        out.update({tuple(drafts[:j]) + (t,): pre * (1 - a) * (pt / (1 - a))
                    for t, pt in enumerate(ps[j]) if t != d and pt and pre})
        pre *= a
    return out | {tuple(drafts) + (b,): pre * pb for b, pb in enumerate(ps[-1]) if pb and pre}


F = [[Fraction(x, 20) for x in row] for row in ([6, 1, 5, 0, 8], [2, 10, 0, 3, 5], [4, 4, 4, 4, 4], [0, 0, 20, 0, 0])]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("ps, drafts", [
    ((0, 1, 2), (2, 1)), ((0, 1, 2), (0, 3)), ((0, 1, 2), (PH, 1)), ((0, 1, 2), (2, PH)), ((0, 1, 2), (3, 1)),
    ((0, 1, 2), (PH, PH)), ((0, 1, 2), (4, 2)), ((3, 1, 2), (2, 1)), ((3, 3, 0), (2, 2)), ((3, 3, 0), (1, 2)),
])
def test_exact_law_over_enumerated_uniforms(ps, drafts, dtype):
    """Every uniform triple of a 20^3 midpoint grid; the probabilities are multiples of 1/20, so each emitted
    sequence's count is exactly 8000 x its closed-form probability. Placeholders (full target), drafts of
    probability 0 and 1 (never / always accepted), token 0, the bonus."""
    m, ps = 20, [F[i] for i in ps]
    grid = (torch.arange(m, dtype=torch.float64) + 0.5) / m
    u = torch.cartesian_prod(grid, grid, grid)
    scale = 0.7 if dtype == torch.float32 else 1.0  # a distribution need not sum to 1
    probs = torch.tensor([[float(x) * scale for x in row] for row in ps], dtype=dtype).expand(len(u), 3, 5)
    out, na = rejection_sample(probs, torch.tensor([drafts]).expand(len(u), 2), torch.zeros(len(u), dtype=bool), u)
    assert Counter(tuple(o) for o in out) == {s: int(p * m ** 3) for s, p in law(ps, list(drafts)).items()}
    assert all(n == len(o) - 1 and min(o) >= 0 for o, n in zip(out, na))


def test_shapes_and_missing_uniforms_are_errors():
    p, d2, no = torch.full((2, 3, 4), 0.25), torch.zeros(2, 2, dtype=torch.long), torch.zeros(2, dtype=bool)
    for args, msg in (((d2[:, :1], ~no), "drafts"), ((d2, no, torch.rand(2, 2)), "uniforms"), ((d2, no), "need u")):
        with pytest.raises(ValueError, match=msg):
            rejection_sample(p, *args)


def table_lm(seed):
    """Logits from the last two tokens of each history (a random table); contexts ending in 3 put token 0 on top.
    A placeholder in a history (positions past it are never read) is fed as any id."""
    table = torch.randn(16, 16, 16, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 1.5
    table[:, 3, 0] += 6.0
    def lm(hists):
        return table[tuple(torch.tensor([[max(x, 0) for x in h[-2:]] for h in hists]).T)]
    lm.next = table.argmax(-1).tolist()  # the greedy successor of each (a, b)
    return lm


def spec_generate(lm, reqs, n, k, draft_fn, sampler, sample=rejection_sample):
    """Decode n tokens per request with K drafts a step. Position j of a row is scored on the tokens so far plus
    drafts 0..j-1 (as the engine must build it); greedy rows keep their logits (only their argmax is read)."""
    accepted = []
    while active := [r for r in reqs if r.num_output_tokens < n]:
        drafts = pad_drafts([np.asarray(draft_fn(r), np.int64) for r in active], k)
        logits = lm([r.all_token_ids + drafts[i, :j].tolist() for i, r in enumerate(active) for j in range(k + 1)])
        rep = [r for r in active for _ in range(k + 1)]
        rand = [i for i, r in enumerate(rep) if r.sampling_params.temperature >= GREEDY_EPS]
        if rand:
            logits[rand] = filtered_probs(logits[rand], [rep[i] for i in rand])
        greedy = torch.tensor([r.sampling_params.temperature < GREEDY_EPS for r in active])
        out, na = sample(logits.view(len(active), k + 1, -1), torch.from_numpy(drafts), greedy,
                         RowDraws(active, k, sampler, CPU))
        accepted += na
        for r, toks in zip(active, out):
            assert min(toks) >= 0  # a placeholder is never emitted
            for t in toks[:n - r.num_output_tokens]:
                r.append_output_token(t)
    return [r.output_token_ids for r in reqs], accepted


def plain_generate(lm, reqs, n, sampler):
    while active := [r for r in reqs if r.num_output_tokens < n]:
        for r, t in zip(active, sampler(lm([r.all_token_ids for r in active]), active)[0]):
            r.append_output_token(t)
    return [r.output_token_ids for r in reqs]


def make(prompt, n=1, **sp):
    return [Request(f"r{i}", prompt, SamplingParams(max_tokens=64, **sp)) for i in range(n)]


def test_greedy_equals_plain_greedy_token_for_token():
    lm, k, prompts = table_lm(0), 3, [[1, 3, 5, 1, 3, 5, 1, 3], [3, 3, 3], [7, 2, 9, 4, 7, 2, 9]]
    ref = plain_generate(lm, [make(p, temperature=0.0)[0] for p in prompts], 40, Sampler(CPU, 0))
    rng, ng = np.random.default_rng(1), NgramProposer(SpeculativeConfig(k, prompt_lookup_min=1, prompt_lookup_max=3))

    def drafts(r):  # n-gram drafts, the right tokens, random ones, token 0 (then placeholders), by turns
        right = ref[prompts.index(r.prompt_token_ids)][r.num_output_tokens:][:k]
        return [ng.propose(np.array(r.all_token_ids)), right, rng.integers(0, 16, k), [0, 0, 0]][rng.integers(4)]
    got, acc = spec_generate(lm, [make(p, temperature=0.0)[0] for p in prompts], 40, k, drafts, None)
    assert got == ref and 0 in sum(ref, []) and max(acc) == k and min(acc) == 0
    logits = torch.tensor([[[5.0, 1, 0], [0, 4, 1], [9, 0, 0]]])  # argmax 0, 1, 0: a draft of 0 is accepted
    for d, want in (([0, 1], [[0, 1, 0]]), ([0, PH], [[0, 1]]), ([PH, 1], [[0]]), ([1, 1], [[0]])):
        assert rejection_sample(logits, torch.tensor([d]), torch.tensor([True]))[0] == want


def test_seeded_rows_equal_plain_sampling_and_ignore_the_batch():
    """A seeded request's stream is consumed one uniform per emitted token: the same tokens as without
    speculation, for any K and drafts, alone or among other rows."""
    lm, prompt, sp = table_lm(3), [2, 5, 2, 5, 2], dict(temperature=0.9, top_k=8)
    ref = plain_generate(lm, make(prompt, seed=1234, **sp), 30, Sampler(CPU, 0))[0]
    def oracle(r):
        return ref[r.num_output_tokens:][:3] if r.num_output_tokens % 3 else [4, 4]  # right, then wrong
    for k in (0, 1, 3):  # K = 0: one uniform per step, as the plain sampler
        g = Sampler(CPU, 0)  # the engine's generator seeded 0, and the seeded rows' own generators
        alone, acc = spec_generate(lm, make(prompt, seed=1234, **sp), 30, k, oracle, g)
        mixed = make(prompt, 2, **sp) + make(prompt, seed=1234, **sp) + make(prompt, temperature=0.0) + make(
            [1, 2], seed=99, **sp)
        assert alone[0] == spec_generate(lm, mixed, 30, k, oracle, g)[0][2] == ref and max(acc) == k and min(acc) == 0
    assert plain_generate(lm, make(prompt, seed=4321, **sp), 30, Sampler(CPU, 0))[0] != ref


def sf(df: float, stat: float) -> float:  # the chi-square survival function
    return torch.special.gammaincc(torch.tensor(df / 2), torch.tensor(stat / 2)).item()


def chi2_p(a: Counter, b: Counter) -> float:
    """Two-sample chi-square (homogeneity) p-value over the cells of a and b; cells expected < 5 are pooled."""
    x = np.array([(a[c], b[c]) for c in set(a) | set(b)], float)
    small = (x.sum(1) * x.sum(0).min() / x.sum()) < 5
    x = np.vstack([x[~small], x[small].sum(0, keepdims=True)]) if small.any() else x
    e = x.sum(1, keepdims=True) * x.sum(0) / x.sum()
    return sf(len(x) - 1, float(((x - e) ** 2 / e).sum()))


def accept_always(probs, drafts, greedy, draws):  # wrong: every real draft is taken
    t, n = target_tokens(probs, greedy, draws.u).tolist(), (drafts >= 0).int().cumprod(1).sum(1).tolist()
    return [d[:m] + [row[m]] for d, row, m in zip(drafts.tolist(), t, n)], n


def residual_keeps_draft(probs, drafts, greedy, draws):  # wrong: a rejected draft is drawn again from the full p_j
    p_d = probs[:, :-1].gather(2, drafts.clamp(min=0)[..., None])[..., 0] * (drafts >= 0)
    n = (draws.u[:, :-1] < p_d).int().cumprod(1).sum(1)
    fresh = torch.rand(len(n), generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    last = inverse_cdf(probs[torch.arange(len(n)), n], fresh).tolist()
    return [d[:m] + [x] for d, x, m in zip(drafts.tolist(), last, n.tolist())], n.tolist()


def first_two(sample, n=20000, k=2):
    """The first two tokens of n unseeded requests under top_k = 6 of 16 (36 cells), drafts mixing the greedy
    continuation, random ids (often outside the top 6), token 0 and placeholders; and the exact law."""
    lm, prompt, sp, rng = table_lm(5), [4, 9], SamplingParams(temperature=0.9, top_k=6), np.random.default_rng(2)

    def drafts(r):
        h = r.all_token_ids[-2:]
        g = [lm.next[h[0]][h[1]]]
        g.append(lm.next[h[1]][g[0]])  # pad_drafts cuts to k
        return [g, rng.integers(0, 16, k), g[:1], [PH, g[1]], [0] + g[:1]][rng.integers(5)]
    reqs = [Request(f"r{i}", prompt, sp) for i in range(n)]
    out = (plain_generate(lm, reqs, 2, Sampler(CPU, 1)) if sample is None else
           spec_generate(lm, reqs, 2, k, drafts, Sampler(CPU, 4), sample)[0])
    p0 = filtered_probs(lm([prompt]), reqs[:1])[0]
    p1 = filtered_probs(lm([prompt + [t] for t in range(16)]), reqs[:16])
    p0, p1 = p0 / p0.sum(), p1 / p1.sum(-1, keepdim=True)  # each row comes up to its own factor
    return Counter(tuple(o) for o in out), {(a, b): n * float(p0[a] * p1[a, b]) for a in range(16)
                                            for b in range(16) if p0[a] * p1[a, b] > 0}


def test_first_two_tokens_match_plain_sampling_by_chi_square_with_power():
    """K = 1 puts the bonus token second, K = 2 a second draft; the wrong rules must fail the very same test."""
    plain, _ = first_two(None)
    for k in (1, 2):
        spec, exact = first_two(rejection_sample, k=k)
        assert len(exact) == 36 and set(spec) <= set(exact) and set(plain) <= set(exact)
        assert chi2_p(spec, plain) >= 0.01
        assert sf(35, sum((spec[c] - e) ** 2 / e for c, e in exact.items())) >= 0.01  # and the exact law
    for wrong in (accept_always, residual_keeps_draft):
        assert chi2_p(first_two(wrong)[0], plain) < 1e-6, wrong.__name__
