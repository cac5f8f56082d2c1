"""The batched sampler against a row-by-row reference (the straightforward form of each rule)."""
from __future__ import annotations

import random

import pytest
import torch

import pdserve.model.probs as probs_mod
from pdserve.model.probs import filtered_probs, inverse_cdf
from pdserve.model.sampler import Sampler, logprobs_of
from pdserve.request import Request
from pdserve.sampling_params import SamplingParams

V = 97


def ref_penalties(logits, r):
    sp, x = r.sampling_params, logits.clone()
    if sp.allowed_token_ids is not None:  # first, as vLLM
        keep = torch.zeros(V, dtype=torch.bool)
        keep[sp.allowed_token_ids] = True
        x[~keep] = float("-inf")
    if r.num_output_tokens < sp.min_tokens:
        banned = list(sp.stop_token_ids) + ([] if sp.ignore_eos else list(r.eos_token_ids))
        x[banned] = float("-inf")
    for t, b in (sp.logit_bias or {}).items():  # after the ban, before the penalties, as vLLM
        x[t] += b
    if sp.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(r.all_token_ids)))
        v = x[seen]
        x[seen] = torch.where(v > 0, v / sp.repetition_penalty, v * sp.repetition_penalty)
    if (sp.presence_penalty or sp.frequency_penalty) and r.output_token_ids:
        ids, counts = torch.tensor(r.output_token_ids).unique(return_counts=True)
        x[ids] -= sp.frequency_penalty * counts.to(x.dtype) + sp.presence_penalty
    return x


def ref_probs(logits, sp):
    x = logits / sp.temperature
    if 0 < sp.top_k < V:
        x = x.masked_fill(x < x.sort(descending=True).values[sp.top_k - 1], float("-inf"))
    if sp.top_p < 1.0:  # the smallest prefix of the sorted tokens whose mass reaches top_p
        srt, order = x.sort(descending=True)
        p = srt.softmax(-1)
        drop = torch.zeros(V, dtype=torch.bool).scatter(0, order, (p.cumsum(-1) - p) >= sp.top_p)
        x = x.masked_fill(drop, float("-inf"))
    probs = x.softmax(-1)
    if sp.min_p > 0:
        probs = probs.masked_fill(probs < sp.min_p * probs.max(), 0.0)
    return probs


def random_request(rng, i):
    sp = SamplingParams(temperature=rng.choice([0.0, 0.7, 1.3]), top_k=rng.choice([0, 1, 5, 40]),
                        top_p=rng.choice([1.0, 0.9, 0.3]), min_p=rng.choice([0.0, 0.1]),
                        repetition_penalty=rng.choice([1.0, 1.1, 0.8]), presence_penalty=rng.choice([0.0, 0.5]),
                        frequency_penalty=rng.choice([0.0, -0.3]), min_tokens=rng.choice([0, 3]),
                        stop_token_ids=rng.choice([[], [5, 6]]), seed=rng.choice([None, 7 + i]), max_tokens=50,
                        logprobs=rng.choice([None, 0, 3]),
                        logit_bias=rng.choice([None, None, {3: 2.5, "7": -100, 11: 150.0, 5: 1}]),
                        allowed_token_ids=rng.choice([None, None, [1, 3, 5, 6, 7, 40, 41, 96]]))
    return Request(f"r{i}", [rng.randrange(V) for _ in range(rng.randint(1, 20))], sp, frozenset({1}))


@pytest.mark.parametrize("candidates", [2, 64])  # 2: nearly every filtered row takes the full sort
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_penalties_and_filters_equal_the_reference_over_steps(monkeypatch, candidates, dtype):
    """Both paths (numpy on CPU, torch on a device) against the row-by-row reference, step after step."""
    monkeypatch.setattr(probs_mod, "TOP_CANDIDATES", candidates)
    rng, sampler = random.Random(0), Sampler(torch.device("cpu"), 0)
    reqs = [random_request(rng, i) for i in range(24)]
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else {}
    for _ in range(6):  # counts are kept across steps: each step only adds what was appended
        logits = torch.randn(len(reqs), V, dtype=dtype) * 3
        want = torch.stack([ref_penalties(logits[i], r) for i, r in enumerate(reqs)])
        got = sampler._apply_penalties(logits.clone(), reqs, list(range(len(reqs))))
        strided = logits.t().contiguous().t()  # a non-contiguous tensor takes the torch path
        got_torch = sampler._apply_penalties(strided, reqs, list(range(len(reqs))))
        assert torch.allclose(got, want, **tol) and torch.equal(got, got_torch)
        rand = [r for r in reqs if r.sampling_params.temperature > 0]
        rows = [i for i, r in enumerate(reqs) if r.sampling_params.temperature > 0]
        want = torch.stack([ref_probs(got[i], r.sampling_params) for i, r in zip(rows, rand)])
        for device_path in (False, True):
            p = filtered_probs(got[rows].clone(), rand, device_path=device_path)  # each row up to its own factor
            assert torch.allclose(p / p.sum(-1, keepdim=True), want / want.sum(-1, keepdim=True), **tol)
        for r in reqs:
            r.append_output_token(rng.randrange(V))


def test_host_and_device_paths_agree_on_a_real_vocabulary():
    """numpy (CPU) and torch (device) filters keep the same tokens and the inverse CDF draws the same ones, for
    peaked rows (the threshold among the top candidates), flat rows and top-k past the candidates (the full sort),
    top-k alone, top-p alone, both, with min-p; and a subset of rows filtered as in the whole batch."""
    g = torch.Generator().manual_seed(5)
    vocab, n = 1000, 48
    logits = torch.randn(n, vocab, generator=g) * torch.tensor([0.3, 1.0, 6.0]).repeat(n // 3)[:, None]
    mk = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m, max_tokens=5)
          for t, k, p, m in [(0.7, 0, 0.9, 0.0), (1.0, 100, 1.0, 0.0), (1.3, 20, 0.5, 0.0), (0.9, 0, 1.0, 0.05)]]
    reqs = [Request(f"r{i}", [1], mk[i % 4]) for i in range(n)]
    host = filtered_probs(logits.clone(), reqs)
    dev = filtered_probs(logits.clone(), reqs, device_path=True)
    assert torch.equal(host > 0, dev > 0)
    assert torch.allclose(host / host.sum(-1, keepdim=True), dev / dev.sum(-1, keepdim=True), atol=1e-6)
    for _ in range(20):
        u = torch.rand(n, generator=g, dtype=torch.float64)
        assert torch.equal(inverse_cdf(host, u), inverse_cdf(host, u, device_path=True))
    rows = [1, 4, 7]
    assert torch.equal(filtered_probs(logits[rows].clone(), [reqs[i] for i in rows]) > 0, host[rows] > 0)


def test_bad_words_ban_the_token_that_would_complete_them():
    """vLLM's rule over the output (and a speculative position's earlier drafts): a one-token word is always
    banned, a longer one only where the output ends with all but its last token."""
    from pdserve.model.sampler import _bad_word_ends
    words = [[7], [6, 8], [5, 6, 9], [1, 2], [4, 5, 6, 10], [3, 11]]
    assert _bad_word_ends(words, [5, 6], []) == [7, 8, 9]
    assert _bad_word_ends(words, [4, 5], [6]) == [7, 8, 9, 10]  # the drafts count as emitted
    assert _bad_word_ends(words, [], [3]) == [7, 11] and _bad_word_ends(words, [], []) == [7]
    sp = SamplingParams(temperature=0.0, max_tokens=9, bad_words=["any"])
    r = Request("r", [1, 2], sp)
    r.bad_words_token_ids = words
    for t in (5, 6):
        r.append_output_token(t)
    logits = torch.zeros(1, V)
    logits[0, 9] = 5.0  # greedy's pick, banned after 5, 6
    tokens, _ = Sampler(torch.device("cpu"), 0)(logits, [r])
    assert tokens[0] not in (7, 8, 9)
    out = Sampler(torch.device("cpu"), 0)._apply_penalties(torch.zeros(1, V), [r], [0])
    assert (out[0] == float("-inf")).nonzero().flatten().tolist() == [7, 8, 9]


def test_greedy_rows_take_the_penalised_argmax_and_logprobs_are_raw():
    rng, sampler = random.Random(1), Sampler(torch.device("cpu"), 0)
    reqs = [random_request(rng, i) for i in range(16)]
    logits = torch.randn(len(reqs), V) * 3
    tokens, lps = sampler(logits, reqs)
    for i, r in enumerate(reqs):
        sp = r.sampling_params
        if sp.temperature == 0:
            assert tokens[i] == int(ref_penalties(logits[i], r).argmax())
        if sp.logprobs is None:
            assert lps[i] is None
            continue
        lp = logits[i].log_softmax(-1)
        assert lps[i][tokens[i]].rank == int((lp > lp[tokens[i]]).sum()) + 1
        assert abs(lps[i][tokens[i]].logprob - float(lp[tokens[i]])) < 1e-6
        top = lp.topk(sp.logprobs).indices.tolist() if sp.logprobs else []
        assert set(lps[i]) == set(top) | {tokens[i]}


def test_seeded_rows_do_not_depend_on_the_batch():
    rng, cpu = random.Random(2), torch.device("cpu")
    others = [random_request(rng, i) for i in range(12)]
    sp = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=20)
    alone_s, together_s = Sampler(cpu, 0), Sampler(cpu, 9)
    a, b = Request("a", [1, 2, 3], sp), Request("b", [1, 2, 3], sp)
    alone, together = [], []
    for _ in range(10):
        logits = torch.randn(13, V)
        alone.append(alone_s(logits[12:], [a])[0][0])
        together.append(together_s(logits, others + [b])[0][-1])
    assert alone == together


def test_several_positions_per_row():
    """Rows that sample several positions (speculative decoding's 1 + K): each position follows its row's rules."""
    sampler = Sampler(torch.device("cpu"), 0)
    reqs = [Request("g", [3, 4], SamplingParams(temperature=0, max_tokens=5, logprobs=2)),
            Request("s", [3, 4], SamplingParams(temperature=0.8, top_k=3, max_tokens=5))]
    logits = torch.randn(5, V)
    tokens, lps = sampler(logits, reqs, row_of=[0, 0, 0, 1, 1])
    assert tokens[:3] == logits[:3].argmax(-1).tolist()
    assert all(t in logits[i].topk(3).indices.tolist() for i, t in zip((3, 4), tokens[3:]))
    assert [lp is not None for lp in lps] == [True, True, True, False, False]
    assert logprobs_of(logits[:1], tokens[:1], [2])[0].keys() == lps[0].keys()


def test_rows_without_a_finite_logit_do_not_fail_the_batch():
    """A row whose logits are all -inf (or NaN) under top-k / top-p samples something instead of raising (which
    failed every request of the step)."""
    reqs = [Request("a", [1], SamplingParams(temperature=0.8, top_k=5, max_tokens=3)),
            Request("b", [1], SamplingParams(temperature=0.8, top_p=0.5, max_tokens=3)),
            Request("c", [1], SamplingParams(temperature=0.8, top_k=5, top_p=0.9, max_tokens=3))]
    logits = torch.randn(3, V)
    logits[0] = float("-inf")
    logits[1] = float("nan")
    tokens, _ = Sampler(torch.device("cpu"), 0)(logits, reqs)
    assert len(tokens) == 3 and all(0 <= t < V for t in tokens)
    assert tokens[2] in logits[2].topk(5).indices.tolist()


@pytest.mark.parametrize("device_path", [False, True])
def test_inverse_cdf_draws_follow_the_distribution(device_path):
    """One uniform per row through the two-level inverse CDF: frequencies match the probabilities (chi-square over
    100,000 fixed-seed draws, no flake), zero-probability tokens are never taken, a vocabulary that is no multiple
    of the chunk and the ends of [0, 1) land on tokens with mass, a row with no mass takes its argmax."""
    from pdserve.model.probs import CDF_CHUNK

    def inverse_cdf(p, u):
        return probs_mod.inverse_cdf(p, u, device_path=device_path)
    g = torch.Generator().manual_seed(0)
    vocab = 3 * CDF_CHUNK + 5
    probs = torch.rand(vocab, generator=g) ** 4
    probs[::7] = 0.0  # some tokens impossible, among them the first and the chunk edges
    probs[vocab - 5:] = 0.0  # the padded tail chunk holds no mass at all
    probs[CDF_CHUNK - 1] = probs[CDF_CHUNK] = 0.0
    probs /= probs.sum()
    n = 100_000
    idx = inverse_cdf(probs.expand(n, vocab).contiguous(), torch.rand(n, generator=g, dtype=torch.float64))
    counts = torch.bincount(idx, minlength=vocab).double()
    assert counts[probs == 0].sum() == 0
    expected = probs.double() * n
    live = expected > 5
    chi2 = float(((counts[live] - expected[live]) ** 2 / expected[live]).sum())
    dof = int(live.sum()) - 1
    assert chi2 < dof + 4 * (2 * dof) ** 0.5, (chi2, dof)  # ~p 1e-4 on chi-square(dof): a wrong CDF is far off
    ends = torch.tensor([0.0, 1.0 - 2 ** -53], dtype=torch.float64)
    first, last = inverse_cdf(probs.expand(2, vocab).contiguous(), ends).tolist()
    nonzero = torch.nonzero(probs).flatten()
    assert (first, last) == (int(nonzero[0]), int(nonzero[-1]))
    nan = torch.full((1, vocab), float("nan"))
    assert 0 <= int(inverse_cdf(nan, torch.tensor([0.5], dtype=torch.float64))[0]) < vocab


def test_host_argmax_matches_torch():
    """numpy's argmax gives torch's: first of ties, NaN as the largest, -inf rows, non-contiguous input."""
    from pdserve.model.probs import argmax
    g = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, torch.float64):
        x = torch.randint(0, 4, (9, V), generator=g).to(dtype)  # many ties
        x[2, 40] = float("nan")
        x[3] = float("-inf")
        x[4, ::2] = float("-inf")
        assert torch.equal(argmax(x), x.argmax(-1))
        assert torch.equal(argmax(x[:, ::3]), x[:, ::3].argmax(-1))


@pytest.mark.parametrize("device_path", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_huge_temperature_keeps_the_min_tokens_ban(device_path, dtype):
    """A finite temperature whose inverse underflows (1e300 in float32 and float64 logits) still samples only
    allowed tokens: the banned EOS and stop ids stay out (before, -inf x 0 = NaN let the draw take them), and the
    rest come out about uniform, T's limit."""
    n = 400
    reqs = [Request(f"r{i}", [1], SamplingParams(temperature=1e300, min_tokens=5, stop_token_ids=[7], seed=i,
                                                 max_tokens=9), frozenset({3})) for i in range(n)]
    logits = torch.randn(n, V, generator=torch.Generator().manual_seed(0), dtype=dtype) * 4
    logits[:, 3] = logits[:, 7] = 30.0  # the banned tokens would win any draw that saw them
    banned = logits.clone()
    banned[:, [3, 7]] = float("-inf")  # as the sampler's min_tokens ban leaves them
    e = filtered_probs(banned, reqs, device_path=device_path)
    assert not e.isnan().any() and (e[:, [3, 7]] == 0).all() and (e[:, :3] > 0).all()
    tokens, _ = Sampler(torch.device("cpu"), 0)(logits, reqs)
    assert not {3, 7} & set(tokens) and len(set(tokens)) > V // 2


def test_sampler_state_lives_and_dies_with_its_request():
    """The sampler keeps a request's seeded stream across steps (a preempted request resumes it: the same object),
    drops it with the request, and never hands it to a later request that reuses the id."""
    import gc
    sampler, sp = Sampler(torch.device("cpu"), 0), SamplingParams(temperature=1.0, seed=7, max_tokens=9)
    logits = torch.zeros(1, V)
    r = Request("r", [1], sp)
    first = [sampler(logits, [r])[0][0] for _ in range(6)]
    assert len(sampler._states) == 1
    del r
    gc.collect()
    assert len(sampler._states) == 0
    again = Request("r", [1], sp)  # the same id: a fresh stream, the same tokens as the first request's
    assert [sampler(logits, [again])[0][0] for _ in range(6)] == first
