"""Failure paths of the engine loop (serve/engine_core.py) and its event-loop side (serve/async_engine.py), run in
process (so coverage sees them): an add that fails for a reason other than bad input, a query or call that raises,
a loop that dies, a start-up that fails. Each ends with every request answered (never a hang) and, where the engine
lives on, the KV pool whole."""
from __future__ import annotations

import asyncio
import queue
import threading
import time
from dataclasses import dataclass

import pytest

from pdserve import SamplingParams
from pdserve.config import EngineConfig
from pdserve.serve.async_engine import AsyncEngine
from pdserve.serve.engine_commands import AddRequest, GetKVInfo, GetStats, Query, Stop
from pdserve.serve.engine_core import EngineCore, QueueInbox
from pdserve.serve.engine_messages import EngineInfo, StepBatch
from pdserve.serve.errors import APIError

SP = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
TIMEOUT = 20.0


def config(model, **kw):
    return EngineConfig.from_kwargs(model, block_size=4, max_model_len=53, **kw)


class Loop:
    """An EngineCore on a thread with a list sink: what the server's thread backend runs."""

    def __init__(self, cfg):
        self.inbox = QueueInbox()
        self.out: queue.Queue = queue.Queue()
        self.core = EngineCore(cfg, self.inbox, self.out.put)
        self.thread = threading.Thread(target=self.core.run, daemon=True)
        self.thread.start()
        self.records: dict[str, list] = {}
        self.replies: dict[int, object] = {}
        self.errors: list[BaseException] = []
        self.qid = 1000
        first = self.out.get(timeout=60)
        assert isinstance(first, EngineInfo), first

    def _pump(self, timeout: float) -> None:
        obj = self.out.get(timeout=timeout)
        if isinstance(obj, StepBatch):
            for r in obj.records:
                self.records.setdefault(r.request_id, []).append(r)
            self.replies.update(obj.replies)
        else:
            self.errors.append(obj)

    def until(self, pred, timeout: float = TIMEOUT):
        deadline = time.monotonic() + timeout
        while not pred():
            left = deadline - time.monotonic()
            assert left > 0, f"timed out: records {self.records}, errors {self.errors}"
            assert not self.errors, f"the engine loop reported {self.errors}"
            try:
                self._pump(min(left, 0.5))
            except queue.Empty:
                pass

    def finished(self, rid: str):
        self.until(lambda: any(r.finished for r in self.records.get(rid, ())))
        return [r for r in self.records[rid] if r.finished][-1]

    def add(self, rid: str, tokens, params=SP):
        self.inbox.put(AddRequest(rid, list(tokens), params, time.monotonic()))

    def ask(self, query):
        qid = query.query_id
        self.inbox.put(query)
        self.until(lambda: qid in self.replies)
        return self.replies.pop(qid)

    def pool_whole(self):
        self.qid += 1
        kv = self.ask(GetKVInfo(self.qid))
        assert kv["invariants_ok"], kv
        assert kv["free_blocks"] == kv["total_blocks"], f"blocks leaked: {kv}"

    def stop(self):
        self.inbox.put(Stop())
        self.thread.join(TIMEOUT)
        assert not self.thread.is_alive()


def test_an_add_that_fails_unexpectedly_fails_that_request_only(qwen3_tiny):
    """add_request raising something other than ValueError (a bug, not bad input): an error record (not a 400
    refusal), and the loop goes on serving."""
    loop = Loop(config(qwen3_tiny))
    try:
        eng = loop.core.engine
        real = eng.validate_prompt
        calls = [0]

        def flaky(token_ids, params):  # runs on the engine loop, before the request reaches the scheduler
            calls[0] += 1
            if calls[0] == 1:
                raise RuntimeError("tokenizer crashed")
            return real(token_ids, params)
        eng.validate_prompt = flaky
        loop.add("bad", [5, 6, 7])
        rec = loop.finished("bad")
        assert rec.finish_reason == "error" and "tokenizer crashed" in rec.error and not rec.rejected
        loop.add("good", [5, 6, 7, 8])
        rec = loop.finished("good")
        toks = [t for r in loop.records["good"] for t in r.new_token_ids]
        assert rec.finish_reason == "length" and len(toks) == SP.max_tokens
        assert not loop.errors
        loop.pool_whole()
    finally:
        loop.stop()


def test_an_add_that_fails_after_admission_leaves_nothing_behind(qwen3_tiny, monkeypatch):
    """A request whose set-up fails (here its detokenizer) never reaches the scheduler half-built: the next step
    would trip over it and take the engine loop down."""
    import pdserve.core.output_processor as op_mod  # the output processor makes a request's detokenizer
    loop = Loop(config(qwen3_tiny))
    try:
        real = op_mod.IncrementalDetokenizer
        calls = [0]

        def flaky(*a, **kw):
            calls[0] += 1
            if calls[0] == 1:
                raise RuntimeError("detokenizer failed")
            return real(*a, **kw)
        monkeypatch.setattr(op_mod, "IncrementalDetokenizer", flaky)
        loop.add("bad", [5, 6, 7])
        rec = loop.finished("bad")
        assert rec.finish_reason == "error" and "detokenizer failed" in rec.error
        loop.add("good", [5, 6, 7, 8])
        assert loop.finished("good").finish_reason == "length"
        assert not loop.errors, loop.errors
        loop.pool_whole()
    finally:
        loop.stop()


def test_a_query_or_call_that_raises_answers_with_the_error(qwen3_tiny):
    """A failing query, or a query type the loop does not answer, is answered with the exception (the asker's
    future raises it); the loop goes on. A call of a name the engine does not offer never leaves the server. A
    command the loop does not know is no silent no-op: the loop dies naming it."""
    with pytest.raises(ValueError, match="no engine call 'shutdown'"):  # an engine method, not one a router may call
        asyncio.run(AsyncEngine(config(qwen3_tiny)).call("shutdown", None))
    loop = Loop(config(qwen3_tiny))
    try:
        def broken():
            raise RuntimeError("stats broke")
        loop.core._q_stats = broken
        r = loop.ask(GetStats(1))
        assert isinstance(r, RuntimeError) and "stats broke" in str(r)

        @dataclass(slots=True)
        class NoSuchQuery(Query):
            pass
        r = loop.ask(NoSuchQuery(2))
        assert isinstance(r, TypeError) and "unknown engine query NoSuchQuery" in str(r)
        loop.add("after", [5, 6, 7])
        assert loop.finished("after").finish_reason == "length"
        loop.pool_whole()

        @dataclass(slots=True)
        class NoSuchCommand:
            request_id: str
        loop.inbox.put(NoSuchCommand("x"))
        died = loop.out.get(timeout=TIMEOUT)
        assert isinstance(died, RuntimeError), died
        assert "engine loop died: TypeError: unknown engine command NoSuchCommand" in str(died)
    finally:
        loop.stop()


def test_a_dying_engine_loop_fails_every_request_and_refuses_new_ones(qwen3_tiny):
    """Something outside the model step raising inside the loop (here the scheduler): the loop reports its death,
    every request in flight ends with an error, queries and new requests get a 503, never a hang."""
    async def main():
        ae = AsyncEngine(config(qwen3_tiny), backend="thread")
        ae.start()
        await asyncio.wait_for(ae.wait_started(), 60)
        eng = ae._backend.core.engine  # the EngineCore's engine
        st = ae.submit("victim", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
                       time.monotonic())
        recs = []

        async def read():
            async for batch in ae.stream(st):
                recs.extend(batch)
                if len(recs) == 1:
                    def broken():
                        raise RuntimeError("scheduler corrupted")
                    eng.scheduler.schedule = broken
        await asyncio.wait_for(read(), TIMEOUT)
        last = recs[-1]
        assert last.finished and last.finish_reason == "error" and "engine loop died" in last.error
        assert "scheduler corrupted" in last.error
        assert isinstance(ae.error, RuntimeError) and not ae.ready
        with pytest.raises(APIError) as exc:
            ae.submit("late", [5, 6], SP, time.monotonic())
        assert exc.value.status == 503 and "not running" in exc.value.message
        with pytest.raises(APIError) as exc:
            await ae.query("stats", timeout=2)
        assert exc.value.status == 503
        assert ae.num_in_flight == 0
        await asyncio.wait_for(ae.shutdown(timeout=5), 15)
    asyncio.run(main())


def test_a_failed_start_up_is_reported_not_hung(qwen3_tiny):
    """The engine cannot be built (a config only the engine checks): wait_started raises the cause, the engine is
    not ready, and a request gets a 503 naming it."""
    async def main():
        ae = AsyncEngine(config(qwen3_tiny, num_gpu_blocks_override=3), backend="thread")  # < one 53-token sequence
        ae.start()
        with pytest.raises(RuntimeError, match="engine start-up failed: ValueError: the KV cache"):
            await asyncio.wait_for(ae.wait_started(), 60)
        assert not ae.ready
        with pytest.raises(APIError) as exc:
            ae.submit("r", [5, 6], SP, time.monotonic())
        assert exc.value.status == 503 and "not running" in exc.value.message
        await asyncio.wait_for(ae.shutdown(timeout=5), 15)
    asyncio.run(main())


def test_a_stuck_engine_loop_is_seen_and_its_queries_time_out_as_503(qwen3_tiny):
    """A step that does not return (a hung kernel, a stopped engine process): the loop is alive and has no error,
    so only its unanswered liveness ping shows it (what /health reads), and a query times out as a 503 naming
    the engine, not a TimeoutError the server would answer with a 500. Once the step returns, all is as before."""
    async def main():
        ae = AsyncEngine(config(qwen3_tiny), backend="thread")
        ae.start()
        await asyncio.wait_for(ae.wait_started(), 60)
        assert ae.stalled_for() == 0.0
        await asyncio.sleep(0.2)
        assert ae.stalled_for() == 0.0  # an idle loop answers at once
        eng = ae._backend.core.engine
        step, gate, entered = eng.step, threading.Event(), threading.Event()

        def stuck():
            entered.set()
            gate.wait(TIMEOUT)
            return step()
        eng.step = stuck
        st = ae.submit("r", [5, 6, 7], SP, time.monotonic())
        await asyncio.to_thread(entered.wait, TIMEOUT)
        ae.stalled_for()  # a ping is out: this one, or the last one, which waits for the step's end
        await asyncio.sleep(0.3)
        assert ae.stalled_for() >= 0.3
        with pytest.raises(APIError) as exc:
            await ae.query("kv", timeout=0.2)
        assert exc.value.status == 503 and "did not answer within 0.2 s" in exc.value.message
        eng.step = step
        gate.set()
        recs = [r async for batch in ae.stream(st) for r in batch]
        assert recs[-1].finish_reason == "length" and sum(len(r.new_token_ids) for r in recs) == 4
        await asyncio.sleep(0.3)
        assert ae.stalled_for() < 0.3  # the ping out during the stuck step was answered
        kv = await ae.query("kv", timeout=5)
        assert kv["used_blocks"] == 0 and kv["invariants_ok"]
        await asyncio.wait_for(ae.shutdown(timeout=5), 15)
    asyncio.run(main())
