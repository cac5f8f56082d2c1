"""The simulator's scheduler IS the engine's: the same objects (no copy), and on a recorded trace the same sequence
of scheduled batches (request ids, context and token counts per row, preemptions) and the same graph labels as a
real engine running the tiny model, collocated and as a P/D decode node (loads parked, blocked for blocks, replayed).
Arrivals are keyed by step, so wall time plays no part."""
from __future__ import annotations

from typing import Optional

import pytest

from pdserve.config import EngineConfig
from pdserve.core.block_pool import BlockPool
from pdserve.core.kv_cache_manager import KVCacheManager
from pdserve.core.kv_transfers import KVTransfers
from pdserve.core.scheduler import Scheduler
from pdserve.sim.connector import Fabric, SimConnector, TransferModel
from pdserve.sim.node import SimNode
from pdserve.sim.trace import TraceRequest, prompt_token_ids

# small KV (forces preemption), a small token budget (chunked prefill), one prefix group (prefix-cache hits)
ENGINE = dict(max_model_len=192, num_gpu_blocks_override=14, block_size=16, max_num_seqs=4,
              max_num_batched_tokens=48, device="cpu")
VOCAB = 8192  # the tiny model's
TRACE = [  # (arrival step, request)
    (0, TraceRequest("a", 0.0, 40, 12)),
    (0, TraceRequest("b", 0.0, 70, 30, "sys", 48)),
    (1, TraceRequest("c", 0.0, 17, 25)),
    (3, TraceRequest("d", 0.0, 60, 40, "sys", 48)),
    (4, TraceRequest("e", 0.0, 33, 6)),
    (9, TraceRequest("f", 0.0, 100, 20)),
    (10, TraceRequest("g", 0.0, 49, 35, "sys", 48)),
    (30, TraceRequest("h", 0.0, 1, 8)),
    (31, TraceRequest("i", 0.0, 65, 45)),
    (60, TraceRequest("j", 0.0, 49, 10, "sys", 48)),  # a prefix hit leaving one token: FULL by the default rule
]


def _record(out, graph) -> tuple:
    mode, reason = (graph[0].value, graph[2]) if graph is not None else (None, None)
    rows = tuple((r.request.request_id, r.num_computed_tokens, r.num_scheduled_tokens) for r in out.rows)
    return rows, tuple(r.request_id for r in out.preempted), mode, reason


def _consumer() -> SimConnector:
    """A decode node's connector whose loads take 2 steps plus a step per 4 blocks (the clock counts steps)."""
    return SimConnector("kv_consumer", "d0", Fabric(TransferModel(64.0, 2.0), 1.0, 16), 16)


def _params(r: TraceRequest) -> Optional[dict]:
    """P's params, as the router hands them to D; none for a one-token prompt (the router sends it to D alone)."""
    return {"do_remote_prefill": True, "remote_engine_id": "p0", "remote_request_id": r.request_id} \
        if r.prompt_len > 1 else None


def run_engine(model: str, trace, consumer: bool = False, sampled: Optional[list] = None, **extra) -> list[tuple]:
    from pdserve.core.engine import LLMEngine
    from pdserve.core.output_processor import OutputProcessor
    from pdserve.request import Request
    from pdserve.sampling_params import SamplingParams
    engine = LLMEngine(EngineConfig.from_kwargs(model, **{"cudagraph_capture_sizes": "1,2,4,8,16", **ENGINE,
                                                          **extra}))
    conn = None
    if sampled is not None:  # the tokens each step sampled, for the simulator to replay
        execute = engine.runner.execute

        def spy_execute(rows, blocks_of):
            result = execute(rows, blocks_of)
            sampled.append(result.sampled)
            return result
        engine.runner.execute = spy_execute
    if consumer:  # the engine as a decode node over the simulated connector (no KV is written: only the
        # schedule is compared, and it never reads the KV)
        conn = engine.connector = _consumer()
        engine.scheduler = Scheduler(engine.config.scheduler, engine.kv, engine.max_model_len, None,
                                     KVTransfers(engine.kv, conn))
        engine.output_processor = OutputProcessor(engine.tokenizer, engine.scheduler.finish_request)
        engine.runner.is_pd_consumer = True
    steps, graphs = [], []
    schedule, choose = engine.scheduler.schedule, engine.runner.choose_graph

    def spy_schedule():
        steps.append(schedule())
        graphs.append(None)
        return steps[-1]

    def spy_choose(rows):
        graphs[-1] = choose(rows)
        return graphs[-1]
    engine.scheduler.schedule, engine.runner.choose_graph = spy_schedule, spy_choose
    k = 0
    while k <= trace[-1][0] or engine.has_unfinished_requests():
        for _, r in (x for x in trace if x[0] == k):
            sp = SamplingParams(max_tokens=r.output_len, ignore_eos=True, temperature=0)
            if consumer:  # checked params, as make_request leaves them (the gateway's proof is not what is tested)
                engine.add(Request(r.request_id, prompt_token_ids(r, VOCAB), sp, engine.eos_token_ids,
                                   max_tokens=r.output_len, kv_transfer_params=_params(r)))
            else:
                engine.add_request(prompt_token_ids(r, VOCAB), sp, request_id=r.request_id)
        if conn is not None:
            conn.now = float(k)
        engine.step()
        engine.check_invariants()
        k += 1
    return [_record(out, g) for out, g in zip(steps, graphs) if out.rows or out.preempted]


def run_sim(trace, profile, consumer: bool = False, sampled: Optional[list] = None, **extra) -> list[tuple]:
    config = EngineConfig.from_kwargs("sim", **{"cudagraph_capture_sizes": "1,2,4,8,16", **ENGINE, **extra})
    node = SimNode("n0", config, profile, 192, ENGINE["num_gpu_blocks_override"], _consumer() if consumer else None,
                   vocab_size=VOCAB)
    if sampled is not None:
        replay = iter(sampled)
        node.sampler = lambda out: next(replay)
    got = []
    schedule = node.scheduler.schedule

    def spy_schedule():
        got.append([schedule(), None])
        return got[-1][0]
    node.scheduler.schedule = spy_schedule
    k = 0
    while k <= trace[-1][0] or node.has_work():
        for _, r in (x for x in trace if x[0] == k):
            node.add(node.make_request(r.request_id, prompt_token_ids(r, VOCAB), r.output_len, 0.0,
                                       _params(r) if consumer else None))
        rec = node.step(float(k))
        if rec is not None:
            got[-1][1] = rec
        node.scheduler.check_invariants()
        k += 1
    out = []
    for sched_out, rec in got:
        if not (sched_out.rows or sched_out.preempted):
            continue
        mode, reason = (rec.mode or None, rec.reason) if rec is not None else (None, None)
        rows = tuple((r.request.request_id, r.num_computed_tokens, r.num_scheduled_tokens) for r in sched_out.rows)
        out.append((rows, tuple(r.request_id for r in sched_out.preempted), mode, reason))
    return out


def test_the_sims_scheduler_is_the_engines(linear_profile):
    node = SimNode("n0", EngineConfig.from_kwargs("sim", **ENGINE), linear_profile, 192, 14)
    assert type(node.scheduler) is Scheduler
    assert type(node.kv) is KVCacheManager and type(node.kv.pool) is BlockPool
    assert type(node.scheduler.transfers) is KVTransfers
    assert node.scheduler.kv is node.kv


@pytest.mark.timeout(300)
def test_recorded_trace_schedules_the_same_batches(qwen3_tiny_dir, linear_profile):
    real = run_engine(qwen3_tiny_dir, TRACE)
    sim = run_sim(TRACE, linear_profile)
    # the trace exercises what block accounting decides: preemption, chunked prefill, prefix hits
    assert any(pre for _, pre, _, _ in real), "the trace no longer preempts: shrink the KV cache"
    assert any(c > 0 and n > 1 for rows, *_ in real for _, c, n in rows), "no chunked prefill"
    assert any(mode == "FULL" for *_, mode, _ in real) and any(mode != "FULL" for *_, mode, _ in real)
    for i, (a, b) in enumerate(zip(real, sim)):
        assert a == b, f"step {i} differs:\n engine {a}\n sim    {b}"
    assert len(real) == len(sim)


@pytest.mark.timeout(300)
def test_recorded_trace_on_a_decode_node_schedules_the_same_batches(qwen3_tiny_dir, linear_profile):
    real = run_engine(qwen3_tiny_dir, TRACE, consumer=True)
    sim = run_sim(TRACE, linear_profile, consumer=True)
    replays = [row for rows, *_ in real for row in rows if row[1] > 0 and row[2] == 1
               and row[1] == next(t.prompt_len for _, t in TRACE if t.request_id == row[0]) - 1]
    assert len(replays) >= len(TRACE) - 1, "loads no longer end in one-token replays"
    assert any(mode == "FULL" for *_, mode, _ in real)
    for i, (a, b) in enumerate(zip(real, sim)):
        assert a == b, f"step {i} differs:\n engine {a}\n sim    {b}"
    assert len(real) == len(sim)


@pytest.mark.timeout(300)
def test_recorded_trace_with_speculative_decoding_schedules_the_same_batches(qwen3_tiny_dir, linear_profile):
    """With the engine's sampled tokens replayed, the n-gram drafts, lookahead slots, multi-token updates and the
    q = 1 + K graphs of the simulator's node are the engine's, step for step."""
    spec = {"speculative_config": '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1, '
                                  '"prompt_lookup_max": 2}',
            "cudagraph_capture_sizes": "1,2,3,4,6,8,9,12,16"}  # FULL sizes for q = 3 rows too
    trace = [(k, TraceRequest(r.request_id, 0.0, r.prompt_len, r.output_len, r.prefix_group, r.prefix_len))
             for k, r in TRACE]
    sampled: list = []
    real = run_engine(qwen3_tiny_dir, trace, sampled=sampled, **spec)
    from pdserve.spec_decode.config import SpeculativeConfig
    sim = run_sim(trace, linear_profile, sampled=sampled, cudagraph_capture_sizes=spec["cudagraph_capture_sizes"],
                  speculative_config=SpeculativeConfig.from_json(spec["speculative_config"]))
    assert any(isinstance(s, list) and len(s) > 1 for step in sampled for s in step), "no draft was accepted"
    assert any(mode == "FULL" and rows[0][2] == 3 for rows, _, mode, _ in real), "no drafting step rode FULL"
    for i, (a, b) in enumerate(zip(real, sim)):
        assert a == b, f"step {i} differs:\n engine {a}\n sim    {b}"
    assert len(real) == len(sim)
