"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}`, and the handlers that make every failure
(including FastAPI's validation errors and unhandled exceptions) take that shape; no traceback reaches a client."""
from __future__ import annotations

import json
import logging
from http import HTTPStatus
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger("pdserve.serve")

# vLLM's error type names (the OpenAI client maps on the status code, not on these).
_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 405: "MethodNotAllowed",
          413: "RequestEntityTooLarge", 499: "ClientClosedRequest", 500: "InternalServerError",
          503: "ServiceUnavailableError"}


class APIError(Exception):
    """An error answered to the client as `status` with an OpenAI-shaped body."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, headers: Optional[dict] = None):
        super().__init__(message)
        self.status = int(status)
        self.message = message
        self.param = param
        self.headers = headers


def bad_request(message: str, param: Optional[str] = None) -> APIError:
    return APIError(400, message, param)


def error_body(status: int, message: str, param: Optional[str] = None) -> dict:
    kind = _TYPES.get(status) or HTTPStatus(status).phrase.replace(" ", "")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def dumps_error(status: int, message: str, param: Optional[str] = None) -> bytes:
    return json.dumps(error_body(status, message, param)).encode()


def error_response(status: int, message: str, param: Optional[str] = None,
                   headers: Optional[dict] = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status, headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(exc.status, exc.message, exc.param, exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        message = exc.detail if isinstance(exc.detail, str) else HTTPStatus(exc.status_code).phrase
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        return error_response(exc.status_code, message, headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        # Routes parse their bodies themselves; should a declared parameter fail anyway, answer 400, never 422.
        errs = exc.errors()
        first = errs[0] if errs else {}
        param = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
        return error_response(400, f"{param or 'request'}: {first.get('msg', 'invalid request')}", param)

    @app.exception_handler(Exception)
    async def _unhandled(request: Request, exc: Exception):
        logger.exception("unhandled error in %s %s", request.method, request.url.path)
        return error_response(500, "internal server error (see the server log)")
