"""Event-leaping (sim/node.py `plan_leap` / `catch_up`, sim/simulator.py) against step by step: on small traces that
take every path a leap can end on (a row's last token, blocks short and preemption, a request routed to the node, a
load ending, a lease expiring, a load failing, full seats with a queue, prefix hits, odd block counts, an odd
max_model_len) a leaping run leaves every node exactly as step by step does: the same steps (each one's times,
rows, graph label and padding), the same tokens and block hashes of every request, the same block pool (free queue
order, published hashes), the same rng state, and every client the same token times; and it leaps (fewer
scheduler calls than steps), over arrivals routed to other nodes too."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Optional

import pytest

from pdserve.config import EngineConfig
from pdserve.sim.connector import TransferModel
from pdserve.sim.run import build_nodes, parse_deployment
from pdserve.sim.simulator import Simulator
from pdserve.sim.trace import TraceRequest, prompt_token_ids, random_trace
from tests.sim.conftest import LINEAR

LINK = TransferModel(1e9, 1e-3)


@dataclass
class Run:
    results: list
    duration: float
    nodes: list
    requests: list  # (node name, Request) of every request a node took
    records: dict  # node name -> its StepRecords as on_step saw them, flattened
    schedules: Counter  # node name -> Scheduler.schedule calls
    fabric: object


def _run(trace, dep: str, leap: bool, *, policy: str = "round-robin", pd_first_token: str = "replay",
         transfer: TransferModel = LINK, nodes: int = 1, profile: Optional[dict] = None, early_decode: bool = True,
         **engine) -> Run:
    from pdserve.sim.profile import profile_from_dict
    config = EngineConfig.from_kwargs("sim", **{"max_num_seqs": 16, "max_model_len": 1024, **engine})
    prefill, decode, fabric = build_nodes(parse_deployment(dep, nodes), config, profile_from_dict(profile or LINEAR),
                                          transfer, 0.0, 0)
    requests, schedules = [], Counter()
    records = {n.name: [] for n in prefill + decode}
    for node in prefill + decode:
        def add(req, node=node, add=node.add):
            requests.append((node.name, req))
            add(req)

        def schedule(node=node, schedule=node.scheduler.schedule):
            schedules[node.name] += 1
            return schedule()
        node.add, node.scheduler.schedule = add, schedule

    def on_step(node, rec):  # a leap's records come when it is applied: its requests are then past its end
        records[node.name].append((rec.start, rec.end, rec.mode, rec.reason, rec.num_tokens, rec.padded_tokens,
                                   tuple(rec.rows), tuple(rec.preempted),
                                   tuple((r.request_id, n) for r, n in rec.emitted)))
    sim = Simulator(prefill, decode, policy, fabric, on_step, pd_first_token, leap=leap, early_decode=early_decode)
    results, duration = sim.run(trace, lambda r: prompt_token_ids(r, 32000, 0))
    return Run(results, duration, prefill + decode, requests, records, schedules, fabric)


def _node_state(node) -> tuple:
    s, pool = node.scheduler, node.kv.pool
    return (node.num_steps, node.num_rows, s.num_preemptions, s.prefix_cache_queries, s.prefix_cache_hits,
            dict(node.graph_stats.steps), node.graph_stats.padded_tokens, node.rng.getstate(),
            list(pool.free_queue), list(pool.block_hash), dict(pool.cached),
            dict(node.connector.load_times) if node.connector else None)


def _odd_sizes() -> list[TraceRequest]:
    # prompts of k blocks and k blocks + 1 (and one short of a block, and a single token); every fifth request
    # runs to max_model_len exactly
    out = []
    for i in range(30):
        n = (16, 17, 32, 33, 48, 15, 1)[i % 7]
        out.append(TraceRequest(f"r{i}", 0.013 * i, n, 255 - n if i % 5 == 0 else 1 + (7 * i) % 60))
    return out


def _long(n: int = 20) -> list[TraceRequest]:
    return [TraceRequest(f"r{i}", 0.005 * i, 20 + i, 150 + 3 * i) for i in range(n)]


# a roofline profile with a served section (step_scale x the bare step + step_overhead_s; a request latency)
ROOFLINE = {"type": "roofline", "device": "cuda", "gpu": {"memory_bandwidth_gb_s": 3350, "peak_tflops": 989},
            "model": {"kv_bytes_per_token": 114688, "weight_bytes": 1.2e9, "flops_per_token": 1.2e9,
                      "attention_flops_per_pair": 524288},
            "step_overhead_s": {"FULL": 2e-5, "PIECEWISE": 4e-4, "NONE": 1.5e-3},
            "served": {"step_scale": 1.2, "step_overhead_s": 6e-4, "request_latency_s": 2.5e-3}}
RANDOM = random_trace(50, 100, 40, request_rate=30.0, range_ratio=0.5, seed=1)
PREFIXED = [TraceRequest(f"p{i}", 0.01 * i, 40 + i % 9, 30 + i % 13, prefix_group=str(i % 3), prefix_len=32)
            for i in range(30)]
SLOW = TransferModel(2e7, 5e-3)
CASES = {
    "collocated": (RANDOM, "collocated", {}),
    "1p1d replay": (RANDOM, "1p1d", {}),
    "1p1d first token": (RANDOM, "1p1d", {"pd_first_token": "prefill"}),
    "small pool preempts": (_long(), "collocated", {"max_model_len": 511, "num_gpu_blocks_override": 40,
                                                    "max_num_seqs": 8}),
    "small pool preempts on D": (_long(), "1p1d", {"max_model_len": 511, "num_gpu_blocks_override": 40,
                                                   "max_num_seqs": 8}),
    "odd sizes": (_odd_sizes(), "collocated", {"max_model_len": 255}),
    "odd sizes 1p1d first token": (_odd_sizes(), "1p1d", {"max_model_len": 255, "pd_first_token": "prefill"}),
    "odd sizes 1p1d first token, D asked after P": (_odd_sizes(), "1p1d", {
        "max_model_len": 255, "pd_first_token": "prefill", "early_decode": False}),
    "early decode, leases expire while D's seats are full": (RANDOM, "1p2d", {
        "pd_first_token": "prefill", "max_num_seqs": 1, "transfer": TransferModel(1e9, 1e-3, lease_seconds=0.05)}),
    # early decode: awaits holding D's seats and blocks, failed awaited loads prefilled on D, 1-token answers
    "early decode, full seats, loads fail": (RANDOM + [TraceRequest("one", 0.05, 30, 1)], "1p2d", {
        "pd_first_token": "prefill", "max_num_seqs": 3, "transfer": TransferModel(1e9, 1e-3,
                                                                                  load_failure_rate=0.3)}),
    "prefix sharing": (PREFIXED, "collocated", {}),
    "full seats, loads in flight": (RANDOM, "1p1d", {"max_num_seqs": 4, "transfer": SLOW}),
    "leases expire, loads fail": (RANDOM, "1p2d", {"max_num_seqs": 1, "transfer": TransferModel(
        1e9, 1e-3, lease_seconds=0.05, load_failure_rate=0.3)}),
    "least-loaded, 3 nodes": (RANDOM, "collocated", {"nodes": 3, "policy": "least-loaded", "max_num_seqs": 5}),
    "strict rule, block size 8": (RANDOM, "2p2d", {"full_graph_rule": "strict", "block_size": 8}),
    "roofline, served steps": (RANDOM, "1p1d", {"profile": ROOFLINE}),
    # steps after a pause pay the profile's idle extra, fading over the next ones: a leap's first steps too
    "idle extra, early decode": (RANDOM, "1p1d", {"pd_first_token": "prefill", "profile": {**LINEAR, "idle": {
        "gaps_s": [0.001, 0.01], "extra_s": [0.0003, 0.0012], "decay": 0.5}}}),
    # a budget of 8 tokens: prompts in chunks beside the decodes, which leap once the queue is empty
    "small budget, chunked prefills": ([TraceRequest(f"b{i}", 0.0, 20, 30 + i) for i in range(16)], "collocated",
                               {"max_num_batched_tokens": 8}),
}


@pytest.mark.parametrize("case", CASES)
def test_leaping_leaves_every_node_as_step_by_step_does(case):
    trace, dep, kw = CASES[case]
    step, leap = (_run(trace, dep, leaping, **kw) for leaping in (False, True))
    assert all(r.success for r in step.results)
    # what the client sees: token counts exact, times to float rounding (they are in fact equal)
    assert [r.output_tokens for r in leap.results] == [r.output_tokens for r in step.results] == \
        [t.output_len for t in trace]
    for a, b in zip(step.results, leap.results):
        assert b.ttft == pytest.approx(a.ttft, rel=1e-9) and b.latency == pytest.approx(a.latency, rel=1e-9)
        assert b.itl == pytest.approx(a.itl, rel=1e-9)
    assert leap.duration == pytest.approx(step.duration, rel=1e-9)
    # each node's steps as on_step saw them, in its order: times, rows, graph labels, padding, preemptions, emitted
    assert leap.records == step.records
    # what the steps left: counters, graph stats, the stand-in sampler's rng, the block pool and every request
    for a, b in zip(step.nodes, leap.nodes):
        assert _node_state(b) == _node_state(a), a.name
        assert b.busy_s == pytest.approx(a.busy_s, rel=1e-12)
        b.scheduler.check_invariants()
    assert [(name, r.request_id, r.all_token_ids, r.block_hashes, r.num_preemptions, r.status)
            for name, r in leap.requests] == \
        [(name, r.request_id, r.all_token_ids, r.block_hashes, r.num_preemptions, r.status)
         for name, r in step.requests]
    if step.fabric is not None:
        assert (leap.fabric.bytes_moved, leap.fabric.failed_loads, leap.fabric.expired_leases) == \
            (step.fabric.bytes_moved, step.fabric.failed_loads, step.fabric.expired_leases)
    # the cases take the paths they are named for
    preempted = sum(n.scheduler.num_preemptions for n in step.nodes)
    assert (preempted > 20) == ("preempts" in case), preempted
    if case.startswith("leases expire") or case.startswith("early decode, leases expire"):
        assert step.fabric.expired_leases > 0 and (step.fabric.failed_loads > 0 or "early" in case)
    if case == "odd sizes":
        assert any(len(r.all_token_ids) == 255 for _, r in step.requests)
    # and it leaps: the scheduler runs for fewer steps than were taken (all of them step by step)
    # (a run that keeps preempting, or whose budget holds fewer rows than its seats, is steady less often)
    steps = sum(n.num_steps for n in leap.nodes)
    assert sum(step.schedules.values()) >= steps
    share = 0.8 if "preempts" in case else 0.95 if "budget" in case else 0.25
    assert sum(leap.schedules.values()) < share * steps


def test_an_arrival_routed_elsewhere_does_not_cut_a_leap():
    """One long request decodes on node0 while short ones keep arriving at node1 (least-loaded: node1 is idle at
    each arrival): node0's run is planned in doubling chunks and cut by nothing, so its scheduler runs a handful of
    times over its 400 steps; node1 runs it for each arrival's steps."""
    trace = [TraceRequest("long", 0.0, 40, 400)] + [TraceRequest(f"s{i}", 0.02 + 0.018 * i, 20, 3)
                                                    for i in range(20)]
    step, leap = (_run(trace, "collocated", leaping, nodes=2, policy="least-loaded") for leaping in (False, True))
    assert [n for n, r in leap.requests if r.request_id == "long"] == ["node0"]
    assert {n for n, r in leap.requests if r.request_id != "long"} == {"node1"}
    assert leap.records == step.records
    assert step.schedules["node0"] == leap.nodes[0].num_steps == 400
    # its prefill only: then chunks of 8, 16, ..., 128 steps, and the last 151 with the step that ends it
    assert leap.schedules["node0"] == 1


@pytest.mark.parametrize("between", [False, True])
def test_a_request_routed_mid_leap_joins_where_step_by_step_takes_it(between):
    """A request routed to a node mid-leap is taken by the first step that starts at or after its arrival, as step
    by step takes it (an arrival is queued before any step, so at the very same time it goes first): the steps the
    leap planned from there are dropped and the node schedules again. Here b arrives while a's 20th decode step
    runs, or exactly when it starts (inside a leap's second chunk)."""
    a = TraceRequest("a", 0.0, 40, 200)
    alone = _run([a], "collocated", False)
    start, end = alone.records["node0"][20][:2]
    arrival = (start + end) / 2 if between else start
    step, leap = (_run([a, TraceRequest("b", arrival, 40, 10)], "collocated", leaping) for leaping in (False, True))
    assert leap.records == step.records
    first_b = next(rec for rec in leap.records["node0"] if any(r[0] == "b" for r in rec[6]))
    assert first_b[0] == (end if between else start)
    assert leap.schedules["node0"] < 20 < step.schedules["node0"]


def test_step_by_step_is_a_flag_of_sim_and_plan(monkeypatch, tmp_path):
    """--step-by-step reaches simulate (pdserve sim) and plan_search (pdserve plan); leaping is the default."""
    import json

    import pdserve.sim.plan as plan
    import pdserve.sim.run as run
    from pdserve.cli import main
    from tests.sim.conftest import LINEAR
    prof = tmp_path / "p.json"
    prof.write_text(json.dumps(LINEAR))
    seen = []

    class Stop(Exception):
        pass

    def record(*a, **kw):
        seen.append(kw["step_by_step"])
        raise Stop
    monkeypatch.setattr(run, "simulate", record)
    monkeypatch.setattr(plan, "plan_search", record)
    for argv in (["sim"], ["sim", "--step-by-step"], ["plan", "--goodput", "ttft:100"],
                 ["plan", "--goodput", "ttft:100", "--step-by-step"]):
        with pytest.raises(Stop):
            main(argv + ["--profile", str(prof), "--num-prompts", "4", "--result-dir", str(tmp_path / "r"),
                         "--quiet"])
    assert seen == [False, True, False, True]


def _random_case(seed: int) -> tuple:
    """A deployment, engine flags, link and trace drawn from `seed` (the knobs a leap's bounds hang on)."""
    import random
    rng = random.Random(seed)
    dep = rng.choice(["collocated", "collocated", "1p1d", "2p1d", "1p2d", "2p3d"])
    kw = {"policy": rng.choice(["round-robin", "least-loaded"])}
    if dep == "collocated":
        kw["nodes"] = rng.choice([1, 2, 3])
    else:
        kw["pd_first_token"] = rng.choice(["replay", "prefill"])
        kw["transfer"] = TransferModel(rng.choice([1e7, 1e8, 1e9, 1e12]), rng.choice([0.0, 1e-3, 5e-3]),
                                       lease_seconds=rng.choice([30.0, 0.05, 0.2]),
                                       load_failure_rate=rng.choice([0.0, 0.0, 0.2]))
    mml, bs = rng.choice([255, 511, 1023, 1024]), rng.choice([8, 16])
    kw.update(max_model_len=mml, block_size=bs, max_num_seqs=rng.choice([1, 2, 3, 5, 8, 16]))
    if rng.random() < 0.5:
        kw["num_gpu_blocks_override"] = -(-mml // bs) + 1 + rng.choice([0, 3, 10, 40])
    if rng.random() < 0.3:
        kw.update(max_num_batched_tokens=rng.choice([8, 32, 100]), enable_chunked_prefill=True)
    if rng.random() < 0.3:
        kw["long_prefill_token_threshold"] = rng.choice([4, 17])
    if rng.random() < 0.2:
        kw["enable_prefix_caching"] = False
    if rng.random() < 0.2:
        kw["full_graph_rule"] = rng.choice(["strict", "prompt-tail"])
    trace = random_trace(rng.choice([10, 30]), rng.choice([16, 60, 150]), rng.choice([5, 40, 120]),
                         request_rate=rng.choice([5.0, 30.0, 200.0]), range_ratio=0.5, seed=seed,
                         prefix_len=rng.choice([0, 0, 16, 33]))
    return [t for t in trace if t.prompt_len + t.output_len <= mml], dep, kw


@pytest.mark.parametrize("seed", range(8))
def test_random_deployments_leap_as_they_step(seed):
    """Drawn deployments and flags (1000 seeds were run once by hand, all equal): the same steps, node states,
    request tokens and client times."""
    trace, dep, kw = _random_case(seed)
    step, leap = (_run(trace, dep, leaping, **kw) for leaping in (False, True))
    assert leap.records == step.records
    assert [_node_state(n) for n in leap.nodes] == [_node_state(n) for n in step.nodes]
    assert [(r.output_tokens, r.ttft, r.itl, r.latency) for r in leap.results] == \
        [(r.output_tokens, r.ttft, r.itl, r.latency) for r in step.results]
    assert [(name, r.all_token_ids, r.block_hashes) for name, r in leap.requests] == \
        [(name, r.all_token_ids, r.block_hashes) for name, r in step.requests]
