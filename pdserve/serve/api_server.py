"""`pdserve serve`: the OpenAI-compatible HTTP server (FastAPI on uvicorn) in front of an AsyncEngine.

Routes: /v1/completions, /v1/chat/completions, /tokenize and /detokenize (`tokenize.py`), /v1/models, /health,
/version, /metrics, the P/D routes of `kv_routes.py` (/v1/kv/release, /v1/kv/probe) and, with --enable-debug-routes,
/debug/kv. The engine is built in the background after the socket is open, so /health answers 503 until start-up is
done. SIGTERM/SIGINT: stop accepting, let in-flight requests finish for up to --shutdown-timeout seconds, abort the
rest; a P/D producer then serves its open KV leases until decode nodes confirm them or they expire, within the same
timeout; stop the engine loop, exit 0. An engine that dies (its loop raised, its process was killed) fails the
requests in flight with an error, and the server exits 1, as vLLM's does, so that its supervisor restarts it.
"""
from __future__ import annotations

import asyncio
import hmac
import logging
import os
import signal
import time
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Optional

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response

import pdserve
from pdserve.model.hf_config import check_model_dir, read_json_file
from pdserve.sampling_params import SamplingParams
from pdserve.serve.async_engine import AsyncEngine
from pdserve.serve.body import DRAIN_SLACK, read_body
from pdserve.serve import json_body
from pdserve.serve.errors import APIError, bad_request, install_error_handlers
from pdserve.serve.gc_heap import freeze_startup_heap
from pdserve.serve.handoff import Handoffs, KVEndpoints, ParamsClient
from pdserve.serve.kv_routes import add_kv_routes
from pdserve.serve.metrics import CONTENT_TYPE, ServerMetrics
from pdserve.serve.prompts import CHARS_PER_TOKEN, ModelInfo
from pdserve.serve.request_context import RequestContextMiddleware, configure_logging, exit_cleanly_after_signals
from pdserve.serve.server_config import ServerConfig
from pdserve.serve.serving import OpenAIServing
from pdserve.serve.tokenize import add_tokenize_routes

logger = logging.getLogger("pdserve.serve")
_DRAIN_SLACK = DRAIN_SLACK


class ServerState:
    def __init__(self, engine_config, cfg: ServerConfig):
        self.cfg = cfg
        self.model_dir = engine_config.model.model
        self.cache_config = engine_config.cache
        self.max_num_seqs = engine_config.scheduler.max_num_seqs
        kv = engine_config.kv_transfer
        self.kv_token = kv.auth_token() if kv is not None else ""  # D checks P's proof on P's prompt ids with it
        self.handoffs = Handoffs()  # P: params for the D that took a request early (serve/handoff.py)
        self.params_client = ParamsClient(self.kv_token)  # D: asks P for them
        self.peer_hosts = frozenset(h for c in ((kv, *kv.connectors) if kv is not None else ()) for h in c.peer_hosts())
        # D: P's KV endpoints, where its engine awaits an early request's params (serve/handoff.py KVEndpoints)
        direct = kv is not None and kv.kv_connector == "TcpConnector" and kv.kv_role in ("kv_consumer", "kv_both") \
            and kv.kv_connector_extra_config.get("direct_handoff", True)
        self.kv_endpoints = KVEndpoints() if direct else None
        self.names = tuple(cfg.served_model_name) or (Path(self.model_dir).name,)
        self.api_key = cfg.api_key or os.environ.get("PDSERVE_API_KEY") or None
        check_model_dir(self.model_dir)
        self.metrics = ServerMetrics(self.names[0])
        self.engine = AsyncEngine(engine_config, cfg.engine_backend, cfg.max_waiting, self.metrics, cfg.log_level)
        self.engine.launch()  # the engine's process loads the model while this one loads the tokenizer
        try:
            self._load_tokenizer_and_defaults()
        except BaseException:
            self.engine.abandon()
            raise
        self.serving: Optional[OpenAIServing] = None
        self.created = int(time.time())
        self.startup_failed = False
        self.engine_died = False
        self.drain: Optional[asyncio.Future] = None  # started by the first SIGTERM/SIGINT

    def _load_tokenizer_and_defaults(self) -> None:
        from pdserve.core.tokenizer import load_hf_tokenizer
        try:
            self.tokenizer = load_hf_tokenizer(self.model_dir)  # the server's own: never the engine's
        except Exception as e:  # transformers' message runs over many lines and names no file
            why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ValueError(f"{self.model_dir!r}: cannot load its tokenizer: {why}") from None
        gen_path = Path(self.model_dir) / "generation_config.json"
        self.generation_config = read_json_file(gen_path) if gen_path.is_file() else {}
        try:  # the model's defaults apply to every request: a bad one is the deployment's, refused at start-up
            SamplingParams.from_generation_config(self.generation_config)
        except ValueError as e:
            raise ValueError(f"{gen_path}: the model's default sampling parameters are invalid: {e}") from None

    async def on_engine_ready(self, server=None) -> None:
        try:
            await self.engine.wait_started()
        except Exception as e:
            logger.error("%s", e)
            self.startup_failed = True
            if server is not None:
                server.should_exit = True
            return
        info = self.engine.info
        # EngineInfo counts the usable blocks; vLLM's num_gpu_blocks is the pool's, its null block included
        self.metrics.engine_ready(info.max_model_len, self.cache_config, info.num_blocks + 1)
        serving = OpenAIServing(self.engine, ModelInfo(
            self.names, self.tokenizer, info.vocab_size, info.max_model_len, self.generation_config,
            info.has_kv_connector, self.cfg.max_prompt_chars or CHARS_PER_TOKEN * info.max_model_len,
            self.cfg.max_waiting, self.max_num_seqs, kv_token=self.kv_token,
            trust_request_chat_template=self.cfg.trust_request_chat_template),
            self.handoffs, self.params_client, self.peer_hosts, self.kv_endpoints)
        freeze_startup_heap()  # before the first request is served
        self.serving = serving
        if self.cfg.trust_request_chat_template:
            logger.warning("--trust-request-chat-template: requests' own chat templates are rendered (code from "
                           "clients, run by this server): only for clients you trust")
        logger.info("engine ready: max_model_len=%d, %d KV blocks, device=%s, backend=%s, async scheduling %s",
                    info.max_model_len, info.num_blocks, info.device, self.cfg.engine_backend,
                    "on" if info.async_scheduling else "off")
        await self.engine.wait_died()
        if server is not None and not server.should_exit:  # not a shutdown's own stop: as vLLM, exit non-zero
            # so a supervisor restarts the server; uvicorn's graceful exit lets the error answers go out first
            logger.error("%s: the server exits (code 1)", self.engine.error)
            self.engine_died = True
            server.should_exit = True


async def read_json(request: Request, limit: int) -> dict:
    """The body's JSON object; its size goes to `request.state.body_bytes` (offload.py picks a pool by it)."""
    body = await read_body(request, limit)
    request.state.body_bytes = len(body)
    data, why = await json_body.parse_off_loop(body)
    if why is not None:
        raise bad_request(why)
    return data


def build_app(state: ServerState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.engine.start()
        json_body.start()
        watcher = asyncio.ensure_future(state.on_engine_ready(app.state.uvicorn_server))
        yield
        watcher.cancel()
        json_body.stop()
        if state.drain is not None:  # a P keeps serving open KV leases after its last HTTP request ended
            await state.drain
        await state.engine.shutdown()
        await state.params_client.aclose()

    app = FastAPI(title="pdserve", version=pdserve.__version__, lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.uvicorn_server = None
    app.add_middleware(RequestContextMiddleware)
    install_error_handlers(app)

    async def check_auth(request: Request) -> None:  # async: a sync dependency would hop to a worker thread
        if state.api_key is None:
            return
        auth = request.headers.get("authorization", "")
        # constant-time: a `!=` returns sooner the earlier the first wrong byte, which leaks the key byte by byte
        if not hmac.compare_digest(auth.encode(), f"Bearer {state.api_key}".encode()):
            raise APIError(401, "missing or invalid API key: send `Authorization: Bearer <key>`",
                           headers={"WWW-Authenticate": "Bearer"})

    def serving() -> OpenAIServing:
        if state.serving is None:
            state.engine.check_accepting()  # raises the right 503
            raise APIError(503, "the engine is still starting up")
        return state.serving

    async def generate(kind: str, request: Request) -> Response:
        arrival = time.monotonic()
        srv = serving()
        data = await read_json(request, state.cfg.max_body_bytes)
        return await srv.create(kind, data, request, request.state.request_id, arrival)

    @app.post("/v1/completions", dependencies=[Depends(check_auth)])
    async def completions(request: Request):
        return await generate("completion", request)

    @app.post("/v1/chat/completions", dependencies=[Depends(check_auth)])
    async def chat_completions(request: Request):
        return await generate("chat", request)

    @app.get("/v1/models", dependencies=[Depends(check_auth)])
    async def models():
        max_len = state.engine.info.max_model_len if state.engine.info else None
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": state.created, "owned_by": "pdserve", "root": state.model_dir,
             "parent": None, "max_model_len": max_len} for name in state.names]}

    @app.get("/health")
    async def health():
        if state.serving is not None and state.engine.ready and state.engine.accepting:
            stalled = state.engine.stalled_for()
            if stalled < state.cfg.engine_stall_timeout:
                return Response(status_code=200)
            return JSONResponse({"status": f"engine loop not answering for {stalled:.0f} s"}, status_code=503)
        why = "shutting down" if not state.engine.accepting else \
            "engine not running" if state.engine.error or (state.engine.info and not state.engine.ready) else \
            "starting up"
        if why == "engine not running" and state.engine.error is not None:  # e.g. "engine dead: AcceleratorError:
            why += f": {state.engine.error}"  # CUDA error: an illegal memory access was encountered"
        return JSONResponse({"status": why}, status_code=503)

    @app.get("/version")
    async def version():
        return {"version": pdserve.__version__}

    @app.get("/metrics")
    async def metrics():
        stats = None
        if state.engine.ready:
            try:
                stats = await state.engine.query("stats", timeout=10.0)
            except Exception as e:  # answer with what the server side has
                logger.warning("engine stats unavailable: %s", e)
        return Response(state.metrics.render(stats), media_type=CONTENT_TYPE)

    add_kv_routes(app, state, read_json)
    add_tokenize_routes(app, lambda: serving().info, lambda r: read_json(r, state.cfg.max_body_bytes),
                        [Depends(check_auth)])

    if state.cfg.enable_debug_routes:
        @app.get("/debug/kv", dependencies=[Depends(check_auth)])  # under the key like every route that says
        async def debug_kv():  # something of the node's state
            return await state.engine.query("kv", timeout=30.0)

    return app


class _Server:
    """uvicorn.Server whose first SIGTERM/SIGINT also starts draining the engine."""

    @staticmethod
    def make(config, state: ServerState):
        import uvicorn

        def start_drain():
            state.drain = asyncio.ensure_future(state.engine.drain(state.cfg.shutdown_timeout))

        class Server(uvicorn.Server):
            def handle_exit(self, sig, frame):
                if not self.should_exit and self._loop is not None:
                    logger.info("received %s: draining (up to %.1f s)", signal.Signals(sig).name,
                                state.cfg.shutdown_timeout)
                    self._loop.call_soon_threadsafe(start_drain)
                super().handle_exit(sig, frame)

            async def serve(self, sockets=None):
                self._loop = asyncio.get_running_loop()
                await super().serve(sockets)

        server = Server(config)
        server._loop = None
        return server


def run_server(engine_config, cfg: ServerConfig) -> int:
    """Serve until SIGTERM/SIGINT; returns the process exit code (0 after a clean shutdown, 1 if the engine
    failed to start or died)."""
    import uvicorn
    cfg.validate()
    configure_logging(cfg.log_level)
    state = ServerState(engine_config, cfg)
    app = build_app(state)
    config = uvicorn.Config(app, host=cfg.host, port=cfg.port, log_config=None, access_log=False,
                            log_level=cfg.log_level, timeout_graceful_shutdown=cfg.shutdown_timeout + 10,
                            timeout_keep_alive=30)
    server = _Server.make(config, state)
    app.state.uvicorn_server = server
    exit_cleanly_after_signals()
    server.run()
    if state.startup_failed or state.engine_died:
        return 1
    logger.info("shut down cleanly")
    return 0
