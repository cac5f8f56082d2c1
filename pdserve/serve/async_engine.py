"""AsyncEngine: the event loop's side of the engine loop (engine_core), run in a thread or a child process
(engine_backend.py).

Requests go to the engine loop as typed commands (engine_commands.py) through a thread-safe inbox; each step's
records come back in one `loop.call_soon_threadsafe` call and are fanned out to per-request asyncio queues. A
consumer that goes away (client disconnect, cancelled stream) sends an abort, which the engine loop applies at its
next step boundary.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import OrderedDict
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Optional

from pdserve.serve.engine_backend import ProcessBackend, ThreadBackend
from pdserve.serve.engine_commands import CALLS, QUERIES, AbortAll, AbortRequest, AddRequest, Ping, Query, \
    ReleaseRemoteKV, Stop
from pdserve.serve.engine_core import QueueInbox
from pdserve.serve.engine_messages import EngineInfo, StepBatch, TokenRecord
from pdserve.serve.errors import APIError

logger = logging.getLogger("pdserve.serve.engine")
RECENT_IDS = 1 << 16  # ids remembered after finishing: far more than a 30 s lease sees at any realistic rate


@dataclass
class _RequestState:
    request_id: str
    arrival: float
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    first_time: Optional[float] = None
    last_time: Optional[float] = None
    num_tokens: int = 0
    finished: bool = False
    prefill_time: float = 0.0  # the engine's, from its first own token's timing (metrics: inference = prefill + decode)
    num_prompt_tokens: int = 0
    max_tokens: Optional[int] = None  # the client's max_tokens, else what the context leaves
    num_cached_tokens: int = 0  # local + external, from the record of the first token computed on this node
    prompt_counted: bool = False  # the prompt's metrics are observed (ServerMetrics.on_tokens), once


class AsyncEngine:
    def __init__(self, engine_config, backend: str = "thread", max_waiting: int = 1024, metrics=None,
                 log_level: str = "info"):
        self.engine_config = engine_config
        self.backend = backend
        self.max_waiting = max_waiting
        self.metrics = metrics
        self.log_level = log_level
        self.info: Optional[EngineInfo] = None
        self.error: Optional[BaseException] = None
        self.accepting = True
        self._reqs: dict[str, _RequestState] = {}
        self._recent_ids: OrderedDict[str, None] = OrderedDict()
        self._next_suffix: OrderedDict[str, int] = OrderedDict()  # id -> the suffix its next repeat tries first
        self._num_queued = 0  # accepted requests without a first token yet
        self._queries: dict[int, asyncio.Future] = {}
        self._qids = itertools.count()
        self._inbox = QueueInbox()
        self._backend: Optional[ThreadBackend | ProcessBackend] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._started = asyncio.Event()
        self._died = asyncio.Event()  # the engine loop ended after start-up (it never ends on its own otherwise)
        self._ping_sent: Optional[float] = None

    # ------------------------------------------------------------------ life cycle

    def launch(self) -> None:
        """The process backend's child starts building the engine now, before the event loop runs (the server loads
        its tokenizer meanwhile); `start` attaches to it. A no-op for the thread backend."""
        if self.backend == "process" and self._backend is None:
            self._backend = ProcessBackend(self.engine_config, self._inbox, self.log_level)

    def abandon(self) -> None:
        """The server failed to start after `launch`: the engine's child goes with it."""
        if isinstance(self._backend, ProcessBackend):
            self._backend.proc.kill()
            self._backend.proc.join(5)
        self._backend = None

    def start(self) -> None:
        """Start the engine loop (it builds the engine); `ready` turns true when start-up is done."""
        self._loop = asyncio.get_running_loop()
        if self.backend == "thread":
            self._backend = ThreadBackend(self.engine_config, self._inbox, self._from_engine)
        else:
            self.launch()
            self._backend.attach(self._from_engine)

    @property
    def ready(self) -> bool:
        return self.info is not None and self.error is None and self.alive()

    def alive(self) -> bool:
        return self._backend is not None and self._backend.alive()

    async def wait_died(self) -> None:
        """Returns if the engine loop ends after start-up: it died (an exception, its process killed), or was
        stopped on purpose (a process backend's child then exits too)."""
        await self._died.wait()

    def stalled_for(self) -> float:
        """Seconds the engine loop has left a liveness ping unanswered; sends one when none is out. The loop answers
        between steps, so a long wait means it is stuck inside one (or its process is stopped), which neither
        `alive()` nor `error` can see."""
        now = time.monotonic()
        if self._ping_sent is not None:
            return now - self._ping_sent
        if self.ready:
            qid = next(self._qids)
            fut = self._loop.create_future()
            self._queries[qid] = fut
            fut.add_done_callback(self._pinged)
            self._ping_sent = now
            self._inbox.put(Ping(qid))
        return 0.0

    def _pinged(self, fut: asyncio.Future) -> None:
        self._ping_sent = None
        if not fut.cancelled():
            fut.exception()  # retrieved: an engine that died is reported by `error`

    async def wait_started(self) -> None:
        """Wait until start-up is done (raises if it failed)."""
        await self._started.wait()
        if self.error is not None:
            raise self.error

    async def shutdown(self, timeout: float = 10.0) -> None:
        self._inbox.put(Stop())
        if self._backend is not None:
            await asyncio.to_thread(self._backend.join, timeout)
        self._fail_all("the server is shutting down")

    async def drain(self, timeout: float) -> None:
        """Stop accepting; let in-flight requests finish for up to `timeout` s, then abort those left. A P/D
        producer then keeps serving its open KV leases (decode nodes still pulling what it prefilled) until each is
        confirmed or expired, within the same `timeout`: the KV server runs until the engine loop stops."""
        self.accepting = False
        deadline = time.monotonic() + timeout
        if self._reqs:
            logger.info("waiting up to %.1f s for %d in-flight request(s)", timeout, len(self._reqs))
        while self._reqs and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self._reqs:
            logger.warning("shutdown timeout: aborting %d in-flight request(s)", len(self._reqs))
            self._inbox.put(AbortAll())
            end = time.monotonic() + 5.0
            while self._reqs and time.monotonic() < end:
                await asyncio.sleep(0.05)
        if self.ready and self.info.has_kv_connector:
            try:
                await self._drain_leases(deadline)
            except Exception as e:  # the engine went away meanwhile: nothing left to serve
                logger.warning("KV leases not drained: %s", e)

    async def _drain_leases(self, deadline: float) -> None:
        leases = await self.query("leases")
        if not leases:
            return
        logger.info("waiting up to %.1f s for %d open KV lease(s)", max(deadline - time.monotonic(), 0.0), leases)
        while leases and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
            leases = await self.query("leases")
        if leases:
            logger.warning("shutdown timeout: dropping %d open KV lease(s)", leases)
        else:
            logger.info("all KV leases ended")

    # ------------------------------------------------------------------ engine -> event loop

    def _from_engine(self, obj: Any) -> None:  # any thread
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(self._dispatch, obj)
            except RuntimeError:  # the loop closed meanwhile
                pass

    def _dispatch(self, obj: Any) -> None:  # event loop
        if isinstance(obj, StepBatch):
            for rec in obj.records:
                self._on_record(rec, obj.time)
            if self.metrics is not None:
                self.metrics.end_step()
            for qid, result in obj.replies:
                fut = self._queries.pop(qid, None)
                if fut is not None and not fut.done():
                    fut.set_exception(result) if isinstance(result, BaseException) else fut.set_result(result)
        elif isinstance(obj, EngineInfo):
            self.info = obj
            self._started.set()
        elif isinstance(obj, BaseException):
            self.error = self.error or obj  # the first says why (a dead engine's process then exits, too)
            if self.info is not None:
                self._died.set()
            self._started.set()
            self._fail_all(str(obj))

    def _on_record(self, rec: TokenRecord, t: float) -> None:
        st = self._reqs.get(rec.request_id)
        if st is None:
            return
        # refused before its first byte (a 400, or a 409: the P it awaited handed nothing over): not served here
        if self.metrics is not None and not rec.rejected and not rec.error_status:
            self.metrics.on_tokens(st, rec, t)
        if st.first_time is None and (rec.new_token_ids or rec.finished):
            self._num_queued -= 1
        if rec.new_token_ids:
            st.first_time = st.first_time or t
            st.last_time = t
            st.num_tokens += len(rec.new_token_ids)
        if rec.finished:
            st.finished = True
            del self._reqs[rec.request_id]
        st.queue.put_nowait(rec)

    def _fail_all(self, message: str) -> None:
        for rid in list(self._reqs):
            self._on_record(TokenRecord(rid, [], "", True, "error", error=message), time.monotonic())
        for fut in self._queries.values():
            if not fut.done():
                fut.set_exception(RuntimeError(message))
        self._queries.clear()

    # ------------------------------------------------------------------ event loop -> engine

    def check_accepting(self, n: int = 1) -> None:
        """Raises the 503 unless `n` more requests may queue now."""
        if not self.accepting:
            raise APIError(503, "the server is shutting down")
        if self.error is not None or (self.info is not None and not self.alive()):
            raise APIError(503, "the engine is not running" + (f" ({self.error})" if self.error else ""))
        if self.info is None:
            raise APIError(503, "the engine is still starting up")
        if self._num_queued + n > self.max_waiting:
            raise APIError(503, f"the server is overloaded: {self._num_queued} requests are already waiting "
                                f"(--max-waiting {self.max_waiting})" + (f", no room for n = {n}" if n > 1 else "")
                           + "; retry later", headers={"Retry-After": "1"})

    def unique_id(self, request_id: str) -> str:
        """Unique among requests in flight and the recently finished ones: a finished P/D request's id may still
        name leased KV in the engine (which refuses a reused id), so a client retry with the same X-Request-Id
        gets a suffix instead of an error."""
        def taken(rid: str) -> bool:
            return rid in self._reqs or rid in self._recent_ids
        if taken(request_id):
            # the search starts where the last one for this id stopped: a client that sends one id k times costs
            # O(k) in all, not O(k^2) (counting from -1 each time took ~30 ms of event loop after 10-20k repeats)
            base, i = request_id, self._next_suffix.pop(request_id, 1)
            while taken(f"{base}-{i}"):
                i += 1
            request_id = f"{base}-{i}"
            self._next_suffix[base] = i + 1
            if len(self._next_suffix) > RECENT_IDS:
                self._next_suffix.popitem(last=False)
        self._recent_ids[request_id] = None
        if len(self._recent_ids) > RECENT_IDS:
            self._recent_ids.popitem(last=False)
        return request_id

    def submit(self, request_id: str, token_ids: list[int], params, arrival: float,
               kv_transfer_params: Optional[dict] = None, cache_salt: Optional[str] = None) -> _RequestState:
        """Admit a request (or raise the 503) and send it to the engine loop; read it with `stream(state)`.
        A request id already in flight gets a suffix, so ids stay unique in the engine."""
        self.check_accepting()
        request_id = self.unique_id(request_id)
        cap = getattr(params, "max_tokens", None)  # unset: what the context leaves, the default vLLM's server sets
        st = _RequestState(request_id, arrival, num_prompt_tokens=len(token_ids),
                           max_tokens=self.info.max_model_len - len(token_ids) if cap is None else cap)
        self._reqs[request_id] = st
        self._num_queued += 1
        self._inbox.put(AddRequest(request_id, token_ids, params, arrival, kv_transfer_params, cache_salt))
        return st

    def abort(self, st: _RequestState) -> None:
        """Abort a submitted request nobody streams (its end still comes back as a record)."""
        if not st.finished:
            self._inbox.put(AbortRequest(st.request_id))

    async def stream(self, st: _RequestState) -> AsyncIterator[list[TokenRecord]]:
        """Yield the request's records (in lists of those that arrived together) until the finished one.
        Leaving early (cancellation, close) aborts the request."""
        try:
            while True:
                recs = [await st.queue.get()]
                while not st.queue.empty():  # a slow reader gets what piled up in one go
                    recs.append(st.queue.get_nowait())
                yield recs
                if recs[-1].finished:
                    return
        finally:
            if not st.finished:
                logger.info("client went away: aborting the request")
                self._inbox.put(AbortRequest(st.request_id))

    async def collect(self, request_id: str, token_ids: list[int], params, arrival: float,
                      kv_transfer_params: Optional[dict] = None) -> list[TokenRecord]:
        st = self.submit(request_id, token_ids, params, arrival, kv_transfer_params)
        async with aclosing(self.stream(st)) as gen:
            return [rec async for recs in gen for rec in recs]

    async def query(self, name: str, timeout: float = 30.0) -> Any:
        """Run a named read-only query (`stats`, `kv`: engine_commands.QUERIES) in the engine loop, between steps."""
        if name not in QUERIES:
            raise ValueError(f"no engine query {name!r}")
        return await self._ask(QUERIES[name], timeout=timeout)

    async def call(self, name: str, arg: Any, timeout: float = 10.0) -> Any:
        """Run the engine's P/D call `name` (release_lease, check_kv_probe: see LLMEngine) on `arg`, in
        the engine loop between steps."""
        if name not in CALLS:
            raise ValueError(f"no engine call {name!r}")
        return await self._ask(CALLS[name], arg, timeout=timeout)

    def release_remote_kv(self, request_id: str, params) -> None:
        """D: a P/D request refused before it reached the engine (a 400 on its fields, a 503): the engine loop tells
        P to end its lease now, if the params' proof holds. Without a running engine nothing is sent (the
        router releases the lease on P for any answer but 200)."""
        if isinstance(params, dict) and params.get("do_remote_prefill") and self.ready:
            self._inbox.put(ReleaseRemoteKV(request_id, params))

    async def _ask(self, query: type[Query], *args: Any, timeout: float) -> Any:
        if not self.ready:  # still starting (no info, no error yet) is not dead: say which, as /health does
            starting = self.info is None and self.error is None
            raise APIError(503, "the engine is still starting up" if starting else "the engine is not running")
        qid = next(self._qids)
        fut = self._loop.create_future()
        self._queries[qid] = fut
        self._inbox.put(query(qid, *args))
        try:
            return await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:  # busy in a long step, or stuck: the server's side is fine, so not a 500
            raise APIError(503, f"the engine loop did not answer within {timeout:g} s") from None
        finally:
            self._queries.pop(qid, None)

    @property
    def num_in_flight(self) -> int:
        return len(self._reqs)
