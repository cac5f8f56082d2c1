"""The flow of one completion or chat request: translate the body, submit it, then answer in full or as a stream.

A non-streaming request watches for the client going away while it waits; a streaming one is cancelled by the
ASGI server when the client disconnects. Either way the engine gets an abort and frees the request's blocks.
A P/D request refused before the engine takes it (a 400 on its fields, a 503) still has the engine tell P to
release its KV lease, if the router's proof on its params holds.
"""
from __future__ import annotations

import asyncio
import logging
import time
from contextlib import aclosing
from typing import Optional

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pdserve.serve.async_engine import AsyncEngine
from pdserve.serve.errors import APIError
from pdserve.serve.handoff import AWAIT_PREFILL, HANDOFF_KEY, Handoffs, KVEndpoints, ParamsClient, dialable, \
    valid_key
from pdserve.transfer.channel.handoffs import AWAIT_KV
from pdserve.serve.offload import off_loop
from pdserve.serve.parallel_sampling import create_n
from pdserve.serve.prompts import ModelInfo
from pdserve.serve.protocol import to_generation_requests
from pdserve.serve.responses import ResponseBuilder, sse
from pdserve.serve.server_timing import server_timing

logger = logging.getLogger("pdserve.serve")
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def _unless_disconnected(coro, request: Request) -> asyncio.Task:
    """Runs `coro` until it ends or the client goes away (or we are cancelled); then it is cancelled, which aborts
    the request through the generator it awaits (see AsyncEngine.stream). Returns the done or cancelled task."""
    task = asyncio.ensure_future(coro)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    return task


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


# SGLang-style fields vllm-router sets on every request it forwards (at their defaults unless a client set them).
ROUTER_DEFAULT_FIELDS = frozenset({"no_stop_trim", "return_hidden_states", "continue_final_message",
                                   "separate_reasoning", "stream_reasoning", "include_reasoning"})


class OpenAIServing:
    def __init__(self, engine: AsyncEngine, info: ModelInfo, handoffs: Optional[Handoffs] = None,
                 params_client: Optional[ParamsClient] = None, peer_hosts: frozenset = frozenset(),
                 kv_endpoints: Optional[KVEndpoints] = None):
        self.engine = engine
        self.info = info
        self.handoffs = handoffs if handoffs is not None else Handoffs()  # P: params for an early D
        self.params_client = params_client  # D: asks P for them (serve/handoff.py)
        self.peer_hosts = peer_hosts  # D: the hosts of its kv_peers, the only ones it asks
        self.kv_endpoints = kv_endpoints  # D: P's KV endpoints by URL, where its engine awaits P's params directly

    async def create(self, kind: str, data: dict, request: Request, request_id: str, arrival: float) -> Response:
        kvp = data.get("kv_transfer_params")
        key = kvp.get(HANDOFF_KEY) if isinstance(kvp, dict) and kvp.get("do_remote_decode") is True else None
        if not valid_key(key):
            return await self._create(kind, data, request, request_id, arrival)
        self.handoffs.register(key)  # P: a D may be waiting for this request's params already
        try:
            return await self._create(kind, data, request, request_id, arrival, key)
        finally:  # every way the request ends: the D waiting is answered (no-op once the params went)
            self.handoffs.resolve(key, None, "the prefill node's request ended without handing over its KV")

    async def _await_params(self, greq, request: Request) -> Optional[float]:
        """D, a request taken before P answered: P's params in place of the await (serve/handoff.py); their arrival
        time, or None when the client went away first."""
        spec = greq.kv_transfer_params.get(AWAIT_PREFILL)
        if set(greq.kv_transfer_params) != {AWAIT_PREFILL} or not isinstance(spec, dict) or \
                not valid_key(spec.get("key")) or not isinstance(spec.get("url"), str):
            raise APIError(400, f"kv_transfer_params.{AWAIT_PREFILL}: {{\"url\": the prefill node's URL, \"key\": 32 "
                                "hex digits}, alone", "kv_transfer_params")
        if self.params_client is None or not self.info.kv_token:
            raise APIError(400, f"kv_transfer_params.{AWAIT_PREFILL}: this node has no KV token to ask a prefill "
                                "node with", "kv_transfer_params")
        if (why := dialable(spec["url"], self.peer_hosts)) is not None:
            raise APIError(400, f"kv_transfer_params.{AWAIT_PREFILL}: not asked: {why}", "kv_transfer_params")
        task = await _unless_disconnected(self.params_client.fetch(spec["url"], spec["key"]), request)
        if task.cancelled():
            return None
        params, why = task.result()
        if params is None:
            raise APIError(409, f"kv_transfer_params.{AWAIT_PREFILL}: the prefill node handed nothing over: {why}",
                           "kv_transfer_params")
        if self.kv_endpoints is not None:
            self.kv_endpoints.learn(spec["url"], params)
        greq.kv_transfer_params = params
        return time.monotonic()

    def _await_directly(self, greq) -> bool:
        """D: the engine awaits P's params and KV on P's KV channel (channel/handoffs.py) when this node's
        connector can and P's KV endpoint is known; else False (the HTTP way, which learns the endpoint)."""
        spec = greq.kv_transfer_params.get(AWAIT_PREFILL)
        if self.kv_endpoints is None or set(greq.kv_transfer_params) != {AWAIT_PREFILL} or \
                not isinstance(spec, dict) or not valid_key(spec.get("key")) or not isinstance(spec.get("url"), str) \
                or dialable(spec["url"], self.peer_hosts) is not None:
            return False
        endpoint = self.kv_endpoints.get(spec["url"])
        if endpoint is None:
            return False
        greq.kv_transfer_params = {AWAIT_KV: {"host": endpoint[0], "port": endpoint[1], "key": spec["key"]}}
        return True

    async def _create(self, kind: str, data: dict, request: Request, request_id: str, arrival: float,
                      handoff: Optional[str] = None) -> Response:
        lease_params = data.get("kv_transfer_params")  # what a refusal tells P to release (D: P's, once in)
        try:
            # chat templating and tokenizing take time that grows with the text: on the event loop they would
            # stall every other request's stream
            greqs = await off_loop(request, to_generation_requests, kind, data, self.info)
            greq = greqs[0]
            if greq.unknown_fields:  # what routers add to every request is no news: a debug line, not a warning
                noisy = [f for f in greq.unknown_fields if f not in ROUTER_DEFAULT_FIELDS]
                (logger.warning if noisy else logger.debug)("ignoring unknown field(s): %s",
                                                            ", ".join(greq.unknown_fields))
            if isinstance(greq.kv_transfer_params, dict) and AWAIT_KV in greq.kv_transfer_params:
                raise APIError(400, f"kv_transfer_params.{AWAIT_KV}: this node's own, not a client's: send "
                                    f"{AWAIT_PREFILL}", "kv_transfer_params")
            direct = isinstance(greq.kv_transfer_params, dict) and AWAIT_PREFILL in greq.kv_transfer_params and \
                self._await_directly(greq)
            if direct:
                lease_params = None  # no lease until P posts: nothing to release on a refusal
            elif isinstance(greq.kv_transfer_params, dict) and AWAIT_PREFILL in greq.kv_transfer_params:
                arrival = await self._await_params(greq, request)
                if arrival is None:
                    return Response(status_code=499)
                lease_params = greq.kv_transfer_params
            if greq.params.n > 1 or len(greqs) > 1:
                return await create_n(self.engine, greqs, request, self.engine.unique_id(request_id), arrival,
                                      "cmpl-" if kind == "completion" else "chatcmpl-", _unless_disconnected)
            st = self.engine.submit(request_id, greq.prompt_token_ids, greq.params, arrival, greq.kv_transfer_params,
                                    greq.cache_salt)
        except APIError:  # refused (a bad field, queue full, draining): a P/D request's lease on P ends now
            self.engine.release_remote_kv(request_id, lease_params)
            raise
        prefix = "cmpl-" if kind == "completion" else "chatcmpl-"
        builder = ResponseBuilder(greq, prefix + st.request_id, int(time.time()))
        logger.info("%s request: %d prompt tokens%s%s, max_tokens=%s, stream=%s", kind, len(greq.prompt_token_ids),
                    " (P's, not tokenized here)" if greq.ids_from_prefill else "",
                    " (P's params awaited on its KV channel)" if direct else "", greq.params.max_tokens, greq.stream)
        gen = self.engine.stream(st)
        if greq.stream:
            first, headers = None, _SSE_HEADERS
            if greq.kv_transfer_params is not None:
                # P/D (the router's request): hold the headers until the first token, so they carry the timing
                # (KV transfer, queue) and an error before it gets a real status; the body is the same.
                first = await self._first(gen, request)
                if first is None:
                    return Response(status_code=499)
                headers = {**headers, **server_timing(next((r.timing for r in first if r.timing), None),
                                                      any(r.kv_unused for r in first))}
            return StreamingResponse(self._stream(gen, builder, first), media_type="text/event-stream",
                                     headers=headers)
        on_params = None if handoff is None else lambda params: self.handoffs.resolve(handoff, params)
        return await self._full(gen, builder, request, on_params)

    @staticmethod
    async def _first(gen, request: Request) -> Optional[list]:
        """The records up to the first token or the end; None if the client went away first (aborted)."""
        async def until_first():
            recs = []
            while not recs or not (recs[-1].finished or recs[-1].new_token_ids):
                recs += await gen.__anext__()
            return recs

        task = await _unless_disconnected(until_first(), request)
        if task.cancelled() or task.exception() is not None:
            await gen.aclose()  # a no-op after a cancel: the generator's own exit sent the abort
            return None if task.cancelled() else task.result()  # (re-raises)
        recs = task.result()
        last = recs[-1]
        if last.finished and last.finish_reason == "error":
            await gen.aclose()
            if last.rejected:
                raise APIError(400, last.error or "request refused", "kv_transfer_params")
            if last.error_status:
                raise APIError(last.error_status, last.error or "request failed", "kv_transfer_params")
            raise APIError(500, f"the request failed: {last.error or 'engine error'}")
        return recs

    async def _full(self, gen, builder: ResponseBuilder, request: Request, on_params=None) -> Response:
        async def run():
            async with aclosing(gen):
                async for recs in gen:
                    for rec in recs:
                        builder.add(rec)
                    if on_params is not None and builder.kv_transfer_params is not None:
                        on_params(builder.kv_transfer_params)  # P: to the early D now, before this answer is built

        task = await _unless_disconnected(run(), request)
        if task.cancelled():
            return Response(status_code=499)
        task.result()
        if builder.finish_reason == "error":
            if builder.rejected:
                raise APIError(400, builder.error or "request refused", "kv_transfer_params")
            if builder.error_status:
                raise APIError(builder.error_status, builder.error or "request failed", "kv_transfer_params")
            raise APIError(500, f"the request failed: {builder.error or 'engine error'}")
        logger.info("finished: %s, %d tokens", builder.finish_reason, len(builder.token_ids))
        return JSONResponse(builder.full(), headers=server_timing(builder.timing, builder.kv_unused))

    async def _stream(self, gen, builder: ResponseBuilder, first_recs=None):
        async with aclosing(gen):
            try:
                first = builder.first_chunks()
                if first:
                    yield first
                if first_recs:  # what _first() read (usually just the engine's "accepted" marker)
                    out = builder.chunks(first_recs)
                    if out:
                        yield out
                async for recs in gen:
                    out = builder.chunks(recs)
                    if out:
                        yield out
                logger.info("finished: %s, %d tokens (stream)", builder.finish_reason, len(builder.token_ids))
            except Exception:  # after the headers went out: an error event, then the end
                logger.exception("stream failed")
                yield sse({"error": {"message": "internal server error (see the server log)",
                                     "type": "InternalServerError", "param": None, "code": 500}})
            yield builder.final_chunks()
