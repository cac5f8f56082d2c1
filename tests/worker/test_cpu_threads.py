"""The CPU thread governor (worker/cpu_threads.py): what it reads of the machine and when it changes the count."""
import gc
import os

import pytest

from pdserve.worker import cpu_threads
from pdserve.worker.cpu_threads import CpuThreads, adaptive_threads, machine_busy_seconds, process_cpu_seconds


class FakeMachine:
    """A clock, the machine's busy seconds and our own CPU seconds, advanced by hand."""

    def __init__(self):
        self.t = self.busy = self.mine = 0.0
        self.set_calls = []

    def run(self, seconds: float, others: float, mine: float = 1.0):
        """`seconds` pass; the rest of the machine uses `others` cores, this process `mine`."""
        self.t += seconds
        self.busy += seconds * (others + mine)
        self.mine += seconds * mine

    def governor(self, max_threads=2, cores=2, **kw):
        g = CpuThreads(max_threads, interval=0.5, set_threads=self.set_calls.append, clock=lambda: self.t,
                       busy=lambda: self.busy, own=lambda pid: self.mine if pid is None else 0.0, **kw)
        g.cores = cores
        return g


def test_keeps_its_threads_while_the_cores_are_its_own():
    m = FakeMachine()
    g = m.governor()
    for _ in range(10):
        m.run(0.5, others=0.05, mine=2.0)
        assert g.poll() == 2
    assert m.set_calls == [] and g.others == pytest.approx(0.05)


def test_drops_to_one_beside_a_busy_process_and_comes_back_without_flapping():
    m = FakeMachine()
    g = m.governor()
    m.run(0.5, others=0.9)
    assert g.poll() == 1 and m.set_calls == [1]
    m.run(0.5, others=0.2)  # between low and high: stays
    assert g.poll() == 1
    m.run(0.5, others=0.1)
    assert g.poll() == 2 and m.set_calls == [1, 2]
    m.run(0.5, others=0.31)  # just over high
    assert g.poll() == 1


def test_crowded_while_others_hold_half_the_cores_with_a_band_against_flapping():
    """`crowded` (the server's cue to overlap its steps) is on above half the cores + band, off below half - band."""
    m = FakeMachine()
    g = m.governor(max_threads=2, cores=2)
    seen = []
    for others in (0.7, 1.2, 1.3, 1.0, 0.8, 0.74, 1.26, 3.0):
        m.run(0.5, others=others)
        g.poll()
        seen.append(g.crowded)
    assert seen == [False, False, True, True, True, False, True, True]
    m16 = FakeMachine()
    g16 = m16.governor(max_threads=16, cores=16)
    m16.run(0.5, others=7.0)
    g16.poll()
    assert not g16.crowded  # 7 of 16 cores: not half
    m16.run(0.5, others=8.5)
    g16.poll()
    assert g16.crowded


def test_reads_at_most_once_an_interval():
    m = FakeMachine()
    g = m.governor()
    m.run(0.3, others=1.5)
    assert g.poll() == 2 and m.set_calls == []  # too soon: not even read
    m.run(0.3, others=1.5)
    assert g.poll() == 1


def test_many_cores_keep_what_the_others_leave():
    m = FakeMachine()
    g = m.governor(max_threads=16, cores=16)
    m.run(0.5, others=4.0)
    assert g.poll() == 12  # what the other processes leave
    m.run(0.5, others=4.0)
    assert g.poll() == 12
    m.run(0.5, others=0.0)
    assert g.poll() == 13  # back up one a reading


def test_the_server_process_counts_as_its_own_work():
    m = FakeMachine()
    server = {"cpu": 0.0}
    g = CpuThreads(2, interval=0.5, partner_pid=1234, set_threads=m.set_calls.append, clock=lambda: m.t,
                   busy=lambda: m.busy, own=lambda pid: m.mine if pid is None else server["cpu"])
    g.cores = 2
    m.run(0.5, others=0.6)  # all of it the server's
    server["cpu"] += 0.3
    assert g.poll() == 2 and g.others == pytest.approx(0.0)


def test_proc_readers(tmp_path):
    stat = tmp_path / "stat"
    tick = cpu_threads._TICK
    stat.write_text(f"cpu  {3 * tick} 0 {tick} {50 * tick} 7 0 0 {tick} 0 0\ncpu0 1 2 3\n")
    assert machine_busy_seconds(str(stat)) == pytest.approx(5.0)  # user + system + steal; idle and iowait not
    stat.write_text("intr 1 2 3\n")
    assert machine_busy_seconds(str(stat)) is None
    assert machine_busy_seconds(str(tmp_path / "missing")) is None
    assert process_cpu_seconds(2 ** 22 + 17) == 0.0  # no such process
    sum(i * i for i in range(300_000))
    assert abs(process_cpu_seconds(os.getpid()) - process_cpu_seconds()) < 0.1


def test_off_where_the_count_is_not_its_to_choose(monkeypatch):
    monkeypatch.setattr(cpu_threads.torch, "get_num_threads", lambda: 2)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("PDSERVE_ADAPTIVE_THREADS", "1")
    assert adaptive_threads("cuda") is None
    g = adaptive_threads("cpu")
    assert g is not None and g.max_threads == 2
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert adaptive_threads("cpu") is None
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setenv("PDSERVE_ADAPTIVE_THREADS", "0")
    assert adaptive_threads("cpu") is None
    monkeypatch.setenv("PDSERVE_ADAPTIVE_THREADS", "1")
    monkeypatch.setattr(cpu_threads.torch, "get_num_threads", lambda: 1)
    assert adaptive_threads("cpu") is None


def test_small_steps_are_gated_by_tokens_times_parameters(monkeypatch):
    """The tiny model (~5M parameters) runs its steps of up to 3 tokens on one thread; the small model (~110M)
    none; PDSERVE_SMALL_STEP_THREADS=0 turns the rule off."""
    tiny, small = cpu_threads.SmallSteps(5_000_000), cpu_threads.SmallSteps(110_000_000)
    assert [tiny.small(n) for n in (1, 2, 3, 4, 128)] == [True, True, True, False, False]
    assert not small.small(1)
    monkeypatch.setenv("PDSERVE_SMALL_STEP_THREADS", "0")
    assert cpu_threads.small_steps(5_000_000) is None
    monkeypatch.delenv("PDSERVE_SMALL_STEP_THREADS")
    assert cpu_threads.small_steps(5_000_000).params == 5_000_000


def test_one_thread_gives_the_count_back_even_when_the_step_fails():
    import torch
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with pytest.raises(RuntimeError):
            with cpu_threads.SmallSteps.one_thread():
                assert torch.get_num_threads() == 1
                raise RuntimeError("the step failed")
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_the_runner_runs_small_steps_on_one_thread_and_the_tokens_do_not_change(qwen3_tiny):
    """With the rule on, the tiny model's one-row decode steps run on one thread and its prefill on two; greedy
    output in float64 is the same as with the rule off."""
    import torch

    from pdserve import LLM, SamplingParams
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        outs = {}
        for on in (False, True):
            llm = LLM(qwen3_tiny, dtype="float64", block_size=4, max_model_len=64)
            runner = llm.engine.runner
            runner.small_steps = cpu_threads.small_steps(runner.num_params) if on else None
            seen = []
            run = runner._run

            def spy(step, run=run, seen=seen):
                seen.append((step.desc.num_tokens, torch.get_num_threads()))
                return run(step)
            runner._run = spy
            sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
            outs[on] = [o.outputs[0].token_ids for o in llm.generate([[5, 6, 7, 8, 9, 10, 11]], sp)]
            assert torch.get_num_threads() == 2
            if on:
                assert seen[0][0] >= 7 and seen[0][1] == 2  # the prefill, padded to a captured size
                assert [t for _, t in seen[1:]] == [1] * 5
            else:
                assert all(t == 2 for _, t in seen)
        assert outs[True] == outs[False]
    finally:
        torch.set_num_threads(before)


def test_a_server_runs_small_steps_on_one_thread_whoever_set_the_count(monkeypatch, qwen3_tiny):
    """The engine core turns the small-step rule on (worker/cpu_threads.py SmallSteps) with the thread governor
    (no OMP_NUM_THREADS) and with the count pinned (OMP_NUM_THREADS=2, as bench pd pins it: its collocated server's
    lone streams had p99 ITL 5.9 ms without the rule, 3.4 with it, session 35); PDSERVE_SMALL_STEP_THREADS=0 alone
    turns it off."""
    import torch

    from tests.serve.test_failure_paths_serving import server
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        for omp, rule, on in ((None, "1", True), ("2", "1", True), (None, "0", False), ("2", "0", False)):
            if omp is None:
                monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
            else:
                monkeypatch.setenv("OMP_NUM_THREADS", omp)
            monkeypatch.setenv("PDSERVE_SMALL_STEP_THREADS", rule)
            with server(qwen3_tiny) as c:
                runner = c.app_state.engine._backend.core.engine.runner
                assert (runner.small_steps is not None) == on, (omp, rule)
                assert c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
    finally:
        torch.set_num_threads(before)
        gc.unfreeze()  # the in-process engine froze this process's heap
