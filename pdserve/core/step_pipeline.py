"""The engine's step: poll transfers, schedule, run the model, update, outputs. `EngineStep` runs them one after
another; `StepPipeline` (async scheduling, vLLM's `--async-scheduling`) overlaps the model's forward of one step
with the host work around it: at most one step in flight, on one long-lived worker thread.

`LLMEngine.step()` with step k + 1 in flight on entry:
a. poll transfers;
b. schedule step k + 2 while k + 1 runs: k + 1 was counted as landed at its launch (`Scheduler.mark_in_flight`:
   computed counts advanced, a sampling row's token pending as a placeholder), so a decode row's next position is
   its placeholder's, and a request whose pending token certainly hits a length cap is not scheduled again; the KV
   connector's loads are built and started right after the schedule, as in the synchronous step;
c. wait for k + 1 and land it (`update_from_output(in_flight=True)`): real tokens replace the placeholders, stop
   checks, finishes, published blocks; a request finished meanwhile (aborted, a stop string) is skipped;
d. drop k + 2's rows whose request (c) finished, fill k + 2's inputs here, on the engine thread (they read the
   now-real tokens and the block tables), and start its forward and sampling on the worker thread, waiting until
   its forward and LM head are enqueued (the GIL: see `_launch`);
e. while that runs, make k + 1's outputs (detokenizer, stop strings, RequestOutputs) and return them, so the engine
   loop's own work after `step()` overlaps the forward too.
Outputs come one step() later than without overlap, never more; a step() with nothing to schedule still lands
the step in flight.

What must stay true:
- Only the engine thread touches scheduler, block and output state. The worker thread runs `ModelRunner.run`,
  which reads of the requests only their params and prompt and output token ids, and nothing changes those while
  it runs (tokens are appended in (c), after it returned).
- Freeing blocks an in-flight forward still writes (an abort, a stop string, a preemption by (b)) is safe: a row
  writes KV only at positions >= its request's computed count when it was scheduled, in blocks not hashed or
  published (`cache_blocks` runs in (c), after the write), so no prefix-cache hit reads them; a freed block that a
  later step reuses is written by that step before it is read, and steps run in order on one thread (one stream),
  so the stale write lands first. A KV load is the one writer outside the steps: loads given blocks start only
  once the step in flight ran.
- The model runs on the worker thread only (the arrival driver's prefill too: `call`); on CPU the engine thread
  frees its OpenMP pool at the hand-over and runs no parallel region after it (worker/openmp.py).
- Speculative decoding runs synchronously: the next step's drafts are looked up in tokens not landed yet.
"""
from __future__ import annotations

import concurrent.futures
import functools
import logging
import threading
import time
from typing import TYPE_CHECKING, Optional

import torch

from pdserve.core.errors import EngineDeadError
from pdserve.model.layers import _warm_vml
from pdserve.outputs import RequestOutput
from pdserve.request import Request, RequestStatus
from pdserve.sched_output import ModelRunnerOutput, SchedulerOutput
from pdserve.transfer.channel.handoffs import AWAIT_KV
from pdserve.worker.device_errors import device_unusable
from pdserve.worker.openmp import release_thread_pool

if TYPE_CHECKING:
    from pdserve.core.engine import LLMEngine

logger = logging.getLogger("pdserve.engine")
# Failed steps in a row (none landed in between) after which the engine is dead whatever the error: a device that
# fails every step in a way no marker names is no less a zombie. Above the one or two a bad request can cause.
MAX_FAILED_STEPS = 8


class EngineStep:
    """One step after another: nothing is ever in flight between step() calls."""

    def __init__(self, engine: "LLMEngine"):
        self.engine = engine
        self.in_flight: Optional[tuple[SchedulerOutput, concurrent.futures.Future]] = None
        self.failed_in_a_row = 0  # steps that failed since the last one that landed

    def step(self) -> list[RequestOutput]:
        eng = self.engine
        transfer_outputs = self._poll_transfers()
        transfer_outputs += self._load_early()
        out = self._schedule()
        if not out.rows:
            return self._idle(transfer_outputs)
        self._started(out)
        try:
            result = eng.runner.execute(out.rows, eng.kv.block_table)
        except Exception as e:
            return transfer_outputs + self._failed(out, e)
        self.failed_in_a_row = 0
        return transfer_outputs + eng.output_processor.process(*self._land(out, result))

    def _poll_transfers(self) -> list[RequestOutput]:
        eng = self.engine
        admitted, eng._admitted = eng._admitted, []  # D: P's first tokens' outputs, admitted since the last step
        if eng.connector is None:
            return admitted
        fin = eng.connector.get_finished()
        firsts = eng.take_awaited(fin) if fin.params else []
        now = time.monotonic()
        for rid in fin.done_recving | set(fin.failed) | set(fin.overdue) | fin.gone | set(fin.refused):
            if (st := eng.output_processor.states.get(rid)) is not None:
                st.metrics.kv_load_end_time = now
                st.metrics.kv_loaded = rid in fin.done_recving
        outputs = [eng.output_processor.make_output(r, []) for r in eng.scheduler.process_transfers(fin)
                   if r is not None]
        for out in outputs:
            if out.request_id in fin.refused:
                out.error_status = 409  # P handed nothing over: the router has P's answer (serve/handoff.py)
        return admitted + outputs + eng.first_outputs(firsts)

    def _schedule(self) -> SchedulerOutput:
        """The scheduler's next step, then the KV connector's loads it made (started in the background)."""
        out = self.engine.scheduler.schedule()
        self._start_loads()
        return out

    def _start_loads(self) -> list[str]:
        """The loads the scheduler made since the last call, started in the background; returns their request ids."""
        eng = self.engine
        if eng.connector is None:
            return []
        meta = eng.connector.build_connector_meta()
        now = time.monotonic()
        loads = [job.request_id for job in meta.loads if job.dst_blocks]  # not a bare `done` for a prompt D had
        for rid in loads:  # cached: the request waits for these
            eng.output_processor.states[rid].metrics.kv_load_start_time = now
        if loads:
            # a load may be handed blocks freed while the step in flight still writes them (an abort, a stop
            # string): it starts once that step ran (which step() waits for next anyway)
            self.wait()
        eng.connector.start_load_kv(meta)
        return loads

    def _load_early(self) -> list[RequestOutput]:
        """D: the queue head's loads start before this step is scheduled (Scheduler.start_loads), and the step waits
        up to kv_load_wait_ms for them: a short pull then runs its request in this step rather than the next."""
        eng = self.engine
        if eng.connector is None or not eng.scheduler.start_loads():
            return []
        loading = eng.scheduler.transfers.loading
        # not an await (channel/handoffs.py): it lasts P's queue and prefill, and the step would only wait it out
        pending = [rid for rid in self._start_loads() if rid in loading and
                   AWAIT_KV not in (loading[rid].kv_transfer_params or {})]
        deadline = time.monotonic() + eng.kv_load_wait
        outputs = []
        while pending and time.monotonic() < deadline:
            time.sleep(0.0002)
            outputs += self._poll_transfers()
            pending = [rid for rid in pending if rid in loading]
        return outputs

    def _idle(self, transfer_outputs: list[RequestOutput]) -> list[RequestOutput]:
        if self.engine.has_unfinished_requests() and not transfer_outputs:
            # only transfers in flight: poll, do not spin; woken early when one ends (an await, at idle)
            connector = self.engine.connector
            connector.wait_for_transfers(0.001) if connector is not None else time.sleep(0.001)
        return transfer_outputs

    def _started(self, out: SchedulerOutput) -> None:
        now = time.monotonic()
        states = self.engine.output_processor.states
        for row in out.rows:
            m = states[row.request.request_id].metrics
            m.first_scheduled_time = m.first_scheduled_time or now

    def _failed(self, out: SchedulerOutput, e: Exception) -> list[RequestOutput]:
        """A failed step fails its requests (those not finished meanwhile), not the engine; unless the device is
        unusable or too many steps failed in a row: then EngineDeadError (the engine loop fails every request)."""
        self.failed_in_a_row += 1
        why = device_unusable(e)
        if why is None and self.failed_in_a_row >= MAX_FAILED_STEPS:
            why = f"{self.failed_in_a_row} model steps failed in a row, the last with {type(e).__name__}: {e}"[:400]
        if why is not None:
            logger.critical("the engine is dead: %s", why, exc_info=e)
            raise EngineDeadError(why) from e
        logger.error("model step failed", exc_info=e)
        return [self.engine._fail(row.request.request_id, f"model step failed: {e}") for row in out.rows
                if not row.request.is_finished]

    def _land(self, out: SchedulerOutput, result: ModelRunnerOutput, in_flight: bool = False
              ) -> tuple[list[Request], dict]:
        """Apply a step's results; returns (the requests it updated, their logprob entries by id) for the outputs."""
        eng = self.engine
        live = {row.request.request_id for row in out.rows if not row.request.is_finished}  # not an id's new owner
        eng.output_processor.add_prompt_logprobs({r: e for r, e in result.prompt_logprobs.items() if r in live})
        updated = eng.scheduler.update_from_output(out, result.sampled, in_flight)
        lp_by_req = {row.request.request_id: lp for row, lp in zip(out.rows, result.logprobs) if lp is not None}
        return updated, lp_by_req

    def wait(self) -> None:
        """Until the step in flight has run (it still lands at the next step()): before a KV load starts, at
        shutdown."""
        if self.in_flight is not None:
            concurrent.futures.wait([self.in_flight[1]])

    def call(self, fn, *args):
        """`fn(*args)` on the thread that runs the model, after the step in flight (the arrival driver's prefill)."""
        return fn(*args)

    def drain(self) -> list[RequestOutput]:
        """Lands the step in flight, if any, without launching another; returns its outputs (nothing is ever in
        flight here)."""
        return []

    def check_invariants(self) -> None:
        """The step in flight is accounted for, not waited on (the worker touches no pool or scheduler state): its
        requests are running or finished, and a running request has a placeholder exactly when its row samples."""
        rows = self.in_flight[0].rows if self.in_flight is not None else []
        for row in rows:
            assert row.request.is_finished or row.request.status == RequestStatus.RUNNING, \
                f"{row.request} is in flight but neither running nor finished"
        pending = {row.request.request_id for row in rows if row.samples and not row.request.is_finished}
        for r in self.engine.scheduler.running:
            assert r.num_output_placeholders == (r.request_id in pending), f"{r}: a placeholder but no row in flight"

    def shutdown(self) -> None:
        pass


class StepPipeline(EngineStep):
    """Async scheduling: the step above, (a) to (e)."""

    def __init__(self, engine: "LLMEngine"):
        super().__init__(engine)
        # CUDA: the current device is per thread (given the device, not the engine: the thread keeps its
        # initializer, and an engine dropped without shutdown must still be collected). CPU: the thread's OpenMP
        # team is its own, warmed as the first one (layers._warm_vml: a first threaded vector-math call can be off).
        init = functools.partial(torch.cuda.set_device, engine.device) if engine.device.type == "cuda" else _warm_vml
        # One thread for the engine's life, started at the first submit; a step that raises there is its future's
        # exception (StepPipeline.step fails its rows), so the thread never dies with it.
        self._worker = concurrent.futures.ThreadPoolExecutor(1, "pdserve-forward", initializer=init)
        self.num_overlapped = 0  # schedules made while a step was in flight (tests see that the mode is on)
        if engine.device.type == "cpu":
            release_thread_pool()  # the model's parallel regions run on the worker's pool alone (openmp.py)

    def step(self) -> list[RequestOutput]:
        eng = self.engine
        outputs = self._poll_transfers()
        flight = self.in_flight
        self.num_overlapped += flight is not None
        out = self._schedule()  # (with the step in flight known to wait())
        self.in_flight = None
        updated, lps = [], {}
        if flight is not None:
            failed, updated, lps = self._land_flight(flight)
            outputs += failed
        out.rows = [row for row in out.rows if not row.request.is_finished]  # their blocks are freed already
        if not out.rows and flight is None:
            return self._idle(outputs)
        error = self._launch(out) if out.rows else None
        outputs += eng.output_processor.process(updated, lps)
        # a step that could not start fails its requests after their landed tokens went out
        return outputs + (self._failed(out, error) if error is not None else [])

    def drain(self) -> list[RequestOutput]:
        """Lands the step in flight without launching another (before the engine switches to running its steps one
        after another): the scheduler is then as a synchronous step leaves it, no placeholder left."""
        flight, self.in_flight = self.in_flight, None
        if flight is None:
            return []
        failed, updated, lps = self._land_flight(flight)
        return failed + self.engine.output_processor.process(updated, lps)

    def _land_flight(self, flight) -> tuple[list[RequestOutput], list, dict]:
        """The step that was in flight, landed: (its requests' failed outputs if it raised, else none; the requests
        it updated; their logprob entries by id)."""
        landed, future = flight
        try:
            result = future.result()
        except Exception as e:
            return self._failed(landed, e), [], {}
        self.failed_in_a_row = 0
        return [], *self._land(landed, result, in_flight=True)

    def _launch(self, out: SchedulerOutput) -> Optional[Exception]:
        eng = self.engine
        self._started(out)
        try:
            prepared = eng.runner.prepare(out.rows, eng.kv.block_table)
        except Exception as e:
            return e
        eng.scheduler.mark_in_flight(out)
        # The engine thread waits until the forward and the LM head are enqueued (on CPU: have run; or the step
        # ended): its Python work would otherwise hold the GIL their launches need, for up to a switch interval
        # (5 ms) each, and the device would wait for the host work it should hide. Sampling overlaps (e).
        launched = threading.Event()
        prepared.launched = launched.set
        future = self._worker.submit(eng.runner.run, prepared)
        future.add_done_callback(lambda _: launched.set())
        launched.wait()
        self.in_flight = (out, future)
        return None

    def call(self, fn, *args):
        return self._worker.submit(fn, *args).result()  # after the step in flight: one thread, in order

    def shutdown(self) -> None:
        self.wait()
        self.in_flight = None  # its outputs go with the engine
        self._worker.shutdown(wait=True)
