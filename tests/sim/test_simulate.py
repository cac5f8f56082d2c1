"""Simulated deployments end to end: every request runs to its trace's output length, time behaves (TTFT includes the
KV transfer, a busier node is slower), P's leases end and both block pools are whole, the full-graph rule shows
the seed's before/after on D, and the router's policy spreads requests as its own code does."""
from __future__ import annotations

import pytest

from pdserve.config import EngineConfig
from pdserve.sim.connector import TransferModel
from pdserve.sim.run import parse_deployment, simulate
from pdserve.sim.trace import TraceRequest, random_trace

FAST = TransferModel(1e12, 0.0)


def cfg(**kw) -> EngineConfig:
    return EngineConfig.from_kwargs("sim", **{"max_num_seqs": 16, "max_model_len": 1024, **kw})


def test_collocated_runs_every_request_to_its_length(linear_profile):
    trace = random_trace(40, 100, 20, request_rate=20.0, range_ratio=0.5, seed=1)
    r = simulate(trace, parse_deployment("collocated"), cfg(), linear_profile)
    assert r["completed"] == 40 and r["failed"] == 0
    assert r["output_lens"] == [t.output_len for t in trace]
    assert r["input_lens"] == [t.prompt_len for t in trace]
    assert all(ttft > 0 for ttft in r["ttfts"]) and all(lat >= ttft for lat, ttft in zip(r["latencies"], r["ttfts"]))
    assert r["start_times"] == [t.arrival_time for t in trace]
    g = r["graph"]
    assert g["full_steps"] > 0 and g["non_full_reasons"].get("prefill", 0) > 0


def test_a_run_is_deterministic(linear_profile):
    trace = random_trace(30, 80, 12, request_rate=10.0, range_ratio=0.5, seed=7)
    a, b = (simulate(trace, parse_deployment("2p1d"), cfg(), linear_profile, transfer=FAST, seed=3)
            for _ in range(2))
    assert a["ttfts"] == b["ttfts"] and a["itls"] == b["itls"] and a["graph"] == b["graph"]


def test_a_node_under_load_is_slower(linear_profile):
    slow, fast = (simulate(random_trace(60, 200, 30, rate, seed=2), parse_deployment("collocated"), cfg(),
                           linear_profile) for rate in (200.0, 1.0))
    assert slow["tpot_ms"]["mean"] > fast["tpot_ms"]["mean"]
    assert slow["ttft_ms"]["median"] > fast["ttft_ms"]["median"]


def test_a_request_too_long_for_the_context_fails_as_the_engine_refuses_it(linear_profile):
    trace = [TraceRequest("ok", 0.0, 100, 10), TraceRequest("long", 0.0, 1000, 100)]
    r = simulate(trace, parse_deployment("collocated"), cfg(), linear_profile)
    assert r["completed"] == 1 and r["errors"] == ["", "prompt (1000 tokens) plus max_tokens (100) exceeds "
                                                       "max_model_len (1024)"]


def test_pd_ttft_includes_the_kv_transfer(linear_profile):
    trace = [TraceRequest("a", 0.0, 512, 4)]
    quick, slow = (simulate(trace, parse_deployment("1p1d"), cfg(), linear_profile,
                            transfer=TransferModel(1e9, latency)) for latency in (0.0, 0.5))
    assert slow["ttfts"][0] - quick["ttfts"][0] == pytest.approx(0.5)
    # bytes on the wire: the n - 1 = 511 loaded tokens in whole blocks
    assert slow["sim"]["kv_bytes_transferred"] == 32 * 16 * linear_profile.model.kv_bytes_per_token
    # D's first step is the one-token replay over the imported KV: decode-shaped, FULL under the default rule
    assert slow["graph"] == {**slow["graph"], "non_full_steps": 0}
    # the router's TTFT split: the stages add up to the client's TTFT, the transfer is where the latency went
    split = slow["router_ttft_split_ms"]
    assert set(split) == {"router_to_prefill", "prefill", "kv_transfer", "decode_queue", "first_token", "total"}
    assert split["total"] == pytest.approx(1000 * slow["ttfts"][0])
    assert sum(v for k, v in split.items() if k != "total") == pytest.approx(split["total"])
    assert split["kv_transfer"] - quick["router_ttft_split_ms"]["kv_transfer"] == pytest.approx(500)


def test_the_ttft_split_is_the_routers_only(linear_profile):
    trace = random_trace(10, 64, 4, request_rate=5.0, seed=6) + [TraceRequest("one", 3.0, 1, 4)]
    assert simulate(trace, parse_deployment("collocated"), cfg(), linear_profile)["router_ttft_split_ms"] is None
    r = simulate(trace, parse_deployment("1p1d"), cfg(), linear_profile, transfer=FAST)
    assert r["completed"] == 11  # a one-token prompt skips P (no prefill stage), the rest pass every stage
    assert r["router_ttft_split_ms"]["total"] == pytest.approx(1000 * sum(r["ttfts"]) / 11)


def test_pd_leases_end_and_pools_are_whole(linear_profile):
    from pdserve.sim.run import build_nodes
    from pdserve.sim.simulator import Simulator
    from pdserve.sim.trace import prompt_token_ids
    # plus one prompt four times: D's prefix cache then holds all but its last token, so D loads nothing and
    # must still tell P it is done (a bare `done`)
    trace = random_trace(30, 150, 10, request_rate=50.0, seed=3) + [
        TraceRequest(f"same{i}", 1.0 + i, 49, 4, "same", 49) for i in range(4)]
    config = cfg(num_gpu_blocks_override=80)  # tight on both sides: loads wait for blocks, P's leases pile up
    prefill, decode, fabric = build_nodes(parse_deployment("1p1d"), config, linear_profile,
                                          TransferModel(1e8, 0.002), 0.0, 0)
    sim = Simulator(prefill, decode, "round-robin", fabric)
    results, _ = sim.run(trace, [prompt_token_ids(t, 32000) for t in trace])
    assert all(r.success for r in results)
    for node in prefill + decode:
        node.scheduler.check_invariants()
        assert not node.scheduler.requests and not node.scheduler.transfers.leased
        assert node.kv.num_free_blocks() == node.kv.pool.num_blocks - 1, node.name  # all but the null block
    assert prefill[0].connector.open_leases == 0
    assert [f"same{i}" in decode[0].connector.load_times for i in range(4)] == [True, False, False, False]


def test_the_rule_decides_ds_graph_share(linear_profile):
    """The seed's experiment in the simulator: under `strict` every replay arrival takes D off FULL graphs."""
    trace = random_trace(50, 200, 40, request_rate=10.0, seed=4)
    share = {rule: simulate(trace, parse_deployment("1p1d"), cfg(full_graph_rule=rule), linear_profile,
                            transfer=FAST)["graph"] for rule in ("strict", "prompt-tail", "decode-shaped")}
    assert share["strict"]["non_full_steps"] >= 40 and set(share["strict"]["non_full_reasons"]) == {"prefill"}
    assert share["prompt-tail"]["non_full_steps"] == share["decode-shaped"]["non_full_steps"] == 0


def test_collocated_nodes_share_the_load_by_the_routers_policy(linear_profile):
    trace = random_trace(40, 64, 8, request_rate=100.0, seed=5)
    r = simulate(trace, parse_deployment("collocated", nodes=4), cfg(), linear_profile, policy="round-robin")
    steps = [n["steps"] for n in r["sim"]["nodes"]]
    assert len(steps) == 4 and all(s > 0 for s in steps) and r["completed"] == 40


@pytest.mark.parametrize("acceptance", [0.0, 0.6, 1.0])
def test_speculative_decoding_drafts_and_accepts(linear_profile, acceptance):
    """The scheduler's own draft bookkeeping over the stand-in model: the engine's n-gram proposer finds drafts in
    text that repeats itself as often as `spec_acceptance` says, each draft token is kept at that rate until the
    first rejection, and every request still ends at its output length through the stop checks."""
    from pdserve.spec_decode.config import SpeculativeConfig
    spec = SpeculativeConfig.from_json('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, '
                                       '"prompt_lookup_max": 2}')
    trace = random_trace(8, 64, 60, request_rate=4.0, seed=8)
    r = simulate(trace, parse_deployment("collocated"), cfg(speculative_config=spec), linear_profile,
                 spec_acceptance=acceptance)
    sd = r["graph"]["spec_decode"]
    assert r["completed"] == 8 and r["output_lens"] == [60] * 8
    chunks = sum(len(itl) + 1 for itl in r["itls"])
    if acceptance == 0.0:  # random text: lookups find nothing but by chance, nothing is kept
        assert sd["num_accepted_tokens"] == 0 and chunks == 8 * 60
        return
    assert sd["num_draft_tokens"] > 0.3 * sd["num_drafts"] * 3
    # kept in order until the first rejection: of K = 3 real drafts p + p^2 + p^3 on average (vLLM's rate counts
    # every draft token), all of them at p = 1
    assert acceptance ** 3 - 0.05 < sd["acceptance_rate"] <= acceptance
    assert acceptance < 1 or sd["acceptance_rate"] == 1.0
    assert chunks < 8 * 60  # steps that emitted several tokens at once


def test_a_drafting_node_frees_everything(linear_profile):
    from pdserve.sim.node import SimNode
    from pdserve.spec_decode.config import SpeculativeConfig
    spec = SpeculativeConfig.from_json('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, '
                                       '"prompt_lookup_max": 2}')
    node = SimNode("n", cfg(speculative_config=spec), linear_profile, 1024, 200, spec_acceptance=0.7)
    reqs = [node.make_request(f"r{i}", [10 + i % 7 for i in range(40)], 25, 0.0) for i in range(3)]
    for r in reqs:
        node.add(r)
    t = 0.0
    while node.has_work():
        t = node.step(t).end
        node.scheduler.check_invariants()
    assert all(r.num_output_tokens == 25 and r.is_finished for r in reqs)
    assert node.spec_counts["num_accepted_tokens"] > 0 and not node._follow
    assert node.kv.num_free_blocks() == 199


def test_a_request_that_preempts_itself_does_not_stall_its_node(linear_profile):
    """On D a lone running request can preempt itself when a load holds the blocks it needs: the engine's step
    then runs nothing and its loop steps again at once; a simulated node must too, or both requests stall."""
    import copy

    from pdserve.sim.connector import Fabric, SimConnector
    from pdserve.sim.node import SimNode
    from pdserve.sim.profile import profile_from_dict
    from pdserve.sim.simulator import Simulator
    from pdserve.sim.trace import prompt_token_ids
    from tests.sim.conftest import LINEAR
    one_s = copy.deepcopy(LINEAR)
    one_s["coefficients"] = {"base_s": dict.fromkeys(("FULL", "PIECEWISE", "NONE"), 1.0), "per_token_s": 0,
                             "per_row_s": 0, "per_context_token_s": 0}
    prof, config = profile_from_dict(one_s), cfg(max_model_len=192, num_gpu_blocks_override=14, max_num_seqs=4)
    fab = Fabric(TransferModel(1e12, 46.0), 1.0, 16)  # the load ends after `a` needs its fourth block
    p = SimNode("p0", config, prof, 192, 14, SimConnector("kv_producer", "p0", fab, 16))
    d = SimNode("d0", config, prof, 192, 14, SimConnector("kv_consumer", "d0", fab, 16))
    idle_preemptions = []
    sim = Simulator([p], [d], fabric=fab,
                    on_step=lambda n, rec: idle_preemptions.append(rec.preempted) if not rec.rows else None)
    trace = [TraceRequest("a", 0.0, 1, 150), TraceRequest("b", 0.5, 160, 10)]  # `a` on D alone, `b` through P
    results, _ = sim.run(trace, [prompt_token_ids(t, 32000) for t in trace])
    assert idle_preemptions == [["a"]], "the scenario no longer arises: retune the latency"
    assert all(r.success for r in results) and [r.output_tokens for r in results] == [150, 10]


@pytest.mark.parametrize("device,wait_ms", [("cpu", 0.0), ("cpu", 2.0), ("cuda", 2.0)])
def test_d_waits_for_its_early_loads_as_the_engine_does(device, wait_ms):
    """kv_load_wait_ms (the engine's EngineStep._load_early): D starts the queue head's load before its step and
    waits up to the wait for it, so a 1 ms load joins the first step D starts after the request reached it; with no
    wait it joins the next one, and so it does on CUDA, where the engine schedules a step while the last one runs
    (async scheduling: no early loads, no wait). The running request's gap then holds the wait."""
    from pdserve.sim.profile import profile_from_dict
    from tests.sim.conftest import LINEAR
    waits = device == "cpu" and wait_ms > 0
    trace = [TraceRequest("a", 0.0, 64, 80), TraceRequest("b", 0.05, 64, 4)]
    steps = []
    simulate(trace, parse_deployment("1p1d"), cfg(), profile_from_dict({**LINEAR, "device": device}),
             transfer=TransferModel(1e12, 0.001, load_wait_s=wait_ms / 1000),
             on_step=lambda node, rec: steps.append((node.name, rec)))
    p_done = next(rec.end for name, rec in steps if name == "prefill0" and any(r[0] == "b" for r in rec.rows))
    d = [rec for name, rec in steps if name == "decode0"]
    first = next(i for i, rec in enumerate(d) if rec.start >= p_done)  # D's first step after b reached it
    joined = next(i for i, rec in enumerate(d) if any(r[0] == "b" for r in rec.rows))
    assert joined - first == (0 if waits else 1)
    gaps = [b.start - a.end for a, b in zip(d, d[1:])]  # a decodes throughout: D is never idle
    assert max(gaps) == pytest.approx(0.001 if waits else 0.0, abs=1e-6)  # the wait: until the load ended
    assert gaps.index(max(gaps)) == first - 1 or not waits


def test_a_load_wait_out_of_range_is_refused():
    with pytest.raises(ValueError, match="--kv-load-wait-ms must be in"):
        TransferModel(1e9, 0.0, load_wait_s=1.5)


@pytest.mark.parametrize("deployment,first_token,early,visits", [
    ("collocated", "replay", True, 1), ("1p1d", "replay", True, 2), ("1p1d", "prefill", False, 1),
    ("1p1d", "prefill", True, 1)])
def test_a_served_profiles_request_latency_is_paid_on_each_node_a_request_reaches(deployment, first_token, early,
                                                                                   visits):
    """A lone request's TTFT grows by the profile's request latency once per node before its first token (P and D
    when D replays, P alone when P's token is the first), its gaps between tokens not at all but for the one that
    holds D's arrival (P's token to D's first) when D is asked after P answered; under early decode D's arrival
    (4 ms) comes before P's prefill (3.4 ms) ends, so the first gap does not hold it."""
    from pdserve.sim.profile import profile_from_dict
    from tests.sim.conftest import LINEAR
    trace = [TraceRequest("r0", 0.0, 37, 9)]
    runs = [simulate(trace, parse_deployment(deployment), cfg(), profile_from_dict(
        {**LINEAR, "served": {"request_latency_s": lat}}), transfer=FAST, pd_first_token=first_token,
        early_decode=early) for lat in (0.0, 0.004)]
    assert runs[1]["ttfts"][0] - runs[0]["ttfts"][0] == pytest.approx(visits * 0.004)
    gaps = [b - a for a, b in zip(runs[0]["itls"][0], runs[1]["itls"][0])]
    first = 0.004 if first_token == "prefill" and not early else 0.0
    assert gaps == pytest.approx([first] + [0.0] * (len(gaps) - 1), abs=1e-12)


@pytest.mark.parametrize("deployment,nodes,first_token,sends", [("collocated", 1, "replay", 0),
                                                                 ("collocated", 2, "replay", 1),
                                                                 ("1p1d", 1, "replay", 2), ("1p1d", 1, "prefill", 1)])
def test_the_routers_latency_is_paid_on_each_send_through_it(linear_profile, deployment, nodes, first_token, sends):
    """A lone request's TTFT grows by --router-latency-ms once per send before its first token (xPyD: to P, then to
    D when D replays; a collocated pool of two: to its node); a lone collocated node has no router."""
    trace = [TraceRequest("r0", 0.0, 37, 9)]
    runs = [simulate(trace, parse_deployment(deployment, nodes), cfg(), linear_profile, pd_first_token=first_token,
                     transfer=TransferModel(1e12, 0.0, router_latency_s=lat)) for lat in (0.0, 0.003)]
    assert runs[1]["ttfts"][0] - runs[0]["ttfts"][0] == pytest.approx(sends * 0.003, abs=1e-12)


def test_a_router_latency_out_of_range_is_refused():
    with pytest.raises(ValueError, match=r"--router-latency-ms must be in \[0, 1000\]"):
        TransferModel(1e9, 0.0, router_latency_s=2.0)


def test_nodes_sharing_a_host_slow_each_others_steps_while_both_are_busy():
    """--shared-host: a step that starts while the other node is mid-step takes (1 + neighbour_scale) x as long. Two
    requests at once on a collocated pair: once both decode, every step of each is 1.5x; a lone request (its
    neighbour idle) and a neighbour_scale of 0 leave every time as it was; 1P1D is slowed too (P and D share it)."""
    from pdserve.sim.profile import profile_from_dict
    from tests.sim.conftest import LINEAR
    slow = profile_from_dict({**LINEAR, "served": {"neighbour_scale": 0.5}})
    pair = [TraceRequest("r0", 0.0, 37, 20), TraceRequest("r1", 0.0, 37, 20)]
    alone, shared = (simulate(pair, parse_deployment("collocated", 2), cfg(), slow, shared_host=s) for s in (False,
                                                                                                            True))
    assert shared["sim"]["shared_host"] and not alone["sim"]["shared_host"]
    # node0's prefill started first (its neighbour idle), node1's beside it; then every step of both is 1.5x but
    # node1's last, which starts after node0 is done
    assert shared["ttfts"] == pytest.approx([alone["ttfts"][0], 1.5 * alone["ttfts"][1]])
    for a, s in zip(alone["itls"], shared["itls"]):
        assert s[:-1] == pytest.approx([1.5 * g for g in a[:-1]])
    assert shared["itls"][1][-1] == pytest.approx(alone["itls"][1][-1])
    lone = [TraceRequest("r0", 0.0, 37, 20)]
    assert simulate(lone, parse_deployment("collocated", 2), cfg(), slow, shared_host=True)["itls"] == \
        simulate(lone, parse_deployment("collocated", 2), cfg(), slow)["itls"]
    unscaled = profile_from_dict(LINEAR)
    assert simulate(pair, parse_deployment("collocated", 2), cfg(), unscaled, shared_host=True)["itls"] == \
        simulate(pair, parse_deployment("collocated", 2), cfg(), unscaled)["itls"]
    trace = random_trace(20, 60, 12, request_rate=40.0, seed=5)
    pd = [simulate(trace, parse_deployment("1p1d"), cfg(), slow, transfer=FAST, shared_host=s)
          for s in (False, True)]
    assert pd[1]["mean_tpot_ms"] > pd[0]["mean_tpot_ms"] and pd[1]["completed"] == 20


def test_the_clients_chunk_delays_stretch_the_itl_tail_not_the_steps():
    """served.chunk_delay_quantiles_s: each chunk reaches the simulated client up to that late, in order (no gap
    below 0), drawn per request from the run's seed (the same twice, leaping or step by step); the steps, the
    graph counts and every request's token count are those of the run without delays, p99 ITL grows, TPOT
    barely moves."""
    from pdserve.sim.profile import profile_from_dict
    from tests.sim.conftest import LINEAR
    late = profile_from_dict({**LINEAR, "served": {"chunk_delay_quantiles_s": [0.0] * 19 + [0.004, 0.02]}})
    trace = random_trace(40, 60, 24, request_rate=30.0, seed=4)
    plain = simulate(trace, parse_deployment("collocated"), cfg(), profile_from_dict(LINEAR))
    runs = [simulate(trace, parse_deployment("collocated"), cfg(), late, step_by_step=sbs) for sbs in (False, True,
                                                                                                       False)]
    assert runs[0]["itls"] == runs[1]["itls"] == runs[2]["itls"] and runs[0]["ttfts"] == runs[1]["ttfts"]
    r = runs[0]
    assert r["graph"] == plain["graph"] and r["output_lens"] == plain["output_lens"]
    assert all(g >= 0 for itl in r["itls"] for g in itl)
    assert r["itl_ms"]["p99"] > plain["itl_ms"]["p99"] + 2.0
    assert abs(r["tpot_ms"]["median"] - plain["tpot_ms"]["median"]) < 0.25 * plain["tpot_ms"]["median"]


def test_the_clients_chunk_delays_follow_the_rows_of_the_chunks_step():
    """chunk_delay_by_rows: lone requests (one row a step) draw from the 1-row quantiles (0: the ITLs of the run
    without delays), while requests decoding beside others draw from the 2-row ones and their ITLs stretch."""
    from pdserve.sim.profile import profile_from_dict
    from tests.sim.conftest import LINEAR
    late = profile_from_dict({**LINEAR, "served": {"chunk_delay_quantiles_s": [0.0, 0.05],
                                                   "chunk_delay_by_rows": {"1": [0.0, 0.0], "2": [0.0, 0.02]}}})
    plain = profile_from_dict(LINEAR)
    lone = random_trace(6, 40, 8, request_rate=0.5, seed=2)  # each done long before the next arrives
    runs = [simulate(lone, parse_deployment("collocated"), cfg(), p) for p in (plain, late)]
    assert runs[0]["itls"] == runs[1]["itls"] and runs[0]["ttfts"] == runs[1]["ttfts"]
    busy = random_trace(30, 40, 16, request_rate=60.0, seed=2)
    runs = [simulate(busy, parse_deployment("collocated"), cfg(), p) for p in (plain, late)]
    assert runs[1]["itl_ms"]["p99"] > runs[0]["itl_ms"]["p99"] + 5.0
    # a gap stretches by at most the 2-row quantiles' 20 ms, never by the pooled ones' 50
    assert max(g for itl in runs[1]["itls"] for g in itl) < max(g for itl in runs[0]["itls"] for g in itl) + 0.02


def test_nodes_sharing_a_host_draw_the_chunk_delays_measured_beside_a_neighbour():
    """served.neighbour_chunk_delay_*: 1P1D with --shared-host draws them for every chunk; the same deployment on
    hosts of their own and a lone collocated node on a shared host draw the lone ones (0 here): their ITLs are
    those of the run without delays."""
    from pdserve.sim.profile import profile_from_dict
    from tests.sim.conftest import LINEAR
    near = profile_from_dict({**LINEAR, "served": {"chunk_delay_quantiles_s": [0.0, 0.0],
                                                   "neighbour_chunk_delay_quantiles_s": [0.0, 0.02]}})
    plain = profile_from_dict(LINEAR)
    trace = random_trace(20, 40, 12, request_rate=20.0, seed=3)
    lone = [simulate(trace, parse_deployment("collocated"), cfg(), p, shared_host=True) for p in (plain, near)]
    assert lone[0]["itls"] == lone[1]["itls"]
    apart = [simulate(trace, parse_deployment("1p1d"), cfg(), p, transfer=FAST) for p in (plain, near)]
    assert apart[0]["itls"] == apart[1]["itls"]
    shared = [simulate(trace, parse_deployment("1p1d"), cfg(), p, transfer=FAST, shared_host=True)
              for p in (plain, near)]
    assert shared[1]["itl_ms"]["p99"] > shared[0]["itl_ms"]["p99"] + 5.0
    assert shared[1]["graph"] == shared[0]["graph"] and shared[1]["output_lens"] == shared[0]["output_lens"]


def test_a_step_that_answers_a_newcomer_delays_the_other_streams_chunks_of_that_step():
    """served.arrival_delay_s: r0 decodes alone; r1 arrives; the step that prefilled r1 (its first token) brings r0's
    chunk that much later, and only that chunk: r0's gap into it grows by the delay and the one after shrinks by it;
    r1's own TTFT, every step, the graph counts and the token counts are the run's without it. Leaping and step
    by step agree."""
    from pdserve.sim.profile import profile_from_dict
    from tests.sim.conftest import LINEAR
    plain = profile_from_dict(LINEAR)
    late = profile_from_dict({**LINEAR, "served": {"arrival_delay_s": 0.004}})
    trace = [TraceRequest("r0", 0.0, 33, 40), TraceRequest("r1", 0.02, 17, 9)]
    base = simulate(trace, parse_deployment("collocated"), cfg(), plain)
    runs = [simulate(trace, parse_deployment("collocated"), cfg(), late, step_by_step=sbs) for sbs in (False, True)]
    assert runs[0]["itls"] == runs[1]["itls"] and runs[0]["ttfts"] == runs[1]["ttfts"]
    got = runs[0]
    assert got["ttfts"] == base["ttfts"] and got["graph"] == base["graph"] and got["output_lens"] == base["output_lens"]
    assert got["itls"][1] == base["itls"][1]  # r1 never shares a step with another's first token
    diff = [a - b for a, b in zip(got["itls"][0], base["itls"][0])]
    k = next(i for i, d in enumerate(diff) if abs(d) > 1e-12)
    assert diff[k] == pytest.approx(0.004) and diff[k + 1] == pytest.approx(-0.004)
    assert all(abs(d) < 1e-12 for i, d in enumerate(diff) if i not in (k, k + 1))
    # the gap that grew is the one into the step that prefilled r1: it ends when r1's first token is out
    t = 0.0 + base["ttfts"][0] + sum(base["itls"][0][:k + 1])
    assert t == pytest.approx(0.02 + base["ttfts"][1])


def test_a_replay_on_d_is_no_newcomer_to_its_other_streams():
    """D admitted the request when it arrived and loaded its KV since: the replay step that gives it its first token
    does not delay D's other streams (served.arrival_delay_s is the way in of a request prefilled where it runs). P
    answers every request with its own first token: nothing of P's reaches a client in the replay arms."""
    from pdserve.sim.profile import profile_from_dict
    from tests.sim.conftest import LINEAR
    plain = profile_from_dict(LINEAR)
    late = profile_from_dict({**LINEAR, "served": {"arrival_delay_s": 0.004}})
    trace = [TraceRequest("r0", 0.0, 33, 40), TraceRequest("r1", 0.02, 17, 9), TraceRequest("r2", 0.03, 48, 12)]
    runs = [simulate(trace, parse_deployment("1p1d"), cfg(), p, transfer=FAST) for p in (plain, late)]
    assert runs[0]["itls"] == runs[1]["itls"] and runs[0]["ttfts"] == runs[1]["ttfts"]
    # the same trace collocated: the newcomers' prefills there do delay r0
    runs = [simulate(trace, parse_deployment("collocated"), cfg(), p) for p in (plain, late)]
    assert runs[0]["itls"] != runs[1]["itls"]
