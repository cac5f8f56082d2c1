"""bench: metric definitions on synthetic timestamps, the arrival process, datasets, flag errors."""
import json
import math

import numpy as np
import pytest

from pdserve.bench.arrivals import arrival_offsets
from pdserve.bench.datasets import jsonl_dataset, random_dataset
from pdserve.bench.metrics import RequestResult, compute_metrics, format_metrics, parse_goodput, summarize
from pdserve.bench.report import CPU_CAVEAT, format_table
from pdserve.bench.server_metrics import GraphSnapshot, means_ms


def req(ttft, gaps, tokens=None, prompt_len=10):
    return RequestResult(success=True, prompt_len=prompt_len, output_tokens=tokens or len(gaps) + 1, ttft=ttft,
                         itl=list(gaps), latency=ttft + sum(gaps))


def test_ttft_tpot_itl_e2el_follow_vllm_definitions():
    a = req(0.100, [0.010, 0.030])  # 3 tokens: TPOT = (0.14 - 0.1) / 2 = 20 ms
    b = req(0.300, [0.050])  # 2 tokens: TPOT = 50 ms
    c = req(0.200, [], tokens=1)  # one token: no TPOT, no ITL
    m = compute_metrics([a, b, c], duration_s=2.0)
    assert m.completed == 3 and m.failed == 0
    assert m.ttft_ms["mean"] == pytest.approx(200.0) and m.ttft_ms["median"] == pytest.approx(200.0)
    assert m.tpot_ms["mean"] == pytest.approx(35.0)  # only a and b
    assert m.itl_ms["mean"] == pytest.approx(30.0)  # pooled gaps 10, 30, 50
    assert m.e2el_ms["median"] == pytest.approx(200.0)  # 140, 350, 200 ms
    assert m.total_output_tokens == 6 and m.total_input_tokens == 30
    assert m.request_throughput == pytest.approx(1.5) and m.output_throughput == pytest.approx(3.0)
    assert m.total_token_throughput == pytest.approx(18.0)
    assert m.request_goodput is None


def test_peak_throughput_and_concurrency_count_per_second_buckets_as_vllm():
    """One-second buckets from the first send (times exact in binary, so none lands on an edge by rounding)."""
    def at(start, ttft, gaps):
        return RequestResult(success=True, prompt_len=1, output_tokens=len(gaps) + 1, ttft=ttft, itl=list(gaps),
                             latency=ttft + sum(gaps), start=start)
    a = at(10.0, 0.25, [0.25, 0.25, 0.5])  # chunks at +0.25 +0.5 +0.75 | +1.25; in flight over buckets 0, 1
    b = at(10.5, 0.125, [0.125] * 3)  # +0.625 +0.75 +0.875 | +1.0 (a chunk on the edge is the later bucket's)
    c = at(11.125, 0.125, [])  # +1.25, sent after b's end: in bucket 1 with a and b, never 3 at one instant
    d = at(12.5, 0.5, [0.5, 0.25])  # +3.0 +3.5 +3.75: no chunk in bucket 2
    m = compute_metrics([a, b, c, d, RequestResult(error="HTTP 500: boom", start=10.0)], 4.0)
    assert (m.max_output_tokens_per_s, m.max_concurrent_requests) == (6.0, 3)  # bucket 0: 3 + 3 chunks
    text = format_metrics(m)
    assert "Peak output token throughput (tok/s):" in text and "6.00" in text and "Peak concurrent requests:" in text
    assert m.to_dict()["max_output_tokens_per_s"] == 6.0 and m.to_dict()["max_concurrent_requests"] == 3
    # one chunk of several tokens counts once, as vLLM's; no success: 0 and 0, as vLLM
    assert compute_metrics([at(0.0, 0.5, [0.25])], 1.0).max_output_tokens_per_s == 2.0
    none = compute_metrics([RequestResult(error="x")], 1.0)
    assert (none.max_output_tokens_per_s, none.max_concurrent_requests) == (0.0, 0)


def test_percentiles_interpolate_linearly():
    s = summarize([i / 1000 for i in range(1, 101)])  # 1..100 ms
    assert s["median"] == pytest.approx(50.5) and s["p90"] == pytest.approx(90.1) and s["p99"] == pytest.approx(99.01)
    assert s["mean"] == pytest.approx(50.5)
    assert all(math.isnan(v) for v in summarize([]).values())


def test_failed_requests_are_counted_not_measured():
    bad = RequestResult(error="HTTP 500: boom")
    m = compute_metrics([req(0.1, [0.01]), bad], duration_s=1.0)
    assert (m.completed, m.failed) == (1, 1) and m.error_summary == ["HTTP 500: boom"]
    assert m.ttft_ms["mean"] == pytest.approx(100.0)


def test_goodput_counts_requests_meeting_every_slo():
    slos = parse_goodput(["ttft:150", "tpot:25"])
    assert slos == {"ttft": 0.15, "tpot": 0.025}
    rs = [req(0.100, [0.020, 0.020]),  # good
          req(0.100, [0.040]),  # TPOT 40 ms: too slow
          req(0.200, [0.010]),  # TTFT too slow
          req(0.120, [], tokens=1)]  # no TPOT: only TTFT applies, good
    assert compute_metrics(rs, 2.0, slos).request_goodput == pytest.approx(1.0)
    for bad in (["itl:5"], ["ttft"], ["ttft:-1"], ["ttft:abc"]):
        with pytest.raises(ValueError, match="--goodput"):
            parse_goodput(bad)


@pytest.mark.parametrize("burstiness", [1.0, 0.5, 4.0])
def test_arrivals_have_the_rate_and_burstiness_asked_for(burstiness):
    t = np.array(arrival_offsets(20000, rate=50.0, burstiness=burstiness, seed=1))
    gaps = np.diff(t, prepend=0.0)  # the first request waits its gap too, as vLLM
    assert t[0] > 0 and np.all(gaps >= 0)
    assert 1 / gaps.mean() == pytest.approx(50.0, rel=0.03)
    cv2 = gaps.var() / gaps.mean() ** 2  # a gamma process with shape k has CV^2 = 1/k
    assert cv2 == pytest.approx(1 / burstiness, rel=0.08)
    assert t[-1] == pytest.approx(20000 / 50.0)  # rescaled as vLLM: the last send lands at n / rate
    assert arrival_offsets(5, 50.0, burstiness, seed=1) == arrival_offsets(5, 50.0, burstiness, seed=1)  # seeded


def test_small_runs_keep_the_rate():
    """n gaps of mean 1/rate, not n - 1 gaps stretched over n/rate (that ran 8 requests 12% slow)."""
    for seed in range(50):
        t = arrival_offsets(4, 2.0, seed=seed)
        assert t[0] > 0 and np.diff(t, prepend=0.0).mean() == pytest.approx(0.5)


def test_arrivals_edge_cases():
    assert arrival_offsets(3, math.inf) == [0.0, 0.0, 0.0]
    assert arrival_offsets(4, 2.0, burstiness=math.inf) == [0.5, 1.0, 1.5, 2.0]  # constant gaps, as vLLM
    with pytest.raises(ValueError, match="--burstiness"):
        arrival_offsets(3, 1.0, burstiness=0)
    with pytest.raises(ValueError, match="--request-rate"):
        arrival_offsets(3, 0.0)


def test_random_lengths_span_floor_to_ceil():
    """As vLLM: [floor(mean (1 - r)), ceil(mean (1 + r))]; truncating both ends drew a mean of 9.5 for 10."""
    from pdserve.bench.datasets import _lengths
    lens = _lengths(np.random.default_rng(0), 20000, 10, 0.25)
    assert (lens.min(), lens.max()) == (7, 13) and lens.mean() == pytest.approx(10.0, abs=0.05)


def test_random_dataset_lengths_and_determinism(qwen3_tiny):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(qwen3_tiny)
    a = random_dataset(tok, 8, input_len=64, output_len=16, range_ratio=0.25, seed=3)
    assert a == random_dataset(tok, 8, input_len=64, output_len=16, range_ratio=0.25, seed=3)
    assert len({s.prompt for s in a}) == 8
    for s in a:
        assert 12 <= s.output_len <= 20
        assert s.prompt_len == len(tok.encode(s.prompt)) and 48 <= s.prompt_len <= 80
        assert not set(tok.encode(s.prompt, add_special_tokens=False)) & set(tok.all_special_ids)


def test_random_prefix_is_shared_and_adds_to_the_input_len(qwen3_tiny):
    """--random-prefix-len: every prompt (warm-up ones too) starts with the same text, the prefix counting on top
    of --random-input-len as vLLM's."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from pdserve.bench.datasets import random_prefix
    from pdserve.bench.serve import _samples
    tok = AutoTokenizer.from_pretrained(qwen3_tiny)
    prefix = random_prefix(tok, 40, seed=5)
    assert len(prefix) == 40 and prefix == random_prefix(tok, 40, seed=5) != random_prefix(tok, 40, seed=6)
    assert random_prefix(tok, 0) == []
    args = SimpleNamespace(dataset="random", num_prompts=6, warmup=2, random_input_len=16, random_output_len=4,
                           random_range_ratio=0.0, seed=5, dataset_path=None, random_prefix_len=40)
    measured, warm = _samples(args, tok)
    head = tok.decode(prefix)
    assert all(s.prompt.startswith(head) for s in measured + warm) and len({s.prompt for s in measured + warm}) == 8
    assert all(s.prompt_len == 56 for s in measured)  # 40 + 16
    with pytest.raises(ValueError, match="--random-prefix-len"):
        random_prefix(tok, -1)


@pytest.mark.parametrize("prefix_len", [0, 7])
def test_random_prompts_hit_their_token_count_exactly(qwen3_tiny, prefix_len):
    """Random ids decoded then re-encoded can merge or split (a lone byte of a multi-byte character decodes to
    U+FFFD, three bytes again): one cut left ~2% of the tiny tokenizer's prompts a token or two over. Every prompt
    now encodes to exactly its target, as the server counts it, with the shared prefix's ids first."""
    from transformers import AutoTokenizer

    from pdserve.bench.datasets import random_prefix
    tok = AutoTokenizer.from_pretrained(qwen3_tiny)
    for seed in range(3):
        prefix = random_prefix(tok, prefix_len, seed)
        for n in (1, 2, 3, 5, 17, 64, 255):
            for s in random_dataset(tok, 40, n, 2, seed=seed, prefix=prefix):
                ids = tok.encode(s.prompt)
                assert len(ids) == s.prompt_len == prefix_len + n and ids[:prefix_len] == prefix, (seed, n, s)


def test_a_bos_the_server_adds_counts_in_the_input_len(qwen3_tiny):
    """As vLLM: the tokens a completions server adds (a BOS, as Llama-3's tokenizer) are prompt tokens, so one
    fewer is drawn; the prompt was a token over, and prompt_len (without the BOS) did not say so."""
    from tokenizers import processors
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(qwen3_tiny)
    bos = tok.all_special_tokens[0]
    tok._tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", special_tokens=[(bos, tok.convert_tokens_to_ids(bos))])
    assert tok.num_special_tokens_to_add() == 1
    for n in (2, 9, 64):
        assert all(len(tok.encode(s.prompt)) == s.prompt_len == n for s in random_dataset(tok, 20, n, 2, seed=n))
    assert {s.prompt_len for s in random_dataset(tok, 5, 1, 2)} == {2}  # never an empty prompt


def test_jsonl_dataset(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"prompt": "hello", "output_len": 5}) + "\n\n" + json.dumps({"text": "bye"}) + "\n")
    rows = jsonl_dataset(str(f), 3, output_len=7)
    assert [(r.prompt, r.output_len) for r in rows] == [("hello", 5), ("bye", 7), ("hello", 5)]
    f.write_text("{not json}\n")
    with pytest.raises(ValueError, match="p.jsonl:1"):
        jsonl_dataset(str(f), 1, 7)


def _row(arm, rate, share, tpot, device="cpu"):
    return {"arm": arm, "rate": rate, "isl": 64, "osl": 16, "completed": 4, "failed": 0, "non_full_share": share,
            "non_full_steps": 1, "full_steps": 9, "non_full_reasons": {"prefill": 1} if share else {},
            "device": device, "mean_tpot_ms": tpot, "p99_tpot_ms": tpot, "p99_itl_ms": tpot, "median_ttft_ms": tpot}


def test_table_compares_with_strict_on_gpu_and_only_pd_vs_collocated_on_cpu():
    rows = [_row("collocated", 2, 0.1, 10.0), _row("strict", 2, 0.2, 20.0), _row("default", 2, 0.0, 15.0)]
    cpu = format_table(rows)
    assert CPU_CAVEAT in cpu and "15.00 (+50%)" in cpu and "20.00 (+100%)" in cpu  # against collocated
    gpu = format_table([dict(r, device="cuda") for r in rows])
    assert CPU_CAVEAT not in gpu and "15.00 (-25%)" in gpu and "10.00 (-50%)" in gpu  # against strict
    assert "20.00 (" not in gpu  # strict is the reference itself
    assert "0.0% (-20.0 pp)" in gpu and "(+" not in cpu.split("\n")[3].split("%")[0]


def test_server_counters_are_differenced_over_the_run():
    from collections import Counter
    before = GraphSnapshot(Counter({("FULL", "none"): 10, ("NONE", "prefill"): 4}), "cpu")
    after = GraphSnapshot(Counter({("FULL", "none"): 40, ("NONE", "prefill"): 14, ("PIECEWISE", "too_many_tokens"): 0}),
                          "cpu")
    s = (after - before).summary()
    assert (s["full_steps"], s["non_full_steps"]) == (30, 10) and s["non_full_share"] == pytest.approx(0.25)
    assert s["non_full_reasons"] == {"prefill": 10}
    split = means_ms({"kv_transfer": (1.0, 10), "total": (5.0, 10)},
                          {"kv_transfer": (1.3, 13), "total": (5.6, 13), "prefill": (0.09, 3)})
    assert split == pytest.approx({"kv_transfer": 100.0, "total": 200.0, "prefill": 30.0})


def test_gap_medians_take_each_requests_first_gap_apart():
    from pdserve.bench.metrics import gap_medians
    got = gap_medians([[0.009, 0.002, 0.003], [0.007], [], [0.011, 0.001]])  # a one-token request has no gap
    assert got == pytest.approx({"first_gap_median_ms": 9.0, "other_gaps_median_ms": 2.0})
    assert gap_medians([[], []]) == {"first_gap_median_ms": None, "other_gaps_median_ms": None}


def test_phases_add_up_the_decode_nodes_histograms(monkeypatch):
    """scrape_phases: vLLM's queue and prefill histograms summed over every decode node (the router's own
    histograms and other series left out), then differenced over the run as the router's split is."""
    from prometheus_client.parser import text_string_to_metric_families

    from pdserve.bench import server_metrics

    def page(queue_sum, queue_n, prefill_sum, prefill_n):
        out = []
        for name, total, n in (("queue", queue_sum, queue_n), ("prefill", prefill_sum, prefill_n)):
            out += [f"# TYPE vllm:request_{name}_time_seconds histogram",
                    f'vllm:request_{name}_time_seconds_bucket{{le="+Inf",model_name="m"}} {n}',
                    f'vllm:request_{name}_time_seconds_count{{model_name="m"}} {n}',
                    f'vllm:request_{name}_time_seconds_sum{{model_name="m"}} {total}']
        return "\n".join(out + ["# TYPE vllm:e2e_request_latency_seconds histogram",
                                  'vllm:e2e_request_latency_seconds_count{model_name="m"} 99',
                                  'vllm:e2e_request_latency_seconds_sum{model_name="m"} 9.9']) + "\n"
    pages = {"http://d0": page(0.01, 2, 0.004, 2), "http://d1": page(0.02, 3, 0.006, 3)}
    monkeypatch.setattr(server_metrics, "_families",
                        lambda url, timeout: list(text_string_to_metric_families(pages[url])))
    before = server_metrics.scrape_phases(list(pages))
    assert {k: (pytest.approx(t), n) for k, (t, n) in before.items()} == {"queue": (0.03, 5), "prefill": (0.01, 5)}
    pages = {"http://d0": page(0.016, 4, 0.008, 4), "http://d1": page(0.032, 6, 0.012, 6)}
    assert means_ms(before, server_metrics.scrape_phases(list(pages))) == pytest.approx(
        {"queue": 3.6, "prefill": 2.0})  # (0.048 - 0.03) s over 5 requests; (0.02 - 0.01) over 5
    pages = {"http://d0": "# TYPE other counter\nother_total 1\n"}
    assert server_metrics.scrape_phases(list(pages)) is None  # another engine: nothing to report


def test_warmup_leaves_the_measured_prompts_alone(qwen3_tiny):
    """Warm-up prompts were the first of the measured stream, so --warmup changed what was measured."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from pdserve.bench.serve import _samples
    tok = AutoTokenizer.from_pretrained(qwen3_tiny)
    args = dict(dataset="random", num_prompts=3, random_input_len=16, random_output_len=6, random_range_ratio=0.5,
                seed=0, dataset_path=None, random_prefix_len=0)
    cold, none = _samples(SimpleNamespace(warmup=0, **args), tok)
    measured, warm = _samples(SimpleNamespace(warmup=2, **args), tok)
    assert none == [] and measured == cold and len(warm) == 2 and not set(warm) & set(measured)


def test_ignore_eos_defaults_on_for_random_prompts(qwen3_tiny, monkeypatch):
    """As vLLM's client: a random prompt's drawn output length is what it gets, unless --no-ignore-eos."""
    import argparse

    from pdserve.bench import serve
    p = argparse.ArgumentParser()
    serve.add_bench_serve_args(p)
    seen = []
    monkeypatch.setattr(serve, "_model_name", lambda args: "m")
    monkeypatch.setattr(serve, "_run", lambda specs, *a: seen.append(specs) or (_ for _ in ()).throw(SystemExit))
    for flags, want in (([], True), (["--no-ignore-eos"], False)):
        args = p.parse_args(["--tokenizer", str(qwen3_tiny), "--num-prompts", "2", "--random-input-len", "8",
                             "--metrics-url", "http://127.0.0.1:9", *flags])
        with pytest.raises(SystemExit):
            serve.run_bench_serve(args, quiet=True)
        assert all(s.ignore_eos is want for s in seen[-1])


def test_chosen_percentiles_and_metrics():
    """vLLM's --percentile-metrics / --metric-percentiles: keys spelt as vLLM's (p99.9), only the chosen metrics
    printed and under the flat keys."""
    from pdserve.bench.metrics import parse_percentiles
    names, ps = parse_percentiles("ttft,itl", "50,99.9")
    assert names == ("ttft", "itl") and ps == (50.0, 99.9)
    s = summarize([i / 1000 for i in range(1, 101)], ps)
    assert set(s) == {"mean", "median", "std", "p50", "p99.9"} and s["p99.9"] == pytest.approx(99.901)
    m = compute_metrics([req(0.1, [0.01, 0.02])], 1.0, percentiles=ps)
    text = format_metrics(m, metrics=names)
    assert "P99.9 TTFT (ms):" in text and "ITL" in text and "TPOT" not in text and "E2EL" not in text
    assert "p99.9_itl_ms" in m.vllm_keys(names) and "mean_tpot_ms" not in m.vllm_keys(names)
    for bad in (("ttft,foo", "99"), ("", "99"), ("ttft", "0"), ("ttft", "101"), ("ttft", "x")):
        with pytest.raises(ValueError, match="--percentile-metrics" if "foo" in bad[0] or not bad[0]
                           else "--metric-percentiles"):
            parse_percentiles(*bad)


def test_itl_tail_finds_the_gaps_another_request_arrived_in():
    """A decodes at 2 ms a token but one gap of 8 ms, during which B was sent: that is the one arrival gap and the
    whole p99 tail. B's own send falls in its first gap's window and does not count; a send up to `before_s` before
    a gap does; without send times there is nothing to say."""
    from pdserve.bench.metrics import itl_tail
    a_gaps = [0.002, 0.002, 0.008] + [0.002] * 17  # A's tokens at 10, 12, 14, 22, 24 ... ms
    starts, ttfts, itls = [0.0, 0.016], [0.010, 0.002], [a_gaps, [0.002, 0.002, 0.002]]  # B's at 18, 20, 22, 24 ms
    got = itl_tail(starts, ttfts, itls)
    assert got["arrival_gap_share"] == pytest.approx(1 / 23)
    assert got["arrival_gaps_in_p99_tail"] == 1.0 and got["first_gaps_in_p99_tail"] == 0.0
    assert got["arrival_gap_median_ms"] == pytest.approx(8.0)
    assert got["p99_itl_without_arrival_gaps_ms"] == pytest.approx(2.0)
    # a third request sent at 30.5 ms, inside A's gap (30, 32] and 1.5 ms before its gap (32, 34]: the second counts
    # within the 3 ms window, not within 1 ms
    late = itl_tail(starts + [0.0305], ttfts + [0.5], itls + [[]])
    assert late["arrival_gap_share"] == pytest.approx(3 / 23)
    assert itl_tail(starts + [0.0305], ttfts + [0.5], itls + [[]], before_s=0.001)["arrival_gap_share"] == \
        pytest.approx(2 / 23)
    assert set(itl_tail(None, ttfts, itls).values()) == {None}
    assert set(itl_tail(starts, ttfts, [[], []]).values()) == {None}
