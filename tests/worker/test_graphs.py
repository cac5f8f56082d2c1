"""FULL decode steps on CPU: same outputs as eager, padding confined to the null block, capture-ready callables,
and the seed's arrival scenario under the three rules."""
from __future__ import annotations

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.sched_output import NULL_BLOCK
from pdserve.worker.cudagraph_dispatch import BatchDescriptor

CONSUMER = {"kv_connector": "DecodeBenchConnector", "kv_role": "kv_consumer"}
# synchronous steps: the tests look at what a step() wrote (KV, logits) as soon as it returns
SMALL = dict(max_model_len=256, kv_cache_memory_gb=0.05, max_num_seqs=64, async_scheduling=False)


def make(model, **kw):
    return LLM(model, **{**SMALL, **kw})


def greedy(n):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def prompt(i, n=20):
    return [3 + (i * 7919 + j * 104729) % 8000 for j in range(n)]


def run_mixed_step(llm, b, logits_by_step):
    """b//2 requests decoding plus b - b//2 replay arrivals in one step; returns that step's graph record."""
    e = llm.engine
    for i in range(b // 2):
        e.add_request(prompt(i, 20 + i), greedy(8), request_id=f"dec{b}-{i}")
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in e.scheduler.running + list(e.scheduler.waiting)):
        e.step()
    for i in range(b - b // 2):
        e.add_prefilled_request(prompt(100 + i, 30 + 3 * i), greedy(8), request_id=f"rep{b}-{i}")
    before = dict(e.runner.graph_stats.steps)
    logits_by_step.clear()
    e.step()
    after = e.runner.graph_stats.steps
    return {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}


def drain(llm) -> dict:
    done = {}
    while llm.engine.has_unfinished_requests():
        for o in llm.engine.step():
            if o.finished:
                done[o.request_id] = o.outputs[0].token_ids
    finish_all(llm)
    return done


def finish_all(llm):
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    llm.engine.check_invariants()
    assert llm.engine.kv.num_free_blocks() == llm.engine.num_blocks - 1


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_full_step_equals_eager(qwen3_tiny, dtype):
    full, eager = make(qwen3_tiny, dtype=dtype), make(qwen3_tiny, dtype=dtype, enforce_eager=True)
    logits = {}
    for name, llm in (("full", full), ("eager", eager)):
        llm.engine.runner.logits_hook = lambda reqs, lg, name=name: logits.setdefault(name, {}).update(
            {r.request_id: lg[i].clone() for i, r in enumerate(reqs)})
    for b in [1, 2, 3, 4, 5, 8, 9, 16, 17, 24, 31, 32, 40, 47, 48, 56, 63, 64]:
        rec_full = run_mixed_step(full, b, logits.setdefault("full", {}))
        rec_eager = run_mixed_step(eager, b, logits.setdefault("eager", {}))
        assert rec_full == {("FULL", "none"): 1}, (b, rec_full)
        assert rec_eager == {("NONE", "eager_forced"): 1}, (b, rec_eager)
        assert logits["full"].keys() == logits["eager"].keys() and len(logits["full"]) == b
        for rid, lf in logits["full"].items():
            diff = (lf - logits["eager"][rid]).abs().max().item()
            if dtype == "float64":
                assert diff == 0.0, (b, rid, diff)
            else:
                assert diff <= 1e-5, (b, rid, diff)
        # KV of every real block: the same whether the step ran padded (FULL) or not (eager), up to the GEMM
        # rounding of the slots this step wrote (a padded M may take another kernel blocking);
        # test_padding_writes_only_the_null_block shows no other real slot changes at all.
        for cf, ce in zip(full.engine.runner.kv_caches, eager.engine.runner.kv_caches):
            diff = (cf[:, 1:] - ce[:, 1:]).abs().max().item()
            assert diff <= (1e-12 if dtype == "float64" else 1e-5), (b, diff)
        assert drain(full) == drain(eager), b


def test_padding_writes_only_the_null_block(qwen3_tiny):
    llm = make(qwen3_tiny, dtype="float64")
    e = llm.engine
    for i in range(3):
        e.add_prefilled_request(prompt(i, 40), greedy(4), request_id=f"r{i}")
    snapshot = [c.clone() for c in e.runner.kv_caches]
    written = {(e.kv.blocks_of(f"r{i}")[39 // 16], 39 % 16) for i in range(3)}  # each replay's own slot
    e.step()  # 3 rows padded to the size-4 FULL graph
    assert e.graph_stats()["steps"] == {"FULL/none": 1} and e.graph_stats()["padded_tokens"] == 1
    for before, after in zip(snapshot, e.runner.kv_caches):
        changed = (before != after).flatten(3).any(-1)  # [2, blocks, slots]
        slots = {(int(b), int(s)) for _, b, s in changed.nonzero().tolist()}
        assert slots - {(NULL_BLOCK, s) for s in range(16)} <= written
        assert slots & {(NULL_BLOCK, s) for s in range(16)}, "the padded row should have written the null block"
    finish_all(llm)


def test_full_step_has_no_graph_break_and_stable_buffers(qwen3_tiny):
    """What CUDA capture needs, checked on CPU: no graph break (no .item(), no data-dependent shape or branch)
    and input buffers that never move."""
    llm = make(qwen3_tiny, dtype="float64")  # float64: plain F.linear, no oneDNN-packed weights
    e = llm.engine
    runner = e.runner
    out_ptr = runner.full_graphs.out.data_ptr()
    for i in range(5):
        e.add_prefilled_request(prompt(i, 33), greedy(6), request_id=f"c{i}")
    e.step()
    desc = BatchDescriptor(8, 8, 1)
    layout = runner.full_graphs.layout_for(desc, [3, 3, 3, 9, 9])
    assert len(layout) > 1  # several width groups: the compiled step covers the grouped path too
    step = runner.full_graphs.step_callable(desc, layout)
    with torch.inference_mode():
        expected = step().clone()
        torch._dynamo.reset()
        compiled = torch.compile(step, backend="eager", fullgraph=True)
        got = compiled()
    assert torch.equal(got, expected)
    # The callable reads the tensors it was built on for good (a CUDA graph replays fixed addresses), so every later
    # step must find in them what prepare() wrote for it. Checked by value: on CPU the device tensors are views of
    # prepare's host arrays, so their data_ptrs stay put even when prepare writes a reallocated array.
    reads = dict(zip(step.__code__.co_freevars, (c.cell_contents for c in step.__closure__)))
    meta = reads["meta"]
    for _ in range(2):
        e.step()  # a FULL step on the same descriptor and layout: the same callable
        assert runner.full_graphs.step_callable(desc, layout) is step
        want = []
        for r in e.scheduler.running:
            c, blocks = r.num_computed_tokens - 1, e.kv.blocks_of(r.request_id)
            want.append((r.all_token_ids[c], c, blocks[c // 16] * 16 + c % 16, blocks[:3]))
        tables = [row[:3] for g in meta.groups for row in g.block_table.tolist()]
        got = list(zip(reads["input_ids"].tolist(), reads["positions"].tolist(), meta.slot_mapping.tolist(), tables))
        assert sorted(got[:5]) == sorted(want), (got, want)
        assert torch.cat([g.positions.flatten() for g in meta.groups]).tolist() == reads["positions"].tolist()
    assert e.graph_stats()["steps"] == {"FULL/none": 3}
    finish_all(llm)
    assert runner.full_graphs.out.data_ptr() == out_ptr
    assert step().data_ptr() == out_ptr  # the step writes its result into the static output buffer


@pytest.mark.parametrize("extra,full", [(1, True), (0, False)])
def test_collocated_prefix_hit_kb_plus_one_rides_full(qwen3_tiny, extra, full):
    """n = kB + 1: a prefix hit leaves one decode-shaped token, which rides FULL among decodes; n = kB leaves
    a whole block and never does."""
    llm = make(qwen3_tiny, dtype="float32", enable_prefix_caching=True)
    e = llm.engine
    n = 3 * 16 + extra
    llm.generate([prompt(7, n)], greedy(2), use_tqdm=False)  # populate the prefix cache
    for i in range(4):
        e.add_request(prompt(20 + i, 10), greedy(30), request_id=f"d{i}")
    for _ in range(3):
        e.step()
    before = e.graph_stats()["steps"]
    e.add_request(prompt(7, n), greedy(3), request_id="again")
    e.step()
    after = e.graph_stats()["steps"]
    delta = {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}
    # a hit never covers the last token: floor((n - 1) / B) blocks
    assert e.scheduler.requests["again"].num_cached_tokens == (3 * 16 if extra else 2 * 16)
    assert delta == ({"FULL/none": 1} if full else {"PIECEWISE/prefill": 1}), delta
    finish_all(llm)


def seed_scenario(model, rule, steps=200, every=5):
    """16 requests decoding, a replay arrival every few steps."""
    llm = make(model, dtype="float32", full_graph_rule=rule, kv_transfer_config=CONSUMER)
    e = llm.engine
    for i in range(16):
        e.add_prefilled_request(prompt(i, 24 + i), greedy(210), request_id=f"base{i}")
    arrivals, out = 0, {}
    for step in range(steps):
        if step % every == every - 1:
            e.add_prefilled_request(prompt(500 + step, 40 + step % 23), greedy(20), request_id=f"arr{step}")
            arrivals += 1
        for o in e.step():
            if o.finished:
                out[o.request_id] = o.outputs[0].token_ids
    for rid in list(e.scheduler.requests):
        e.abort_request(rid)
    e.check_invariants()
    assert e.kv.num_free_blocks() == e.num_blocks - 1
    return e.graph_stats(), arrivals, out


def test_seed_scenario_three_rules(qwen3_tiny):
    results = {rule: seed_scenario(qwen3_tiny, rule) for rule in ("strict", "prompt-tail", "decode-shaped")}
    stats, arrivals, _ = results["strict"]
    # every arrival step, plus the first step, where the 16 base requests replay together
    assert stats["non_full_by_reason"] == {"prefill": arrivals + 1}, stats
    for rule in ("prompt-tail", "decode-shaped"):
        stats = results[rule][0]
        assert stats["non_full_by_reason"].get("prefill", 0) == 0 and stats["non_full_steps"] == 0, (rule, stats)
    assert results["strict"][2] == results["prompt-tail"][2] == results["decode-shaped"][2]
    assert len(results["strict"][2]) >= arrivals - 5  # the last few arrivals are still decoding at the end


def test_cudagraph_metrics_table_is_logged(qwen3_tiny, caplog):
    llm = make(qwen3_tiny, cudagraph_metrics=True, cudagraph_metrics_interval=1e-9)
    with caplog.at_level("INFO", logger="pdserve.cudagraph"):
        llm.generate(["def f():", "import os"], greedy(3), use_tqdm=False)
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "Runtime Mode" in text and "Reason" in text and "Num Paddings" in text
    assert "PIECEWISE" in text and "prefill" in text and "FULL" in text
    s = llm.engine.graph_stats()
    assert s["device"] == "cpu" and s["captured"] is False
    assert s["total_steps"] == s["full_steps"] + s["non_full_steps"] == 3


def test_width_groups_merge_equal_widths_and_keep_distinct_ones():
    """Rows sorted by width form up to 4 groups, each as wide as its widest row; adjacent groups of one width are
    one group (one gather and one attention call per layer, not four of the same width); padding rows join the
    last group; no group is wider than the table."""
    from pdserve.attention.metadata import width_groups
    assert width_groups([5] * 7, 8) == ((0, 8, 5),)
    assert width_groups([1, 2, 3, 9]) == ((0, 1, 1), (1, 2, 2), (2, 3, 3), (3, 4, 9))
    assert width_groups([2, 2, 3, 3, 3, 7], 9) == ((0, 2, 2), (2, 4, 3), (4, 9, 7))
    assert width_groups([3, 3, 5, 5, 5], round_to=4) == ((0, 2, 4), (2, 5, 8))
    assert width_groups([1, 1, 30, 40], max_width=32) == ((0, 2, 1), (2, 3, 30), (3, 4, 32))
    assert width_groups([17]) == ((0, 1, 17),)


def test_non_full_reasons_add_up_across_modes():
    """A prefill that rides PIECEWISE and one over the largest capture size that runs eagerly share a reason."""
    from pdserve.worker.graph_metrics import GraphStats
    stats = GraphStats("cpu", captured=False)
    for mode, reason in [("PIECEWISE", "prefill"), ("PIECEWISE", "prefill"), ("NONE", "prefill"),
                         ("NONE", "eager_forced"), ("FULL", None)]:
        stats.record(mode, 8, 8, 2, reason)
    snap = stats.snapshot()
    assert snap["non_full_by_reason"] == {"prefill": 3, "eager_forced": 1}
    assert sum(snap["non_full_by_reason"].values()) == snap["non_full_steps"] == 4


def test_cudagraph_metrics_tables_cover_whole_bursts(monkeypatch, caplog):
    """A table's window starts at its first step: after an idle spell the first step of a burst no longer goes
    out alone with the rest held back, and the engine loop's flush_if_due sends a burst's tail while idle."""
    from pdserve.worker import graph_metrics
    now = [100.0]
    monkeypatch.setattr(graph_metrics.time, "monotonic", lambda: now[0])
    stats = graph_metrics.GraphStats("cpu", captured=False, log_interval=1.0)
    with caplog.at_level("INFO", logger="pdserve.cudagraph"):
        for _ in range(30):  # a 0.3 s burst, long after start-up
            stats.record("FULL", 4, 4, 4, None)
            now[0] += 0.01
        assert not caplog.records
        stats.flush_if_due()
        assert not caplog.records  # not due: 0.3 s into the window
        now[0] += 1.0
        stats.flush_if_due()
        stats.flush_if_due()  # nothing left: no empty table
    tables = [r.getMessage() for r in caplog.records]
    assert len(tables) == 1 and "30 steps over 1.3 s" in tables[0] and tables[0].rstrip().endswith("30"), tables


def test_resumed_preempted_request_is_labelled_prefill(qwen3_tiny):
    """A preempted request readmitted past its prompt (a prefix hit on its prompt blocks) recomputes its outputs:
    that step is a prefill, alone or mixed, never `non_uniform` (q = 1 here: no row can be a short decode)."""
    # 6 usable blocks of 16: at 48 tokens each, two 32-token prompts need a 4th block: p1 is preempted, freeing its
    # tail first; p0 (done at 62 tokens) takes only that one, so p1's prompt blocks survive for its readmission
    llm = make(qwen3_tiny, dtype="float32", enable_prefix_caching=True, num_gpu_blocks_override=7,
               max_model_len=96)
    e, runner = llm.engine, llm.engine.runner
    choose, seen = runner.choose_graph, []

    def spy(rows):
        got = choose(rows)
        seen.append(([(r.num_computed_tokens, r.num_scheduled_tokens, r.request.num_prompt_tokens) for r in rows],
                     got[2]))
        return got
    runner.choose_graph = spy
    for i, n in ((0, 30), (1, 40)):
        e.add_request(prompt(40 + i, 32), greedy(n), request_id=f"p{i}")
    preempted = {}
    while e.has_unfinished_requests():
        preempted.update((o.request_id, o.num_preemptions) for o in e.step() if o.finished)
    finish_all(llm)
    assert e.scheduler.num_preemptions == 1 and preempted == {"p0": 0, "p1": 1}, preempted  # what /metrics reads
    resumed = [(rows, reason) for rows, reason in seen if any(n > 1 and c >= p for c, n, p in rows)]
    assert resumed, seen  # the readmission hit the whole prompt and recomputed the outputs past it
    assert all(reason == "prefill" for _, reason in resumed), resumed
    assert not any(reason == "non_uniform" for _, reason in seen)


def test_arrival_driver_counts_imported_tokens_as_external(qwen3_tiny):
    """The arrival driver's KV stands in for a prefill node's: external, after any local prefix hit (what
    vllm:prompt_tokens_by_source reads); the replay's last token is computed."""
    llm = make(qwen3_tiny, dtype="float32", kv_transfer_config=CONSUMER, enable_prefix_caching=True)
    e = llm.engine
    got = {}
    for rid in ("first", "again"):  # 37 tokens: the second hits the first's 2 full blocks
        e.add_prefilled_request(prompt(9, 37), greedy(2), request_id=rid)
        while e.has_unfinished_requests():
            for o in e.step():
                got.setdefault(o.request_id, (o.num_cached_tokens, o.num_external_tokens))
    assert got == {"first": (0, 36), "again": (32, 4)}, got
    finish_all(llm)
