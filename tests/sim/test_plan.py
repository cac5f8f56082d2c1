"""`pdserve plan`: the ranking on profiles where the answer is known, the rate sweep, and the command line (SLOs and
lists refused naming the flag, --help on every flag, the files a run writes)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pdserve.cli import main
from pdserve.sim.connector import TransferModel
from pdserve.sim.plan import candidates, capacity, evaluate, plan_search, scale_trace, splits
from pdserve.sim.profile import profile_from_dict
from pdserve.sim.trace import TraceRequest, random_trace

from tests.sim.test_cli import _err


def roofline(flops_per_token: float) -> dict:
    """Decode steps memory-bound at 2 ms (2 GB of weights at 1 TB/s) up to 32 rows; a prompt token costs
    flops_per_token / 100 TFLOPs: 62.5 us at 6.25e9 (a 512-token prefill is 16 decode steps), 6.25 us at 6.25e8."""
    return {"type": "roofline", "gpu": {"memory_bandwidth_gb_s": 1000, "peak_tflops": 100},
            "model": {"kv_bytes_per_token": 1024, "weight_bytes": 2e9, "flops_per_token": flops_per_token,
                      "max_model_len": 2048},
            "step_overhead_s": {"FULL": 0.0, "PIECEWISE": 0.0, "NONE": 0.0}}


def _plan(profile: dict, slos: dict, max_num_seqs: int):
    trace = random_trace(200, 512, 64, 1.0, seed=0)
    return plan_search(candidates(splits(2), [max_num_seqs], [2048], [0], [0]), trace, profile_from_dict(profile),
                       {"max_model_len": 2048}, {}, slos, transfer=TransferModel(1e12, 0.0), policy="round-robin",
                       spec_acceptance=0.0, seed=0, rates=None, start_rate=0.5, max_rates=8)


def test_expensive_prefill_and_a_tight_tpot_rank_a_split_first():
    """Collocated, every prompt's prefill step (32 ms) lands in the middle of other requests' decoding and one is
    enough to break a 3 ms TPOT; a decode node that only decodes keeps it: 1P1D serves more good requests per node
    though only one of its nodes decodes."""
    ranked = _plan(roofline(6.25e9), {"tpot": 0.003, "ttft": 2.0}, 64)
    assert [e.candidate.split for e in ranked] == ["1P1D", "collocated"]
    assert ranked[0].goodput_per_node > 1.5 * ranked[1].goodput_per_node


def test_cheap_prefill_and_a_decode_bound_node_rank_collocated_first():
    """Prefill is nearly free and a node decodes at most 8 requests: collocated, both nodes decode; 1P1D's P idles
    and its one D is the bottleneck, so collocated has about twice its goodput per node."""
    ranked = _plan(roofline(6.25e8), {"tpot": 0.05, "ttft": 0.5}, 8)
    assert [e.candidate.split for e in ranked] == ["collocated", "1P1D"]
    assert ranked[0].goodput_per_node > 1.5 * ranked[1].goodput_per_node


def _curve_run(goodput_at):
    """A stand-in for plan_search's simulation: the goodput `goodput_at(rate)` of a trace arriving at `rate`."""
    def run(c, tr):
        rate = len(tr) / tr[-1].arrival_time
        g = goodput_at(rate)
        return {"request_goodput": g, "request_throughput": g, "duration": len(tr) / rate, "failed": 0,
                "ttft_ms": {}, "tpot_ms": {}}
    return run


def test_the_sweep_doubles_to_the_knee_then_halves_the_bracket_around_the_best():
    trace = random_trace(50, 10, 2, 1.0, seed=1)
    c = candidates(splits(1), [8], [64], [0], [0])[0]
    peak = 117.0  # goodput = rate up to the peak, then falls twice as fast

    def g(r):
        return r if r <= peak else max(0.0, peak - 2 * (r - peak))
    order = []
    ev = evaluate(c, trace, None, 10.0, 12, lambda c, tr: order.append(round(len(tr) / tr[-1].arrival_time, 6))
                  or _curve_run(g)(c, tr))
    # doubling from the start until goodput falls below 80% of the best so far (160: 31 < 0.8 x 80)
    assert order[:5] == [10, 20, 40, 80, 160]
    # then the midpoints around the best, the upper first, round after round: 120 and 60; 140 and 100 around 120
    assert order[5:9] == [120, 60, 140, 100]
    assert len(order) <= 12 and [p.rate for p in ev.points] == sorted(order)
    assert abs(ev.best.rate - peak) < 0.05 * peak  # the bracket closed on the peak
    # a budget of 6 runs: one midpoint after the doubling, the upper one
    order.clear()
    evaluate(c, trace, None, 10.0, 6, lambda c, tr: order.append(round(len(tr) / tr[-1].arrival_time, 6))
             or _curve_run(g)(c, tr))
    assert order == [10, 20, 40, 80, 160, 120]
    # a start past the knee (nothing good at 200): the sweep halves down until a rate counts, then refines
    order.clear()
    ev = evaluate(c, trace, None, 200.0, 12, lambda c, tr: order.append(round(len(tr) / tr[-1].arrival_time, 6))
                  or _curve_run(g)(c, tr))
    assert order[:3] == [200, 100, 150] and abs(ev.best.rate - peak) < 0.05 * peak


def test_the_sweep_stops_at_the_budget_and_at_a_rate_with_no_good_request():
    trace = random_trace(50, 10, 2, 1.0, seed=1)
    c = candidates(splits(1), [8], [64], [0], [0])[0]
    ev = evaluate(c, trace, None, 1.0, 4, _curve_run(lambda r: r))  # never a knee: the budget ends it
    assert [p.rate for p in ev.points] == pytest.approx([1, 2, 4, 8])
    ev = evaluate(c, trace, None, 1.0, 8, _curve_run(lambda r: 0.0 if r > 3.2 else r))
    # 4: none good, the doubling stops; then 3, 1.5 around 2; 3.5, 2.5 around 3; the budget has room for 3.25
    assert [round(p.rate, 6) for p in ev.points] == [1, 1.5, 2, 2.5, 3, 3.25, 3.5, 4]
    assert ev.best.rate == pytest.approx(3)


def test_the_default_sweep_starts_at_a_quarter_of_the_capacity_estimate():
    """The capacity estimate (prefill back to back, decode steps full) is what the sweep starts at a quarter of:
    each candidate's simulated goodput peaks near it on this decode-bound workload (collocated a little above: its
    mixed steps decode while they prefill, at the cost of a prefill step)."""
    profile = profile_from_dict(roofline(6.25e8))
    trace = random_trace(200, 512, 64, 1.0, seed=0)
    cands = candidates(splits(2), [8], [2048], [0], [0])
    ranked = plan_search(cands, trace, profile, {"max_model_len": 2048}, {}, {"tpot": 0.05, "ttft": 0.5},
                         transfer=TransferModel(1e12, 0.0), policy="round-robin", spec_acceptance=0.0, seed=0,
                         rates=None, start_rate=None, max_rates=8)
    mean_in = sum(r.prompt_len for r in trace) / len(trace)
    for e in ranked:
        estimate = capacity(profile, e.candidate, mean_in, 64)
        assert e.points[0].rate == pytest.approx(estimate / 4)
        assert 0.7 * estimate < e.best.goodput < 1.3 * estimate, e.candidate.label
    # collocated: both nodes prefill and decode; 1P1D: its one D's full steps bound it
    c, pd = (e.candidate for e in sorted(ranked, key=lambda e: e.candidate.split, reverse=True))
    assert capacity(profile, c, mean_in, 64) > 1.5 * capacity(profile, pd, mean_in, 64)


def test_scaled_traces_keep_their_requests_and_reach_the_rate():
    trace = random_trace(50, 100, 10, 3.0, range_ratio=0.5, seed=2)
    for rate in (0.5, 40.0):
        t = scale_trace(trace, rate)
        assert [(r.request_id, r.prompt_len, r.output_len) for r in t] == \
            [(r.request_id, r.prompt_len, r.output_len) for r in trace]
        assert len(t) / t[-1].arrival_time == pytest.approx(rate)
    with pytest.raises(ValueError, match="all arrive at 0 s"):
        scale_trace([TraceRequest("a", 0.0, 10, 2), TraceRequest("b", 0.0, 10, 2)], 2.0)


def test_splits_of_n_nodes():
    assert [(d.num_prefill, d.num_decode) for d in splits(4)] == [(0, 4), (1, 3), (2, 2), (3, 1)]
    c = candidates(splits(2), [8, 64], [4, 2048], [0], [0, 4])
    assert len(c) == 2 * 2 * 2 * 2 - 2 * 2 * 1  # a budget of 4 tokens cannot hold a K = 4 drafting row


@pytest.fixture
def profile(tmp_path):
    f = tmp_path / "profile.json"
    f.write_text(json.dumps(roofline(6.25e8)))
    return str(f)


@pytest.mark.parametrize("argv,named", [
    ([], "--goodput is required"),
    (["--goodput", "ttft"], "--goodput: 'ttft' is not NAME:MILLISECONDS"),
    (["--goodput", "ttft:soon"], "--goodput: 'ttft:soon' is not NAME:MILLISECONDS"),
    (["--goodput", "latency:100"], "--goodput: unknown metric 'latency'"),
    (["--goodput", "tpot:0"], "--goodput: 'tpot:0': the SLO must be > 0 ms"),
    (["--goodput", "tpot:nan"], "--goodput: every SLO must be a finite number"),
    (["--goodput", "tpot:50", "--max-num-seqs", "0,8"], "--max-num-seqs: '0,8' is not a comma-separated list"),
    (["--goodput", "tpot:50", "--num-speculative-tokens", "x"], "--num-speculative-tokens: 'x' is not"),
    (["--goodput", "tpot:50", "--deployments", "collocated,1p0d"], "--deployments: '1p0d'"),
    (["--goodput", "tpot:50", "--nodes", "0"], "--nodes must be >= 1"),
    (["--goodput", "tpot:50", "--slo-attainment", "101"], "--slo-attainment: a percentage in [0, 100]"),
    (["--goodput", "tpot:50", "--request-rate", "0"], "--request-rate: every rate must be > 0"),
    (["--goodput", "tpot:50", "--max-rates", "0"], "--max-rates must be >= 1"),
    (["--goodput", "tpot:50", "--max-num-batched-tokens", "4", "--num-speculative-tokens", "4"],
     "--max-num-batched-tokens: every value is below 1 + --num-speculative-tokens"),
    (["--goodput", "tpot:50", "--speculative-config", '{"method": "eagle"}'], "--speculative-config:"),
    (["--goodput", "tpot:50", "--speculative-config", '[1]'], "--speculative-config: a JSON object, got list"),
    (["--goodput", "tpot:50", "--num-speculative-tokens", "0,9"], "speculative_config.num_speculative_tokens must "
                                                                  "be in 1..8, got 9"),
])
def test_bad_flags_are_named(tmp_path, capsys, profile, argv, named):
    err = _err(capsys, ["plan", "--profile", profile, "--num-prompts", "4", "--result-dir", str(tmp_path / "r"),
                        *argv])
    assert err.startswith("pdserve plan: error: ") and named in err, err


def test_help_explains_every_flag():
    out = subprocess.run([sys.executable, "-m", "pdserve.cli", "plan", "--help"], capture_output=True, text=True,
                         check=True).stdout
    for flag in ("--goodput", "--nodes", "--deployments", "--max-num-seqs", "--max-num-batched-tokens",
                 "--long-prefill-token-threshold", "--num-speculative-tokens", "--speculative-config",
                 "--start-rate", "--max-rates", "--request-rate", "--trace", "--profile", "--result-dir", "--top",
                 "--plot-top", "--quiet", "--kv-bandwidth-gb-s", "--slo-attainment", "--pd-first-token"):
        assert flag in out, flag


def test_a_plan_run_prints_the_ranking_and_writes_its_files(tmp_path, capsys, profile):
    out = tmp_path / "plan"
    assert main(["plan", "--profile", profile, "--goodput", "ttft:500", "tpot:50", "--nodes", "2",
                 "--max-num-seqs", "8", "--max-num-batched-tokens", "2048", "--num-prompts", "60",
                 "--random-input-len", "512", "--random-output-len", "16", "--request-rate", "20,80",
                 "--result-dir", str(out)]) == 0
    cap = capsys.readouterr()
    assert "pdserve plan" in cap.err  # the progress bar
    plan = json.loads((out / "plan.json").read_text())
    assert [r["deployment"] for r in plan["ranking"]] == ["collocated", "1P1D"]
    assert [p["rate"] for p in plan["ranking"][0]["points"]] == [20.0, 80.0]
    assert plan["goodput_slos_ms"] == {"ttft": 500.0, "tpot": 50.0}
    lines = cap.out.splitlines()
    assert lines[0].startswith("pdserve plan: goodput (req/s meeting ttft:500 tpot:50 ms)")
    assert lines[3].split()[:2] == ["1", "collocated"] and lines[4].split()[:2] == ["2", "1P1D"]
    assert (out / "ranking.txt").read_text().splitlines()[3] == lines[3]
    assert (out / "plan.png").stat().st_size > 0


def test_slo_attainment_counts_only_rates_where_that_share_is_good():
    """Collocated on the expensive-prefill profile misses the 3 ms TPOT more often the higher the rate, while its
    goodput still grows: 16 req/s has the most (about 90% of its requests good), 12 the most where 90% or more
    are (the SLOs at the p90), 8 where 99% are."""
    trace = random_trace(200, 512, 64, 1.0, seed=0)
    best = {}
    for attainment in (0.0, 0.9, 0.99):
        (e,) = plan_search(candidates([splits(2)[0]], [64], [2048], [0], [0]), trace,
                           profile_from_dict(roofline(6.25e9)), {"max_model_len": 2048}, {},
                           {"tpot": 0.003, "ttft": 2.0}, transfer=TransferModel(1e12, 0.0), policy="round-robin",
                           spec_acceptance=0.0, seed=0, rates=[8.0, 12.0, 16.0], start_rate=1.0, max_rates=8,
                           attainment=attainment)
        best[attainment] = e.best
        assert e.goodput_per_node == best[attainment].goodput / 2
    assert [best[a].rate for a in (0.0, 0.9, 0.99)] == [16.0, 12.0, 8.0]
    assert best[0.0].good_share < 0.9 <= best[0.9].good_share < 0.99 <= best[0.99].good_share
    assert best[0.0].goodput > best[0.9].goodput > best[0.99].goodput


def test_the_first_token_from_p_reaches_the_xpyd_candidates():
    """--pd-first-token prefill takes the KV transfer out of 1P1D's TTFT: with a 50 ms link and a 40 ms TTFT SLO
    no request is good in replay and all are with the token from P; collocated is run as it is."""
    trace = random_trace(40, 256, 16, 1.0, seed=3)
    res = {}
    for mode in ("replay", "prefill"):
        ranked = plan_search(candidates(splits(2), [8], [2048], [0], [0]), trace, profile_from_dict(roofline(6.25e8)),
                             {"max_model_len": 2048}, {}, {"ttft": 0.04}, transfer=TransferModel(1e12, 0.05),
                             policy="round-robin", spec_acceptance=0.0, seed=0, rates=[4.0], start_rate=None,
                             max_rates=1, pd_first_token=mode)
        res[mode] = {e.candidate.split: e.points[0] for e in ranked}
    assert res["replay"]["1P1D"].good_share == 0 and res["prefill"]["1P1D"].good_share == 1
    assert res["replay"]["collocated"] == res["prefill"]["collocated"]


def test_a_trace_is_scaled_to_the_rates_and_random_flags_are_refused_with_it(tmp_path, capsys, profile):
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(json.dumps({"arrival_time": 0.1 * i, "prompt_len": 40 + i, "output_len": 4})
                               for i in range(30)) + "\n")
    base = ["plan", "--profile", profile, "--trace", str(trace), "--goodput", "e2el:500", "--nodes", "1",
            "--max-num-seqs", "8", "--max-num-batched-tokens", "2048", "--result-dir", str(tmp_path / "r"),
            "--quiet"]
    assert "--random-input-len is for the random generator" in _err(capsys, base + ["--random-input-len", "8"])
    assert main(base + ["--request-rate", "5,50"]) == 0
    plan = json.loads((tmp_path / "r" / "plan.json").read_text())
    assert plan["workload"]["requests"] == 30 and plan["workload"]["trace"] == str(trace)
    (only,) = plan["ranking"]
    assert only["deployment"] == "collocated" and [p["rate"] for p in only["points"]] == [5.0, 50.0]
    # arrivals scaled so that 30 requests over the last arrival time make the rate
    assert [p["span_s"] for p in only["points"]] == pytest.approx([30 / 5, 30 / 50])
