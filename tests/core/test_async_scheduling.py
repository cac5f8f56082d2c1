"""Async scheduling (core/step_pipeline.py): the same tokens with the overlap on as off, and the overlap really on.

Every engine is stepped by hand with `check_invariants` after each step and its pool whole at the end; the async
engines must have scheduled while a step was in flight (`num_overlapped`) and run the forward off the engine
thread. Rows are recorded as they are prepared: without stop strings or preemptions a request computes exactly
its prompt (less its cache hit) and its outputs but the last, so no row is wasted on a token never kept."""
from __future__ import annotations

import logging
import threading
import time
from collections import Counter

import pytest

from pdserve import LLM, SamplingParams
from pdserve.core.step_pipeline import EngineStep, StepPipeline

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def ids(n: int, salt: int = 0) -> list[int]:
    return [3 + (salt * 131 + j * 37) % 900 for j in range(n)]


def make(model, on: bool, **kw):
    llm = LLM(model, dtype="float64", async_scheduling=on, **{"block_size": 4, "max_model_len": 64, **kw})
    e = llm.engine
    assert isinstance(e.steps, StepPipeline) == on
    e.scheduled, e.rows = Counter(), Counter()  # request id -> tokens its scheduled / prepared rows computed
    e.threads = set()  # threads that ran the model
    schedule, prepare, run = e.scheduler.schedule, e.runner.prepare, e.runner.run

    def scheduled():
        out = schedule()
        assert all(r.num_scheduled_tokens > 0 for r in out.rows), out.rows
        e.scheduled.update({r.request.request_id: r.num_scheduled_tokens for r in out.rows})
        return out

    def recorded(rows, table):
        e.rows.update({r.request.request_id: r.num_scheduled_tokens for r in rows})
        return prepare(rows, table)
    e.scheduler.schedule, e.runner.prepare = scheduled, recorded
    e.runner.run = lambda step: e.threads.add(threading.current_thread()) or run(step)
    return e


def drain(e, each=None) -> dict:
    """Step until idle, invariants checked after every step; the final outputs by request id."""
    final = {}
    while e.has_unfinished_requests():
        for o in e.step():
            assert o.request_id not in final, f"{o.request_id}: an output after its final one"
            if o.finished:
                final[o.request_id] = o
        e.check_invariants()
        if each is not None:
            each(e, final)
    e.check_invariants()
    assert e.kv.num_free_blocks() == e.num_blocks - 1, "blocks leaked"
    assert e.steps.in_flight is None
    return final


def run(model, on, prompts, params, **kw):
    e = make(model, on, **kw)
    params = params if isinstance(params, list) else [params] * len(prompts)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        e.add_request(p, sp, request_id=f"r{i}")
    return e, drain(e)


def summary(o) -> tuple:
    c = o.outputs[0]
    return c.token_ids, c.text, c.finish_reason, c.stop_reason, o.error


def same(model, prompts, params, no_waste=True, **kw):
    """Both modes give the same outputs; the async engine overlapped, off the engine thread; returns it."""
    (off, ref), (on, got) = (run(model, m, prompts, params, **kw) for m in (False, True))
    assert {k: summary(o) for k, o in got.items()} == {k: summary(o) for k, o in ref.items()}
    assert on.steps.num_overlapped > 0 and not hasattr(off.steps, "num_overlapped")
    assert off.threads == {threading.main_thread()} and threading.main_thread() not in on.threads
    if no_waste:
        for rid, o in got.items():
            want = len(o.prompt_token_ids) + len(o.outputs[0].token_ids) - 1 - o.num_cached_tokens
            assert on.scheduled[rid] == on.rows[rid] == want == off.rows[rid], \
                (rid, on.scheduled[rid], on.rows[rid], off.rows[rid], want)
    return on, got


def test_greedy_float64(qwen3_tiny):
    prompts = [ids(n, n) for n in (1, 3, 7, 12, 30)]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (12, 1, 20, 5, 9)]
    same(qwen3_tiny, prompts, params, max_num_batched_tokens=16)  # chunked prefills next to decodes


def test_outputs_come_one_step_later(qwen3_tiny):
    """One request: each token one step() after the synchronous engine's, none later, the last one not lost."""
    per_step = {}
    for on in (False, True):
        e = make(qwen3_tiny, on)
        e.add_request(ids(5), GREEDY, request_id="a")
        per_step[on] = []
        while e.has_unfinished_requests():
            per_step[on].append([t for o in e.step() for t in o.outputs[0].token_ids])
    assert per_step[True] == [[]] + per_step[False] and len(per_step[False]) == GREEDY.max_tokens


def test_seeded_sampling_penalties_and_logprobs(qwen3_tiny):
    params = [SamplingParams(temperature=0.8, seed=100 + i, max_tokens=16, ignore_eos=True, logprobs=3,
                             repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.3, top_p=0.95,
                             prompt_logprobs=2 if i == 1 else None) for i in range(4)]
    prompts = [ids(5 + 3 * i, i) for i in range(4)]
    (_, ref), (_, got) = (run(qwen3_tiny, m, prompts, params) for m in (False, True))
    for rid, o in got.items():
        r = ref[rid]
        assert summary(o) == summary(r)
        for a, b in zip(o.outputs[0].logprobs, r.outputs[0].logprobs):
            assert a.keys() == b.keys() and all(a[t].logprob == pytest.approx(b[t].logprob, abs=1e-9) for t in a)
        assert (o.prompt_logprobs is None) == (r.prompt_logprobs is None)
    assert len(got["r1"].prompt_logprobs) == 8


def test_stop_strings_and_stop_token_ids(qwen3_tiny):
    prompts = [ids(6, i) for i in range(3)]
    _, base = run(qwen3_tiny, False, prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    text, toks = base["r0"].outputs[0].text, base["r1"].outputs[0].token_ids
    assert len(text) > 12
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[text[6:10]]),
              SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop_token_ids=[toks[4]]),
              SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[toks[0]], min_tokens=3)]
    _, got = same(qwen3_tiny, prompts, params, no_waste=False)
    assert got["r0"].outputs[0].stop_reason == text[6:10] and got["r1"].outputs[0].stop_reason == toks[4]


def test_max_tokens_1_and_a_one_token_prompt_get_no_extra_row(qwen3_tiny):
    prompts = [[7], ids(9), [11], ids(16, 2)]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (1, 1, 6, 1)]
    on, got = same(qwen3_tiny, prompts, params)
    assert [on.rows[f"r{i}"] for i in range(4)] == [1, 9, 6, 16]


def test_max_model_len_cap_mid_run(qwen3_tiny):
    """Odd max_model_len 37 with no max_tokens: the length cap ends the requests mid-run, never a row past it."""
    prompts = [ids(n, n) for n in (5, 20, 33, 36)]
    _, got = same(qwen3_tiny, prompts, SamplingParams(temperature=0, max_tokens=None, ignore_eos=True),
                  max_model_len=37)
    assert all(len(o.prompt_token_ids) + len(o.outputs[0].token_ids) == 37 for o in got.values())
    assert all(o.outputs[0].finish_reason == "length" for o in got.values())


def test_prompts_of_k_blocks_and_k_blocks_plus_one(qwen3_tiny):
    base = ids(24, 5)
    prompts = [base[:n] for n in (4, 5, 8, 9, 16, 17)]  # block_size 4: each a prefix-cache hit of the last
    on, got = same(qwen3_tiny, prompts, GREEDY, max_num_seqs=2)
    assert sum(o.num_cached_tokens for o in got.values()) > 0


def test_preemption(qwen3_tiny):
    """9 usable blocks of 4 tokens for 4 requests that each need 7: preempted over and over, readmitted."""
    prompts = [ids(8, i) for i in range(4)]
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    on, got = same(qwen3_tiny, prompts, sp, no_waste=False, max_model_len=32, num_gpu_blocks_override=10)
    assert on.scheduler.num_preemptions > 0 and sum(o.num_preemptions for o in got.values()) > 0
    _, alone = run(qwen3_tiny, False, prompts, sp, max_model_len=32)  # no preemption: the same tokens
    assert {k: summary(o) for k, o in got.items()} == {k: summary(o) for k, o in alone.items()}


def test_aborts_in_flight_scheduled_and_waiting_and_an_id_reused(qwen3_tiny):
    prompts = [ids(6, i) for i in range(5)]
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    _, ref = run(qwen3_tiny, False, prompts, sp)
    e = make(qwen3_tiny, True, max_num_seqs=3)
    for i, p in enumerate(prompts):
        e.add_request(p, sp, request_id=f"r{i}")
    aborted = {}

    def abort_some(e, final):
        flight = {row.request.request_id for row in e.steps.in_flight[0].rows} if e.steps.in_flight else set()
        if "r0" not in aborted and "r0" in flight and len(e.scheduler.requests["r0"].output_token_ids) >= 3:
            aborted["r0"] = e.abort_request("r0")  # in flight: its landed token is dropped
            e.add_request(prompts[3], sp, request_id="r0")  # the id again, at once: a new request
        elif "r0" in aborted and "r1" not in aborted and "r1" in e.scheduler.requests:
            aborted["r1"] = e.abort_request("r1")  # scheduled, running
            aborted["r4"] = e.abort_request("r4")  # still waiting for a seat
        e.check_invariants()
    final = drain(e, abort_some)
    assert set(aborted) == {"r0", "r1", "r4"} and e.steps.num_overlapped > 0
    assert all(o.finished and o.outputs[0].finish_reason == "abort" for o in aborted.values())
    assert 3 <= len(aborted["r0"].outputs[0].token_ids) < 20
    assert ref["r0"].outputs[0].token_ids[:len(aborted["r0"].outputs[0].token_ids)] == \
        aborted["r0"].outputs[0].token_ids
    assert summary(final["r0"]) == summary(ref["r3"])  # the reused id got nothing of the aborted request
    assert {k: summary(final[k]) for k in ("r2", "r3")} == {k: summary(ref[k]) for k in ("r2", "r3")}


def flipping(period: int, log: list):
    """A drain() hook that asks for the other mode every `period` steps (the server's governor on a machine whose
    load comes and goes), logging (mode asked, a step in flight) at each ask."""
    def each(e, final):
        e.n = getattr(e, "n", 0) + 1
        if e.n % period == 0:
            log.append((not e.async_scheduling, e.steps.in_flight is not None))
            e.want_async_scheduling(not e.async_scheduling)
    return each


@pytest.mark.parametrize("period", [1, 3])
def test_switching_the_overlap_mid_run_keeps_every_token(qwen3_tiny, period):
    """Greedy float64 and seeded sampling with penalties and logprobs, chunked prefills beside decodes, a pool
    small enough to preempt: switched on and off every `period` steps (a step in flight landed at each switch off),
    the outputs are the synchronous engine's, no output after a final one, the pool whole (drain())."""
    prompts = [ids(n, n) for n in (1, 5, 9, 13, 21)]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (12, 1, 20, 7)] + [
        SamplingParams(temperature=0.8, seed=7, max_tokens=15, ignore_eos=True, logprobs=2, repetition_penalty=1.2,
                       presence_penalty=0.5, top_p=0.9)]
    kw = dict(max_num_batched_tokens=16, max_model_len=37, num_gpu_blocks_override=12)
    _, ref = run(qwen3_tiny, False, prompts, params, **kw)
    e = make(qwen3_tiny, False, **kw)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        e.add_request(p, sp, request_id=f"r{i}")
    log = []
    try:
        got = drain(e, flipping(period, log))
    finally:
        e.shutdown()
    assert {k: summary(o) for k, o in got.items()} == {k: summary(o) for k, o in ref.items()}
    for a, b in zip(got["r4"].outputs[0].logprobs, ref["r4"].outputs[0].logprobs):
        assert a.keys() == b.keys() and all(a[t].logprob == pytest.approx(b[t].logprob, abs=1e-9) for t in a)
    assert (False, True) in log and (True, False) in log  # switched off with a step in flight, and on
    assert e.scheduler.num_preemptions > 0
    assert e._pipelines[True].num_overlapped > 0 or period == 1  # every step a switch: launched, then landed
    assert {threading.main_thread()} < e.threads  # both threads ran the model


def test_switching_off_lands_an_aborted_step_in_flight(qwen3_tiny):
    """A request aborted while its step is in flight, then the overlap switched off before the next step: the
    landed token is dropped, the others go on to the synchronous engine's tokens, the pool whole."""
    prompts = [ids(6, i) for i in range(3)]
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    _, ref = run(qwen3_tiny, False, prompts, sp)
    e = make(qwen3_tiny, True)
    for i, p in enumerate(prompts):
        e.add_request(p, sp, request_id=f"r{i}")
    aborted = {}

    def abort_then_switch(e, final):
        flight = {row.request.request_id for row in e.steps.in_flight[0].rows} if e.steps.in_flight else set()
        if not aborted and "r1" in flight and len(e.scheduler.requests["r1"].output_token_ids) >= 2:
            aborted["r1"] = e.abort_request("r1")
            e.want_async_scheduling(False)
    try:
        got = drain(e, abort_then_switch)
    finally:
        e.shutdown()
    assert aborted and type(e.steps) is EngineStep and e.async_scheduling is False
    assert aborted["r1"].outputs[0].finish_reason == "abort"
    assert {k: summary(got[k]) for k in ("r0", "r2")} == {k: summary(ref[k]) for k in ("r0", "r2")}


def test_a_switch_carries_the_governors_thread_count(qwen3_tiny):
    """The count the governor set (on the thread that ran the model) is the new model thread's after a switch."""
    import torch

    e = make(qwen3_tiny, False)
    mine = torch.get_num_threads()
    want = 1 if mine > 1 else 2
    try:
        e.set_num_threads(want)
        e.want_async_scheduling(True)
        e.add_request(ids(5), GREEDY, request_id="a")
        drain(e)
        assert type(e.steps) is StepPipeline and e.steps.call(torch.get_num_threads) == want
        e.set_num_threads(mine)
        e.want_async_scheduling(False)
        e.add_request(ids(5), GREEDY, request_id="b")
        drain(e)
        assert type(e.steps) is EngineStep and torch.get_num_threads() == mine
        e.set_num_threads(want)
        assert torch.get_num_threads() == want
    finally:
        torch.set_num_threads(mine)
        e.shutdown()


def test_the_thread_that_hands_the_model_over_frees_its_openmp_pool(qwen3_tiny, monkeypatch):
    """Two OpenMP pools on the cores make libgomp stop spinning (worker/openmp.py): at each switch the thread that
    ran the model until then frees its own, the engine thread going async, the worker thread going back."""
    import pdserve.core.engine as engine_mod
    freed = []
    monkeypatch.setattr(engine_mod, "release_thread_pool", lambda: freed.append(threading.current_thread()))
    e = make(qwen3_tiny, False)
    try:
        for rid, on in (("a", True), ("b", False), ("c", True)):
            e.want_async_scheduling(on)
            e.add_request(ids(5), GREEDY, request_id=rid)
            drain(e)
    finally:
        e.shutdown()
    main = threading.main_thread()
    assert len(freed) == 3 and freed[0] is main and freed[2] is main and freed[1] is not main
    assert freed[1] in e.threads  # the worker thread that ran the model


def test_no_switch_with_speculative_decoding(qwen3_tiny):
    """Spec decode runs its steps one after another: asking for the overlap is a no-op there."""
    e = LLM(qwen3_tiny, dtype="float64", block_size=4, max_model_len=64,
            speculative_config={"method": "ngram", "num_speculative_tokens": 2}).engine
    e.want_async_scheduling(True)
    e.add_request(ids(9), GREEDY, request_id="a")
    while e.has_unfinished_requests():
        e.step()
    assert type(e.steps) is EngineStep and e.async_scheduling is False


@pytest.mark.parametrize("flag, want", [(None, [False, True, False]), (False, [False, False, False])])
def test_the_server_loop_overlaps_while_the_governor_reads_the_cores_crowded(qwen3_tiny, monkeypatch, flag, want):
    """EngineCore with auto (no flag): the engine runs its steps one after another, overlaps while the governor
    says `crowded`, and goes back when it no longer does; with --no-async-scheduling it never switches."""
    import queue

    from pdserve.config import EngineConfig
    from pdserve.serve.engine_commands import AddRequest, Stop
    from pdserve.serve.engine_core import EngineCore, QueueInbox
    from pdserve.serve.engine_messages import StepBatch
    from pdserve.worker import cpu_threads

    class Governor:  # what the loop reads of worker/cpu_threads.CpuThreads
        crowded, threads = False, 1

        def poll(self):
            return self.threads

    gov = Governor()
    monkeypatch.setattr(cpu_threads, "adaptive_threads", lambda *a, **k: gov)
    inbox, out = QueueInbox(), queue.Queue()
    core = EngineCore(EngineConfig.from_kwargs(qwen3_tiny, block_size=4, max_model_len=64, async_scheduling=flag),
                      inbox, out.put)
    thread = threading.Thread(target=core.run, daemon=True)
    modes = []

    def run_one(rid, crowded):
        gov.crowded = crowded
        sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        inbox.put(AddRequest(rid, ids(7), sp, time.monotonic()))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            batch = out.get(timeout=30)
            if isinstance(batch, StepBatch) and any(r.request_id == rid and r.finished for r in batch.records):
                break
        modes.append(core.engine.async_scheduling)
    thread.start()
    try:
        out.get(timeout=60)  # EngineInfo
        for rid, crowded in (("a", False), ("b", True), ("c", False)):
            run_one(rid, crowded)
    finally:
        inbox.put(Stop())
        thread.join(30)
    assert not thread.is_alive()
    assert modes == want


def test_a_failed_forward_fails_its_requests_and_the_engine_goes_on(qwen3_tiny, caplog):
    prompts = [ids(5, 1), ids(13, 2)]
    _, ref = run(qwen3_tiny, False, prompts, GREEDY)
    e = make(qwen3_tiny, True)
    run_step, calls = e.runner.run, [0]

    def flaky(step):
        calls[0] += 1
        if calls[0] == 3:  # mid-decode, on the worker thread
            raise RuntimeError("device lost")
        return run_step(step)
    e.runner.run = flaky
    for i, p in enumerate(prompts):
        e.add_request(p, GREEDY, request_id=f"r{i}")
    with caplog.at_level(logging.ERROR, logger="pdserve.engine"):
        final = drain(e)
    assert "model step failed" in caplog.text
    for o in final.values():
        assert o.outputs[0].finish_reason == "error" and "device lost" in o.error
        assert 0 < len(o.outputs[0].token_ids) < GREEDY.max_tokens
    e.runner.run = run_step  # the same worker thread serves the next request
    e.add_request(prompts[1], GREEDY, request_id="again")
    assert summary(drain(e)["again"]) == summary(ref["r1"])
    prepare = e.runner.prepare  # filling the inputs (engine thread) fails too: its rows' requests only
    e.runner.prepare = lambda rows, table: (_ for _ in ()).throw(RuntimeError("bad rows")) if len(rows) == 2 \
        else prepare(rows, table)
    e.add_request(prompts[0], GREEDY, request_id="one")
    e.step()
    e.add_request(prompts[1], GREEDY, request_id="two")
    final = drain(e)
    assert final["two"].outputs[0].finish_reason == "error" and "bad rows" in final["two"].error
    assert final["one"].outputs[0].finish_reason == "error"  # the step with both failed both


def test_a_forward_that_fails_in_flight_at_a_switch_off_fails_its_requests(qwen3_tiny, caplog):
    """The step in flight raises and the overlap is switched off before it lands: drain() fails its requests (an
    error, the tokens they had), the synchronous steps go on with the next request, the pool whole (drain())."""
    prompts = [ids(5, 1), ids(13, 2)]
    _, ref = run(qwen3_tiny, False, prompts, GREEDY)
    e = make(qwen3_tiny, True)
    run_step, calls = e.runner.run, [0]

    def flaky(step):
        calls[0] += 1
        if calls[0] == 3:  # mid-decode, on the worker thread
            raise RuntimeError("device lost")
        return run_step(step)
    e.runner.run = flaky
    for i, p in enumerate(prompts):
        e.add_request(p, GREEDY, request_id=f"r{i}")

    def switch_off_at_the_failing_step(e, final):
        if calls[0] == 3 and e.async_scheduling:
            e.want_async_scheduling(False)
    try:
        with caplog.at_level(logging.ERROR, logger="pdserve.engine"):
            final = drain(e, switch_off_at_the_failing_step)
        assert type(e.steps) is EngineStep and "model step failed" in caplog.text
        assert set(final) == {"r0", "r1"}  # the failed requests' final outputs went out
        for o in final.values():
            assert o.outputs[0].finish_reason == "error" and "device lost" in o.error
            assert 0 < len(o.outputs[0].token_ids) < GREEDY.max_tokens
        e.runner.run = run_step
        e.add_request(prompts[1], GREEDY, request_id="again")
        assert summary(drain(e)["again"]) == summary(ref["r1"])
    finally:
        e.shutdown()


def pd_pair(model, on: bool):
    """P and D over tcp on this process (test_pd_engine's), both with async scheduling `on`."""
    from tests.server_harness import free_port
    from tests.transfer.test_pd_engine import consumer, producer
    return producer(model, free_port(), {"async_scheduling": on}), consumer(model, {"async_scheduling": on})


def pd_whole(p, d):
    """D received KV and no load failed; P, stepped until idle, released the leases D confirmed; both pools whole."""
    from tests.transfer.test_pd_engine import assert_whole
    assert d.engine.connector.stats.bytes_received > 0 and not d.engine.connector.stats.failures
    while p.engine.has_unfinished_requests():
        p.engine.step()
    assert_whole(p, d)


def test_pd_async_equals_collocated_sync(qwen3_tiny):
    from tests.transfer.test_pd_engine import ENGINE, PROMPTS, drain, prefill_on
    p, d = pd_pair(qwen3_tiny, True)
    try:
        col = LLM(qwen3_tiny, async_scheduling=False, **ENGINE).generate(
            PROMPTS, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
        params = prefill_on(p, PROMPTS)
        assert all(kp is not None for i, kp in enumerate(params) if i != 4)  # "x": one token, nothing to hand on
        steps, start, behind = d.engine.steps, d.engine.connector.start_load_kv, []

        def start_load_kv(meta):  # a load may get blocks the step in flight still writes: it starts after it ran
            if any(job.dst_blocks for job in meta.loads) and steps.in_flight is not None:
                assert steps.in_flight[1].done()
                behind.append(meta)
            return start(meta)
        d.engine.connector.start_load_kv = start_load_kv
        sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        done = {}
        for i, (prompt, kp) in enumerate(zip(PROMPTS, params)):  # one arrival a step: loads start mid-run
            d.engine.add_request(prompt, sp, request_id=f"d{i}", kv_transfer_params=kp)
            done.update((o.request_id, o) for o in d.engine.step() if o.finished)
        done.update(drain(d))
        assert [done[f"d{i}"].outputs[0].token_ids for i in range(len(PROMPTS))] == \
            [o.outputs[0].token_ids for o in col]
        assert sum(o.num_external_tokens for o in done.values()) > 0
        assert behind, "no load started while a step was in flight"
        assert p.engine.steps.num_overlapped > 0 and d.engine.steps.num_overlapped > 0
        pd_whole(p, d)
    finally:
        p.engine.shutdown()
        d.engine.shutdown()


def test_pd_d_switching_every_step_equals_collocated(qwen3_tiny):
    """D (its governor's switch, by hand) turns the overlap on and off every step while KV loads arrive and land:
    the tokens are collocated's, both pools whole."""
    from tests.transfer.test_pd_engine import ENGINE, PROMPTS, prefill_on
    p, d = pd_pair(qwen3_tiny, False)
    try:
        sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        col = LLM(qwen3_tiny, **ENGINE).generate(PROMPTS, sp, use_tqdm=False)
        params = prefill_on(p, PROMPTS)
        done, modes, t0 = {}, set(), time.monotonic()

        def step():
            d.engine.want_async_scheduling(not d.engine.async_scheduling)
            done.update((o.request_id, o) for o in d.engine.step() if o.finished)
            modes.add(d.engine.async_scheduling)
        for i, (prompt, kp) in enumerate(zip(PROMPTS, params)):  # one arrival a step: loads start mid-run
            d.engine.add_request(prompt, sp, request_id=f"d{i}", kv_transfer_params=kp)
            step()
        while d.engine.has_unfinished_requests():
            assert time.monotonic() - t0 < 30, "D did not finish"
            step()
        assert [done[f"d{i}"].outputs[0].token_ids for i in range(len(PROMPTS))] == \
            [o.outputs[0].token_ids for o in col]
        assert modes == {True, False} and sum(o.num_external_tokens for o in done.values()) > 0
        pd_whole(p, d)
    finally:
        p.engine.shutdown()
        d.engine.shutdown()


def test_speculative_decoding_runs_synchronously(qwen3_tiny, caplog):
    prompts = [ids(12, 1) * 2, ids(9, 4)]  # a repeated prompt: n-gram drafts hit
    _, ref = run(qwen3_tiny, True, prompts, GREEDY)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    with caplog.at_level(logging.INFO, logger="pdserve.engine"):
        llm = LLM(qwen3_tiny, dtype="float64", block_size=4, max_model_len=64, speculative_config=spec,
                  async_scheduling=True)
    e = llm.engine
    assert type(e.steps) is EngineStep and "async scheduling is off with speculative decoding" in caplog.text
    for i, p in enumerate(prompts):
        e.add_request(p, GREEDY, request_id=f"r{i}")
    got = drain(e)
    assert {k: summary(o) for k, o in got.items()} == {k: summary(o) for k, o in ref.items()}
    assert e.spec_decode_stats()["num_drafts"] > 0


def test_default_is_on_for_cuda_and_off_on_cpu(qwen3_tiny):
    """Unset means auto: on a CPU the overlap measured slower (benchmarks/results/step_overhead_async.json), so a
    CPU engine runs its steps synchronously unless asked; an explicit choice wins on either device."""
    from pdserve.config import SchedulerConfig
    auto = SchedulerConfig()
    assert auto.async_scheduling is None
    assert auto.use_async_scheduling("cuda") and not auto.use_async_scheduling("cpu")
    for on in (True, False):
        assert SchedulerConfig(async_scheduling=on).use_async_scheduling("cpu") is on
        assert SchedulerConfig(async_scheduling=on).use_async_scheduling("cuda") is on
    e = LLM(qwen3_tiny, block_size=4, max_model_len=64).engine
    assert type(e.steps) is EngineStep and e.async_scheduling is False
    e = LLM(qwen3_tiny, block_size=4, max_model_len=64, async_scheduling=True).engine
    try:
        assert type(e.steps) is StepPipeline and e.async_scheduling is True
    finally:
        e.shutdown()


@pytest.mark.parametrize("argv, want", [([], None), (["--async-scheduling"], True),
                                        (["--no-async-scheduling"], False)])
def test_flag_is_three_way(argv, want):
    """vLLM's flag name; not given is auto (None), never a fixed default baked into the parser."""
    import argparse

    from pdserve.config import SchedulerConfig, add_dataclass_args, engine_kwargs_from_args
    p = argparse.ArgumentParser()
    add_dataclass_args(p, SchedulerConfig)
    assert engine_kwargs_from_args(p.parse_args(argv))["async_scheduling"] is want


def test_help_states_the_default_and_why(capsys):
    from pdserve.cli import main
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    flag = "--async-scheduling, --no-async-scheduling "
    text = out[out.index(flag) + len(flag):]
    text = text[:text.index(" --cudagraph-mode")]
    assert "Default: auto, on with CUDA, off on CPU" in text and "slower" in text, text
    assert "except in a server while other processes use half the cores or more" in text, text


def test_thread_count_is_set_where_the_model_runs(qwen3_tiny):
    """The CPU thread governor's switches (worker/cpu_threads.py) must reach the worker thread: torch's OpenMP
    count is per thread, and one set on the engine thread leaves a started worker's as it was."""
    import torch

    e = make(qwen3_tiny, True)
    try:
        e.add_request(ids(5), GREEDY, request_id="a")
        drain(e)  # the worker thread is started
        before = e.steps.call(torch.get_num_threads)
        mine = torch.get_num_threads()
        want = 1 if before > 1 else 2
        e.set_num_threads(want)
        assert e.steps.call(torch.get_num_threads) == want
        assert torch.get_num_threads() == mine  # the engine thread runs no parallel region: left alone
        e.set_num_threads(before)
    finally:
        e.shutdown()


def test_the_governors_switches_reach_the_worker_thread(qwen3_tiny, monkeypatch):
    """Offline (LLM) and in the server's engine loop (EngineCore), the governor sets the count through the engine,
    so an async engine's switch lands on its worker thread; the loop's EngineInfo says the mode."""
    import queue

    import torch

    from pdserve.config import EngineConfig
    from pdserve.serve.engine_commands import Stop
    from pdserve.serve.engine_core import EngineCore, QueueInbox
    from pdserve.serve.engine_messages import EngineInfo
    if torch.get_num_threads() <= 1:
        pytest.skip("one intra-op thread: no governor")
    monkeypatch.setenv("PDSERVE_ADAPTIVE_THREADS", "1")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    mine = torch.get_num_threads()
    llm = LLM(qwen3_tiny, block_size=4, max_model_len=64, async_scheduling=True)
    try:
        assert llm.engine.steps.call(torch.get_num_threads) == mine  # the worker thread is started
        llm.cpu_threads._set(1)
        assert llm.engine.steps.call(torch.get_num_threads) == 1 and torch.get_num_threads() == mine
        llm.cpu_threads._set(mine)  # torch keeps the last count set for threads started later (the loop's)
    finally:
        llm.engine.shutdown()
    inbox, out = QueueInbox(), queue.Queue()
    core = EngineCore(EngineConfig.from_kwargs(qwen3_tiny, block_size=4, max_model_len=64, async_scheduling=True),
                      inbox, out.put)
    thread = threading.Thread(target=core.run, daemon=True)
    thread.start()
    try:
        info = out.get(timeout=60)
        assert isinstance(info, EngineInfo) and info.async_scheduling is True
        deadline = time.monotonic() + 20
        while getattr(core, "cpu_threads", None) is None and time.monotonic() < deadline:  # made after EngineInfo
            time.sleep(0.01)
        assert core.engine.steps.call(torch.get_num_threads) == mine  # the worker thread is started
        core.cpu_threads._set(1)  # from this thread: the worker's count, set after the step in flight
        assert core.engine.steps.call(torch.get_num_threads) == 1
        core.cpu_threads._set(mine)
    finally:
        inbox.put(Stop())
        thread.join(20)
    assert not thread.is_alive()


def test_p_handing_its_first_token_to_d_gets_no_extra_row(qwen3_tiny):
    """P asked for the first token (issue 35) runs with the client's max_tokens but stops after one token: with
    that token in flight the schedule must not give it a decode row (a row, and at a block boundary a block, for a
    token never kept); the params it hands on carry the token."""
    from tests.server_harness import free_port
    kv = {"kv_connector": "TcpConnector", "kv_auth_token": "secret", "kv_role": "kv_producer",
          "kv_port": free_port(), "engine_id": "P0"}
    e = make(qwen3_tiny, True, kv_transfer_config=kv)
    try:
        sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        for n in (3, 4, 8, 9):  # block_size 4: the next position on a block boundary or not
            e.add_request(ids(n, n), sp, request_id=f"p{n}", kv_transfer_params={"do_remote_decode": True,
                                                                                  "first_token": True})
        final = {}
        while e.scheduler.has_unfinished():  # P's leases keep the engine polling: not drain
            final.update((o.request_id, o) for o in e.step() if o.finished)
            e.check_invariants()
        assert e.steps.num_overlapped > 0
        for n in (3, 4, 8, 9):
            o = final[f"p{n}"]
            assert len(o.outputs[0].token_ids) == 1 and o.kv_transfer_params["first_token"]["id"] == \
                o.outputs[0].token_ids[0]
            assert e.scheduled[f"p{n}"] == n, (n, e.scheduled[f"p{n}"])
    finally:
        e.shutdown()
