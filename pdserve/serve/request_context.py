"""X-Request-Id handling and logging: every request gets an id (the client's, if it sent a usable one), the id is
echoed in the response header and stamped on every log line written while the request is handled (a context
variable read by a logging filter); the engine loop passes it explicitly (`extra={"request_id": ...}`)."""
from __future__ import annotations

import logging
import re
import signal
import sys
import time
import uuid
from contextvars import ContextVar

from starlette.datastructures import MutableHeaders

from pdserve.serve.errors import dumps_error

request_id_var: ContextVar[str] = ContextVar("pdserve_request_id", default="-")
logger = logging.getLogger("pdserve.serve.access")
_ID_OK = re.compile(r"^[A-Za-z0-9._:/+=@-]{1,128}$")
_QUIET_PATHS = ("/health", "/metrics")  # polled: logged at debug level


class RequestIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "request_id"):
            record.request_id = request_id_var.get()
        return True


def configure_logging(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.WARNING)
    lvl = level.upper()
    for name in ("pdserve", "uvicorn", "uvicorn.error"):
        lg = logging.getLogger(name)
        lg.setLevel(lvl)
        lg.handlers[:] = []
        lg.propagate = True
    logging.getLogger("uvicorn.access").disabled = True  # RequestContextMiddleware writes the access log


def new_request_id() -> str:
    return uuid.uuid4().hex


class RequestContextMiddleware:
    """Pure ASGI (so the context variable is visible to the route, the stream and uvicorn's own logging)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"x-request-id"), None)
        rid = given if given and _ID_OK.match(given) else new_request_id()
        token = request_id_var.set(rid)
        scope.setdefault("state", {})["request_id"] = rid
        status = [None]
        t0 = time.perf_counter()

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)["x-request-id"] = rid
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception:
            logger.exception("unhandled error")
            if status[0] is None:  # nothing sent yet: answer 500 in the OpenAI shape, without the traceback
                body = dumps_error(500, "internal server error (see the server log)")
                await send_with_id({"type": "http.response.start", "status": 500,
                                    "headers": [(b"content-type", b"application/json"),
                                                (b"content-length", str(len(body)).encode())]})
                await send({"type": "http.response.body", "body": body})
        finally:
            path = scope.get("path", "")
            lvl = logging.DEBUG if path in _QUIET_PATHS and status[0] == 200 else logging.INFO
            logger.log(lvl, "%s %s %s %.1f ms", scope.get("method"), path, status[0] or "-",
                       (time.perf_counter() - t0) * 1e3)
            request_id_var.reset(token)


def exit_cleanly_after_signals() -> None:
    """Call just before uvicorn takes SIGTERM/SIGINT over. uvicorn restores the handlers it found and re-raises the
    signal it caught once it has shut down; with these no-ops in place that re-raise does nothing and the process
    exits 0 after a clean shutdown, not 143/130 (a supervisor reads death by signal as a crash)."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda s, f: None)
