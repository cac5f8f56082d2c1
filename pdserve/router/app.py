"""`pdserve router`: the P/D front door. OpenAI routes in, prefill on a P, decode on a D, D's answer streamed out.

Lifecycle of a request:
1. the client's body is parsed (400 on bad JSON); `X-Request-Id` is taken or made, and carried to P and D;
2. step 1, to a healthy P (round-robin, or least-loaded with ties taken in turn): the same request with
   `max_tokens=1`, `stream=false`, `ignore_eos=true`, no stop conditions, `kv_transfer_params={"do_remote_decode":
   true}`; a P that fails before answering (connection error, 5xx) is retried on another P, and so is a P that
   refuses the P/D prefill itself (a 4xx on kv_transfer_params: no KV connector, a decode node), a deployment
   error answered 502 when no P is left; that P is then tried last for 30 s (`PD_REFUSAL_HOLD`, or until its
   /health goes down and back), so later requests skip the round trip; a P refusing the client's own fields
   sends the request to D alone, which answers the same client errors (or serves it where P and D are
   configured differently); a one-token token-id
   prompt skips P (a one-token *text* prompt still goes there: the router has no tokenizer; P answers without
   params and D prefills it), and so do a request for n > 1 choices, a completions batch of several prompts and
   one asking for prompt logprobs (D prefills those itself);
3. step 2, to a D that P's probe verifies on (below): the original request plus P's `kv_transfer_params` as P
   returned them, with P's own proof (D checks it; the router holds no KV token); a D that refuses the
   connection (down since the last health check) is taken out of rotation and the next D is tried; a P answer
   without params (nothing to hand over) sends the original request to D alone, which prefills it locally; with
   no D left (none healthy, or each failed before answering) a healthy P serves the request whole, the P that
   prefilled it first (`--prefill-fallback`, on by default: a D down or stalled is not a client error);
4. D's response, streamed or not, goes back to the client (a stream of one choice through router/splice.py,
   which follows its token ids); but D refusing P's params (a 400 on kv_transfer_params) is a deployment error,
   not the client's: the client gets a 502 naming it, and a proof that does not verify takes that P/D pair out
   of rotation (P and D hold different KV tokens); a D that resets the connection before answering is asked
   again (another D, or once more), and a D that breaks off an answer it began is migrated: the stream resumes
   on another node from the tokens the client has, a whole answer is asked again (router/migration.py,
   `--max-migrations`); past the limit a stream ends with an error event and `[DONE]`;
5. params no D took end their lease on P at once: when no D is left, D cannot be reached, D answers anything but
   200 (D also releases what it refuses itself; the two are idempotent), D answers 200 but says it took none of
   the KV (`X-PD-KV-Unused`: it prefilled locally, e.g. over a KV link TLS breaks, which its own `done` would
   travel too), or the client goes away before D's
   answer (its request to D is dropped, so D aborts), the router posts the signed params to that P's
   `/v1/kv/release` (in the background; should that fail too, the lease ends at its expiry).
Without prefill nodes (`pdserve router --decode A B`, no --prefill) the router fronts a collocated pool: step 2
is skipped and every request is served whole by the node step 3 picks, with the same health checks and migration.
With `--pd-first-token prefill` (docs/pd.md) step 2 sends P the client's own params with `first_token` asked; a
P answer without params is then the whole answer (its token ended the request: D is not asked); otherwise a
streamed request gets P's token at once and D's stream after it, spliced (router/first_token.py), and a D that
fails before a token of its own is replaced by another with the same params (router/migration.py); a streamed
request's D is asked at step 2 already, to take P's params from P itself (`--pd-early-decode`, on by default;
router/early_decode.py).
A background task polls every node's /health: a node that fails is taken out of rotation and put back when it
answers again. With it, each P's probe (`GET /v1/kv/probe`, signed with P's KV token) goes to each D (`POST
/v1/kv/probe`): a pair whose probe does not verify is out of rotation, with a log line, until it does.

`/metrics` has `pdserve_router_ttft_seconds{stage}`, the time to first token of each request split by where it went.
Each node reports its own part in a `Server-Timing` header (`queue`, `kv_transfer`, `prefill`, `ttft`, in ms; a D
holds a P/D stream's headers until its first token for this), so every stage is a difference of one clock's times
and no clocks need to agree across hosts:
- router_to_prefill: P's round trip less P's prefill (the hops, HTTP, P's queue; retries on other Ps included);
- prefill: P's prefill compute (its first scheduled step to its token);
- kv_transfer: D waiting for the prompt KV (pull started to pull seen done);
- decode_queue: D's arrival to its first scheduled step, less kv_transfer;
- first_token: the rest of `total` (router -> D, D's one-token replay or its local prefill, the first chunk back);
- total: the client's view: the router's arrival to D's first body chunk. A non-streamed answer has no first
  chunk, so there total = router -> D sent + D's own `ttft`.
Stages a request did not pass (no P asked, no KV handed over) are not observed.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from typing import Callable, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from prometheus_client import (GC_COLLECTOR, PLATFORM_COLLECTOR, PROCESS_COLLECTOR, CollectorRegistry, Counter,
                               generate_latest)
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdserve.router.early_decode import EarlyDecode
from pdserve.router.first_token import FirstToken
from pdserve.router.migration import (MAX_MIGRATIONS, Attempt, Migrator, asks_prompt_logprobs, drop_open, is_reset,
                                      migrates, resume_body)
from pdserve.router.nodes import Fleet, Node, error_of
from pdserve.router.relay import error, reason, relay_answer
from pdserve.router.splice import Splice
from pdserve.router.timing import TtftSplit
from pdserve.router.upstream import Answer, ConnectFailed, UpstreamError
from pdserve.serve.body import read_body
from pdserve.serve.errors import APIError
from pdserve.serve.gc_heap import freeze_startup_heap
from pdserve.serve.handoff import HANDOFF_KEY
from pdserve.serve.server_timing import KV_UNUSED_HEADER, parse_server_timing
from pdserve.transfer.channel.proof import NOT_VERIFIED

logger = logging.getLogger("pdserve.router")
STOP_FIELDS = ("stop", "stop_token_ids", "min_tokens", "stream_options", "max_completion_tokens")
MAX_BODY_BYTES = 16 * 2 ** 20  # as `pdserve serve`'s
PD_REFUSAL_HOLD = 30.0  # s a P that refused the P/D prefill itself is passed over while another P is left


def _include_usage(body: dict) -> bool:
    opts = body.get("stream_options")
    return isinstance(opts, dict) and opts.get("include_usage") is True


async def _wait_disconnect(request: Request) -> None:
    """Returns when the client goes away (its body was read already, so only the disconnect is left to receive)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class Router(Fleet):
    max_body_bytes = MAX_BODY_BYTES  # --max-body-bytes: bodies are read as they stream in, up to this

    def __init__(self, prefill: list[str], decode: list[str], policy: str, health_interval: float = 1.0,
                 timeout: float = 600.0, pd_first_token: str = "replay", max_migrations: int = MAX_MIGRATIONS,
                 prefill_fallback: bool = True, early_decode: bool = True):
        super().__init__(prefill, decode, policy, health_interval, timeout, prefill_fallback)
        self.pd_first_token = pd_first_token  # "prefill": P samples the first token, streamed to the client at once
        self.early_decode = early_decode  # with "prefill": a stream's D is asked when its P is (early_decode.py)
        self.registry = CollectorRegistry()
        for c in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):  # process_*, python_*, as a server's
            self.registry.register(c)
        self.ttft = TtftSplit(self.registry)
        self.migrator = Migrator(self, self.registry, max_migrations)  # answers moved off a failed node
        self.on_fallback = Counter("pdserve_router_prefill_fallbacks", "Requests a prefill node served whole because "
                                   "no decode node could take them", registry=self.registry).inc
        self._releases: set[asyncio.Task] = set()


    async def _prefill(self, path: str, body: dict, headers: dict,
                       on_pick: Optional[Callable[[Node], Optional[str]]] = None
                       ) -> tuple[Optional[dict], Optional[Node], dict, Optional[Response], str, Optional[dict]]:
        """(P's kv_transfer_params or None: nothing to hand over, the P that answered, P's Server-Timing, an error
        response for the client or None, P's refusal of the client's request or "", P's whole answer). `on_pick(P)`,
        called before each P is asked, may return a handoff key for it (router/early_decode.py)."""
        if self.pd_first_token == "prefill":  # the client's own params: P's token is the answer's first
            p_body = {k: v for k, v in body.items() if k != "stream_options"}
            p_body.update(stream=False, kv_transfer_params={"do_remote_decode": True, "first_token": True})
            if self.migrator.tracks(body):
                p_body["return_token_ids"] = True  # the first token's id: where a resumed stream starts
        else:
            p_body = {k: v for k, v in body.items() if k not in STOP_FIELDS}
            p_body.update(max_tokens=1, stream=False, ignore_eos=True, kv_transfer_params={"do_remote_decode": True})
        tried: tuple = self.prefill_exclusions()
        now = time.monotonic()
        held = tuple(n for n in self.prefill.nodes if n.refused_pd_until > now)
        setup_error = ""
        # held Ps only when no other is left: they may be fixed by now, and without them the answer is a 502 anyway
        while (node := self.prefill.pick(tried + held) or self.prefill.pick(tried)) is not None:
            tried += (node,)
            if on_pick is not None and (key := on_pick(node)) is not None:
                p_body["kv_transfer_params"] = {**p_body["kv_transfer_params"], HANDOFF_KEY: key}
            node.in_flight += 1
            try:
                r = await self.client.request("POST", node.url + path, json=p_body, headers=headers)
            except UpstreamError as e:
                logger.warning("[%s] prefill node %s failed: %s; trying another", headers["X-Request-Id"], node.url,
                               reason(e))
                continue
            finally:
                node.in_flight -= 1
            if r.status_code >= 500:
                continue
            if r.status_code != 200:
                msg, param = error_of(r)
                if param == "kv_transfer_params":  # P's own P/D set-up refused (no KV connector, a decode node)
                    setup_error = f"prefill node {node.url} refused the P/D prefill: {msg}"
                    log = logger.debug if node.refused_pd_until > now else logger.error  # once per hold
                    log("[%s] %s (a deployment error): tried last for %.0f s; trying another", headers["X-Request-Id"],
                        setup_error, PD_REFUSAL_HOLD)
                    node.refused_pd_until = time.monotonic() + PD_REFUSAL_HOLD
                    continue
                # P refused the client's fields: D, which answers the same client errors, decides (P and D may
                # be configured differently, e.g. a shorter max_model_len on P: D then prefills locally)
                return None, node, {}, None, f"{r.status_code} {msg}", None
            try:
                answer = r.json()
                params = answer.get("kv_transfer_params")
            except (ValueError, AttributeError) as e:
                logger.warning("[%s] prefill node %s answered unreadable JSON (%s); trying another",
                               headers["X-Request-Id"], node.url, e)
                continue
            node.refused_pd_until = 0.0
            return params, node, parse_server_timing(r.headers.get("server-timing")), None, "", answer
        if setup_error:  # never a 4xx: the client's request was not at fault
            return None, None, {}, error(502, setup_error, "bad_gateway"), "", None
        return None, None, {}, None, "", None  # no P left: D prefills locally

    def _release(self, p_node: Optional[Node], d_body: dict, rid: str, why: str) -> None:
        """Step 5: end, in the background, P's lease on the signed params in `d_body` (if any) that no D took."""
        params = d_body.get("kv_transfer_params")
        if params and p_node is not None:
            task = asyncio.ensure_future(self._post_release(p_node, params, rid, why))
            self._releases.add(task)  # held until done (the loop keeps only weak references to tasks)
            task.add_done_callback(self._releases.discard)

    async def _post_release(self, p_node: Node, params: dict, rid: str, why: str) -> None:
        try:
            r = await self.client.request("POST", p_node.url + "/v1/kv/release", json={"kv_transfer_params": params},
                                          headers={"X-Request-Id": rid}, timeout=5.0)
        except UpstreamError as e:
            logger.warning("[%s] %s; prefill node %s did not release the KV lease (%s): it ends at its expiry",
                           rid, why, p_node.url, e)
            return
        if r.status_code == 200:
            logger.info("[%s] %s: released its KV lease on %s", rid, why, p_node.url)
        elif r.status_code == 404:  # D's own release (or the lease's end) came first
            logger.debug("[%s] %s: no KV lease left to release on %s", rid, why, p_node.url)
        else:
            logger.warning("[%s] %s; prefill node %s refused to release the KV lease: %s %s", rid, why, p_node.url,
                           r.status_code, r.text[:200])

    async def handle(self, request: Request, path: str) -> Response:
        rid = request.headers.get("x-request-id") or uuid.uuid4().hex
        headers = {"X-Request-Id": rid}
        if "authorization" in request.headers:
            headers["Authorization"] = request.headers["authorization"]
        try:
            body = json.loads(await read_body(request, self.max_body_bytes, "router"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return error(400, f"request body is not valid JSON: {e}")
        except APIError as e:  # over --max-body-bytes (never read whole), or gone before its body was in
            return error(e.status, e.message) if e.status != 499 else Response(status_code=499)
        if not isinstance(body, dict):
            return error(400, "request body must be a JSON object")
        body.pop("kv_transfer_params", None)  # only the router talks P/D to the nodes
        no_d = not any(n.healthy for n in self.decode.nodes)  # before P: a prefill no D can take only holds a lease
        if no_d and not self.can_serve():
            return error(503, "no healthy decode node", "service_unavailable")
        if not no_d and (why := self.no_pair()) is not None:
            return error(503, why, "service_unavailable")
        t0 = time.monotonic()
        prompt = body.get("prompt")
        # Straight to D, no P: a one-token prompt has no KV to import, and neither n > 1 choices, a batch of
        # prompts nor prompt logprobs (echo with logprobs too) is served P/D (D prefills them itself)
        n = body.get("n")
        skip_p = isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], int) or \
            (isinstance(n, int) and not isinstance(n, bool) and n > 1) or \
            (isinstance(prompt, list) and len(prompt) > 1 and isinstance(prompt[0], (str, list))) or \
            asks_prompt_logprobs(body) or no_d or not self.prefill.nodes  # no D: a P serves it whole (`fallback`)
        gone = asyncio.ensure_future(_wait_disconnect(request))  # watched until D answers (then by the response)
        sending = None
        early = EarlyDecode(self, path, body, headers, self.migrator.tracks(body), self.migrator.early) \
            if self.early_decode and self.pd_first_token == "prefill" and body.get("stream") and not skip_p else None
        try:
            params, p_node, p_timing, err, p_refused, p_answer = (None, None, {}, None, "", None) if skip_p else \
                await self._prefill(path, body, headers, early.launch if early is not None else None)
            if err is not None:
                return err
            if early is not None and not (params and p_answer is not None):
                early.drop()  # nothing for D to take, or no first token to stream before it
            t_d = time.monotonic()
            p_round_trip = None if skip_p else t_d - t0
            d_body = dict(body)
            if params:
                d_body["kv_transfer_params"] = params  # verbatim: P's proof covers them
            if self.migrator.tracks(body):
                d_body["return_token_ids"] = True  # where the stream stands, should it need resuming
            if gone.done():  # the client left while P prefilled: no D will take these params
                self._release(p_node, d_body, rid, "the client went away")
                return Response(status_code=499)
            first = FirstToken(p_answer, show_ids=bool(body.get("return_token_ids"))) \
                if self.pd_first_token == "prefill" and p_answer is not None else None
            if first is not None and not params:  # P's token ended the request: P's answer is all of it
                self.ttft.observe(t_d - t0, p_round_trip, p_timing, {}, False, from_prefill=True)
                if body.get("stream"):
                    return StreamingResponse(iter([first.chunks(True, _include_usage(body))]),
                                             media_type="text/event-stream", headers={"X-Request-Id": rid})
                if not body.get("return_token_ids"):
                    for c in p_answer.get("choices") or ():
                        c.pop("token_ids", None)
                    p_answer.pop("prompt_token_ids", None)
                return JSONResponse(p_answer, headers={"X-Request-Id": rid})
            if first is not None and body.get("stream"):
                self.ttft.observe(time.monotonic() - t0, p_round_trip, p_timing, {}, False, from_prefill=True)
                attempt = early.attempt() if early is not None else Attempt()
                return StreamingResponse(
                    self.migrator.stream(path, body, d_body, headers, p_node,
                                         first.splice(hold_errors=self.migrator.tracks(body)), attempt,
                                         prefix=first.chunks(False, _include_usage(body)),
                                         release=lambda why: self._release(p_node, d_body, rid, why)),
                    media_type="text/event-stream", headers={"X-Request-Id": rid},
                    background=BackgroundTask(attempt.end))
            tried: tuple = ()
            reset_once = None  # a D that reset a kept-alive connection: asked once more when no other D is left
            reset_why = ""  # the last reset, answered 502 should no node be left
            while True:
                node = self.decode_for(p_node if params else None, tried) or reset_once
                reset_once = None
                if node is None and (node := self.fallback(tried, prefer=p_node)) is not None:
                    # no D left: this P serves the request whole (P's prefix cache holds the prompt it prefilled)
                    self._release(p_node, d_body, rid, f"no decode node: served whole on {node.url}")
                    d_body, params = resume_body(body, [], ask_ids=self.migrator.tracks(body)), None
                if node is None:
                    self._release(p_node, d_body, rid, reset_why or "no healthy decode node")
                    if reset_why:
                        logger.warning("[%s] %s: answered 502", rid, reset_why)
                        return error(502, reset_why, "bad_gateway")
                    return error(503, "no healthy decode node", "service_unavailable")
                node.in_flight += 1
                sending = asyncio.ensure_future(self.client.open(node.url + path, json=d_body, headers=headers))
                await asyncio.wait({sending, gone}, return_when=asyncio.FIRST_COMPLETED)
                failed = sending.exception() if sending.done() else None
                if isinstance(failed, ConnectFailed):
                    # nothing reached that D (it went down since the last health check): out of rotation until it
                    # answers /health again, and the request goes to another
                    node.in_flight -= 1
                    node.healthy, sending, tried = False, None, tried + (node,)
                    logger.warning("[%s] decode node %s refused the connection: out of rotation; trying another",
                                   rid, node.url)
                    continue
                if not is_reset(failed):
                    break
                # reset before any byte of an answer (a kept-alive connection the node closed, e.g. after a stall
                # past its keep-alive, or a node that died): nothing reached the client, so another D is asked, or
                # this one once more, else a P
                node.in_flight -= 1
                sending, reset_once, tried = None, None if node in tried else node, tried + (node,)
                reset_why = f"decode node {node.url} failed: {reason(failed)}"
                logger.warning("[%s] decode node %s reset the connection before answering (%s); trying again", rid,
                               node.url, reason(failed))
        except asyncio.CancelledError:  # the router is shutting down
            if sending is not None:
                sending.cancel()
                node.in_flight -= 1
            raise
        finally:
            gone.cancel()
            if early is not None:
                early.drop()  # not handed to the stream: P's answer is all of it, P failed, or the client left
        if not sending.done():  # the client left before D answered: drop D's request (D aborts it)
            await drop_open(sending, node)
            self._release(p_node, d_body, rid, "the client went away before the decode node answered")
            return Response(status_code=499)
        try:
            upstream = sending.result()
        except UpstreamError as e:
            node.in_flight -= 1
            why = f"decode node {node.url} failed: {reason(e)}"
            logger.warning("[%s] %s: answered 502", rid, why)
            self._release(p_node, d_body, rid, why)
            return error(502, why, "bad_gateway")
        if upstream.status_code != 200:
            self._release(p_node, d_body, rid, f"decode node {node.url} answered {upstream.status_code}")
        if upstream.status_code == 400 and params:
            node.in_flight -= 1
            return await self._refused(upstream, p_node, node)
        ok = upstream.status_code == 200
        if ok and params and upstream.headers.get(KV_UNUSED_HEADER):
            self._release(p_node, d_body, rid, f"decode node {node.url} prefilled locally")
        if ok and p_refused:
            logger.warning("[%s] prefill node %s refused the request (%s) that decode node %s serves: P and D are "
                           "configured differently (max_model_len, limits, API key?); D prefilled it", rid,
                           p_node.url, p_refused, node.url)
        d_timing = parse_server_timing(upstream.headers.get("server-timing"))
        if ok and not body.get("stream") and "ttft" in d_timing:
            # A whole answer: the router never sees the first token, D's own TTFT stands in for it.
            self.ttft.observe(t_d - t0 + d_timing["ttft"], p_round_trip, p_timing, d_timing, bool(params))
        on_first = (lambda: self.ttft.observe(time.monotonic() - t0, p_round_trip, p_timing, d_timing,
                                              bool(params))) if ok else None
        if ok and self.migrator.tracks(body) and "text/event-stream" in upstream.headers.get("content-type", ""):
            attempt = Attempt(node, upstream)
            splice = Splice(strip_ids=not body.get("return_token_ids"), hold_errors=True)
            return StreamingResponse(self.migrator.stream(path, body, d_body, headers, p_node, splice, attempt,
                                                          on_first),
                                     media_type="text/event-stream", headers={"X-Request-Id": rid},
                                     background=BackgroundTask(attempt.end))
        on_break = None
        if ok and self.migrator.max_migrations and migrates(body):
            async def on_break(why: str) -> Response:
                return await self.migrator.whole_again(path, body, headers, (node,), why)
        return await relay_answer(upstream, node, rid, on_first, on_break)

    async def _refused(self, upstream: Answer, p: Node, d: Node) -> Response:
        """D's 400 to a P/D request: on the params this router relayed unaltered it is a deployment error, answered
        502; on the client's own fields it goes back as it is."""
        await upstream.aread()
        await upstream.aclose()
        try:
            err = upstream.json()["error"]
        except (ValueError, KeyError, TypeError):
            err = {}
        if err.get("param") != "kv_transfer_params":
            return Response(upstream.content, 400, media_type=upstream.headers.get("content-type"))
        msg = str(err.get("message", ""))
        if msg.startswith(NOT_VERIFIED):
            self.mark_pair(p, d, f"decode node could not verify the prefill node's KV proof: {msg}")
            return error(502, f"KV token mismatch: decode node {d.url} could not verify the kv_transfer_params of "
                              f"prefill node {p.url} ({msg}); P and D must share the KV token", "bad_gateway")
        return error(502, f"decode node {d.url} refused the kv_transfer_params of prefill node {p.url}: {msg}",
                     "bad_gateway")



def build_app(router: Router) -> FastAPI:
    async def lifespan(app):
        task = asyncio.create_task(router.health_loop())
        freeze_startup_heap()
        yield
        task.cancel()
        await router.client.aclose()

    app = FastAPI(lifespan=lifespan)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await router.handle(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await router.handle(request, "/v1/chat/completions")

    async def on_a_decode_node(request: Request, path: str) -> Response:
        """What every node answers alike (the model, its tokenizer): relayed from a healthy decode node."""
        node = router.decode.pick() or (router.prefill.pick() if router.prefill_fallback else None)
        if node is None:
            return error(503, "no healthy decode node", "service_unavailable")
        headers = {k: v for k, v in request.headers.items() if k in ("authorization", "content-type", "x-request-id")}
        try:
            r = await router.client.request(request.method, node.url + path,
                                            content=await read_body(request, router.max_body_bytes, "router"),
                                            headers=headers)
        except APIError as e:  # the body's limit, as on the generation routes
            return error(e.status, e.message) if e.status != 499 else Response(status_code=499)
        except UpstreamError as e:
            logger.warning("decode node %s failed on %s: %s: answered 502", node.url, path, reason(e))
            return error(502, f"decode node {node.url} failed: {reason(e)}", "bad_gateway")
        return Response(r.content, r.status_code, media_type=r.headers.get("content-type", "application/json"))

    def relayed(path: str):
        async def relay(request: Request):
            return await on_a_decode_node(request, path)
        return relay

    for method, path in (("GET", "/v1/models"), ("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/version")):
        app.add_api_route(path, relayed(path), methods=[method])

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):  # OpenAI's shape, as the nodes answer
        kind = "not_found" if exc.status_code == 404 else "invalid_request_error"
        return error(exc.status_code, str(exc.detail), kind)

    @app.get("/health")
    async def health():
        return Response(status_code=200 if router.can_serve() else 503)

    @app.get("/nodes")
    async def nodes():
        return {"prefill": [n.__dict__ for n in router.prefill.nodes],
                "decode": [n.__dict__ for n in router.decode.nodes]}

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(router.registry), media_type="text/plain; version=0.0.4")

    return app
