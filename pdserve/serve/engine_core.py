"""The engine loop that runs apart from the HTTP event loop: in a background thread or in a child process.

It owns the `LLMEngine` (built here, so start-up never blocks the server), takes commands from an inbox between
steps (typed messages, engine_commands.py, dispatched by their type) and hands each step's outputs to a sink
as one `StepBatch` of plain, picklable records. Only this loop ever touches the engine, so no lock is needed: an
abort reaches the scheduler at the next step boundary and frees the request's blocks there. A P/D request on D is
added at once: its KV load is D's one question to P (a lease P no longer holds is prefilled here, LeaseGone).
"""
from __future__ import annotations

import os
import logging
import queue
import time
from typing import Any, Callable, Optional

from pdserve.core.errors import EngineDeadError
from pdserve.serve.engine_commands import AbortAll, AbortRequest, AddRequest, CheckKVProbe, GetKVInfo, GetKVProbe, \
    GetLeases, GetStats, Ping, Query, ReleaseLease, ReleaseRemoteKV, Stop
from pdserve.serve.engine_messages import EngineInfo, StepBatch, TokenRecord, Wire, record
from pdserve.serve.gc_heap import freeze_startup_heap

logger = logging.getLogger("pdserve.serve.engine")


class EngineCore:
    """`inbox.get(block)` returns a list of commands (engine_commands.py; maybe empty); `sink(obj)` delivers an
    EngineInfo, a StepBatch or an Exception (start-up failed)."""

    def __init__(self, engine_config, inbox, sink: Callable[[Any], None], server_pid: Optional[int] = None):
        self.engine_config = engine_config
        self.server_pid = server_pid  # the process backend's server: its CPU time is this engine's work too
        self.inbox = inbox
        self.sink = sink
        self.engine = None
        self._stop = False

    def run(self) -> None:
        try:
            from pdserve.core.engine import LLMEngine
            self.engine = LLMEngine(self.engine_config)
        except BaseException as e:  # start-up failed: report it, the server exits
            logger.exception("engine start-up failed")
            self.sink(RuntimeError(f"engine start-up failed: {type(e).__name__}: {e}"))
            return
        eng = self.engine
        from pdserve.worker.cpu_threads import adaptive_threads, small_steps
        self.cpu_threads = adaptive_threads(eng.device.type, self.server_pid, eng.set_num_threads)
        if eng.device.type == "cpu":  # small steps on one thread, whoever set the count (SmallSteps)
            eng.runner.small_steps = small_steps(eng.runner.num_params)
        # auto (no --[no-]async-scheduling) on a CPU: the overlap while other processes crowd the cores, where it
        # held the steps' pace and the quiet machine lost it (docs/cpu-notes.md "Overlap while the cores are crowded")
        adaptive = self.cpu_threads is not None and self.engine_config.scheduler.async_scheduling is None
        freeze_startup_heap()  # no later collection walks the model and engine (a full one took ~95 ms on a D)
        self.sink(EngineInfo(eng.max_model_len, eng.vocab_size, eng.num_blocks - 1, eng.device.type,
                             getattr(eng, "connector", None) is not None, eng.async_scheduling))
        graphs = getattr(getattr(eng, "runner", None), "graph_stats", None)
        graphs = graphs if graphs is not None and graphs.log_interval is not None else None  # only with the table
        batch = StepBatch(0.0)
        try:
            while not self._stop:
                if graphs is not None:
                    graphs.flush_if_due()  # the inbox wakes the loop at least once a second
                if self.cpu_threads is not None:
                    self.cpu_threads.poll()
                    if adaptive:
                        eng.want_async_scheduling(self.cpu_threads.crowded)
                busy = eng.has_unfinished_requests()
                batch = StepBatch(0.0)
                for cmd in self.inbox.get(block=not busy):
                    self._handle(cmd, batch)
                if eng.has_unfinished_requests() and not self._stop:
                    batch.records.extend(record(o) for o in eng.step())
                if batch.records or batch.replies:
                    batch.time = time.monotonic()
                    self.sink(batch)
        except EngineDeadError as e:  # the device is unusable: fail everything cleanly, report, and stop
            self._dead(f"engine dead: {e}", batch)
            return
        except BaseException as e:  # the engine's state can no longer be trusted: say so, and stop
            logger.exception("engine loop died")
            self.sink(RuntimeError(f"engine loop died: {type(e).__name__}: {e}"))
            return
        for rid in list(eng.scheduler.requests):  # stopped with requests left: free them
            eng.abort_request(rid)
        kv = self._q_kv()  # what a drain left behind: leases no decode node confirmed, or a broken pool
        logger.info("engine stopped: %d KV blocks in use (%d leased), invariants %s", kv["used_blocks"],
                    kv.get("leased_blocks", 0), "ok" if kv["invariants_ok"] else kv["invariant_error"])
        if hasattr(eng, "shutdown"):
            eng.shutdown()  # the KV connector's server and threads, if any

    def _dead(self, why: str, batch: StepBatch) -> None:
        """The engine can serve nothing more (EngineDeadError): every request ends with `why` (the server answers
        500, or an error event mid-stream), then the death is reported as a loop death is (/health and new requests
        503; `pdserve serve` exits 1 for its supervisor). What the requests held goes back to the pool, so the
        node's state reads whole to whoever inspects it."""
        eng = self.engine
        batch.records.extend(record(o) for o in eng.fail_all(why))
        batch.time = time.monotonic()
        self.sink(batch)
        self.sink(RuntimeError(why))
        try:  # no reader or loader may touch the blocks once the connector is down: then free what they held
            eng.shutdown()
            eng.scheduler.transfers.drop_all()
        except Exception:  # the device is gone: tearing down may fail too, and changes nothing for the server
            logger.exception("shutting the dead engine down failed")

    def _handle(self, msg, batch: StepBatch) -> None:
        command = _COMMANDS.get(type(msg))
        if command is not None:
            command(self, msg, batch)
            return
        if not isinstance(msg, Query):  # a command the loop cannot apply (an add, an abort) would leave a request
            # nobody ever answers: fail loudly, as a loop death every request and /health report, not a hang
            raise TypeError(f"unknown engine command {type(msg).__name__}")
        try:
            answer = _ANSWERS.get(type(msg))
            if answer is None:
                raise TypeError(f"unknown engine query {type(msg).__name__}")
            result = answer(self, msg)
        except Exception as e:  # the asker's future raises it; the loop goes on
            result = e
        batch.replies.append((msg.query_id, result))

    def _abort(self, msg: AbortRequest, batch: StepBatch) -> None:
        eng, rid = self.engine, msg.request_id
        req = eng.scheduler.requests.get(rid)
        generated = req.num_output_tokens if req is not None else 0
        out = eng.abort_request(rid)
        if out is not None:
            logger.info("aborted (%d tokens generated)", generated, extra={"request_id": rid})
            batch.records.append(record(out))

    def _abort_all(self, msg: AbortAll, batch: StepBatch) -> None:
        eng = self.engine
        for rid in list(eng.scheduler.requests):
            batch.records.append(record(eng.abort_request(rid)))
        if batch.records:
            logger.info("aborted %d request(s)", len(batch.records))

    def _on_release_remote(self, msg: ReleaseRemoteKV, batch: StepBatch) -> None:
        self._release_remote(msg.request_id, msg.kv_transfer_params)

    def _on_stop(self, msg: Stop, batch: StepBatch) -> None:
        self._stop = True

    def _add(self, msg: AddRequest, batch: StepBatch) -> None:
        eng = self.engine
        rid, token_ids, params, arrival = msg.request_id, msg.prompt_token_ids, msg.params, msg.arrival_time
        kv_params, salt = msg.kv_transfer_params, msg.cache_salt
        try:
            req = eng.make_request(token_ids, params, rid, arrival_time=arrival, kv_transfer_params=kv_params,
                                   cache_salt=salt)
            eng.add(req)
            if kv_params is None:
                return
            batch.records.append(TokenRecord(rid, [], "", False))  # accepted: the server may answer now
        except ValueError as e:  # what only the engine can check (kv_transfer_params): the client's fault
            self._refuse(rid, kv_params, str(e), batch)
        except Exception as e:  # should it still fail, fail this request only
            logger.exception("add_request failed", extra={"request_id": rid})
            batch.records.append(TokenRecord(rid, [], "", True, "error", error=str(e)))
            if rid not in eng.scheduler.requests:  # never admitted: no load of its own will tell P
                self._release_remote(rid, kv_params)

    def _refuse(self, rid: str, kv_params, why: str, batch: StepBatch) -> None:
        logger.warning("request refused: %s", why, extra={"request_id": rid})
        batch.records.append(TokenRecord(rid, [], "", True, "error", error=why, rejected=True))
        self._release_remote(rid, kv_params)

    def _release_remote(self, rid: str, kv_params) -> None:
        """D: P's lease for a refused request ends now, not at its expiry (KVGateway.release_remote_kv checks the
        router's proof and the peer first)."""
        if kv_params is None:
            return
        try:
            if self.engine.gateway.release_remote_kv(rid, kv_params):
                logger.info("told the prefill node to release the refused request's KV", extra={"request_id": rid})
        except Exception:  # never the engine loop's end
            logger.exception("releasing the prefill node's lease failed", extra={"request_id": rid})

    def _q_stats(self) -> dict:
        eng = self.engine
        s = eng.scheduler
        transfer = eng.gateway.transfer_stats(s.transfers.num_leased_blocks())
        if transfer is not None:
            transfer.update(s.transfers.reclaim_stats())
        return {"running": len(s.running), "waiting": s.num_waiting,
                "waiting_deferred": len(s.transfers.loading),
                "kv_usage": eng.kv.pool.usage(),
                "preemptions": s.num_preemptions, "prefix_cache_queries": s.prefix_cache_queries,
                "prefix_cache_hits": s.prefix_cache_hits, "graph": eng.graph_stats(), "transfer": transfer,
                "external_prefix_cache": (s.external_prefix_cache_queries, s.external_prefix_cache_hits)
                if s.connector is not None else None,
                "spec": eng.spec_decode_stats() if hasattr(eng, "spec_decode_stats") else None}

    def _q_kv(self) -> dict:
        eng = self.engine
        pool = eng.kv.pool
        try:
            eng.check_invariants()
            ok, err = True, None
        except AssertionError as e:
            ok, err = False, str(e) or "assertion failed"
        out = {"total_blocks": pool.num_usable_blocks, "free_blocks": pool.num_free_blocks,
               "used_blocks": pool.num_usable_blocks - pool.num_free_blocks, "cached_blocks": len(pool.cached),
               "invariants_ok": ok}
        if err:
            out["invariant_error"] = err
        out["leased_blocks"] = eng.scheduler.transfers.num_leased_blocks()  # P: blocks held for decode nodes to read
        out["orphaned_blocks"] = eng.scheduler.transfers.orphaned_blocks()  # held for no live request: 0 at rest
        return out


# How the loop applies each command and answers each query, by the message's exact type. The queries look the
# engine core's methods up when they run, so a test may patch one on an instance (`_q_stats`).
_COMMANDS: dict[type, Callable[[EngineCore, Any, StepBatch], None]] = {
    AddRequest: EngineCore._add, AbortRequest: EngineCore._abort, AbortAll: EngineCore._abort_all,
    ReleaseRemoteKV: EngineCore._on_release_remote, Stop: EngineCore._on_stop}
_ANSWERS: dict[type, Callable[[EngineCore, Any], Any]] = {
    GetStats: lambda core, q: core._q_stats(),
    Ping: lambda core, q: True,
    GetKVProbe: lambda core, q: core.engine.gateway.kv_probe(),
    GetLeases: lambda core, q: len(core.engine.scheduler.transfers.leased),  # P/D producer: prefills a D may still read
    GetKVInfo: lambda core, q: core._q_kv(),
    ReleaseLease: lambda core, q: core.engine.gateway.release_lease(q.params),  # a router's P/D calls (KVGateway)
    CheckKVProbe: lambda core, q: core.engine.gateway.check_kv_probe(q.probe),
}


class QueueInbox:
    """Thread transport: a queue.Queue of commands."""

    def __init__(self):
        self.q: queue.Queue = queue.Queue()

    def put(self, msg) -> None:
        self.q.put(msg)

    def get(self, block: bool) -> list:
        cmds = []
        try:
            if block:
                cmds.append(self.q.get(timeout=1.0))
            while True:
                cmds.append(self.q.get_nowait())
        except queue.Empty:
            pass
        return cmds


class PipeInbox:
    """Process transport (child side): commands arrive on a multiprocessing Connection."""

    def __init__(self, conn):
        self.conn = conn

    def get(self, block: bool) -> list:
        cmds = []
        if block and not self.conn.poll(1.0):
            return cmds
        try:
            while self.conn.poll():
                cmds.append(self.conn.recv())
        except (EOFError, OSError):  # the server went away
            cmds.append(Stop())
        return cmds


def run_in_process(engine_config, cmd_conn, out_conn, log_level: str) -> None:
    """Entry point of the engine child process."""
    import signal
    # The server handles signals and stops us with a command (or we stop when its pipe closes). SIGTERM too: systemd,
    # `kill -TERM -<pgid>` and container inits signal the whole group, which must drain, not lose the engine.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    from pdserve.serve.request_context import configure_logging
    configure_logging(log_level)

    wire = Wire()

    def sink(obj):
        try:
            out_conn.send_bytes(wire.encode(obj))
        except (BrokenPipeError, OSError):
            pass

    EngineCore(engine_config, PipeInbox(cmd_conn), sink, server_pid=os.getppid()).run()
