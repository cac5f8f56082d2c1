"""The router's `Upstream` (router/upstream.py) over an httpx transport, for fake nodes written as httpx MockTransport
handlers: an httpx.Response, or an httpx error raised before or during the body, reaching the router as its own
failures (`ConnectFailed`, `Reset`, `Timeout`), as aiohttp's do in production (tests/router/test_upstream.py)."""
from __future__ import annotations

import json
from typing import Optional

import httpx

from pdserve.router.upstream import Answer, ConnectFailed, Reset, Timeout, UpstreamError, describe


def as_upstream(e: httpx.HTTPError) -> UpstreamError:
    what = describe(e)
    if isinstance(e, httpx.ConnectError):
        return ConnectFailed(what)
    if isinstance(e, httpx.TimeoutException):
        return Timeout(what)
    if isinstance(e, (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError)):
        return Reset(what)
    return UpstreamError(what)


class MockUpstream:
    """`handler`: a MockTransport's function, or an httpx transport itself."""

    def __init__(self, handler):
        transport = handler if isinstance(handler, httpx.AsyncBaseTransport) else httpx.MockTransport(handler)
        self.client = httpx.AsyncClient(transport=transport)

    async def request(self, method: str, url: str, *, json=None, content=None, headers=None, timeout=None) -> Answer:
        try:
            r = await self.client.request(method, url, json=json, content=content, headers=headers)
        except httpx.HTTPError as e:
            raise as_upstream(e) from e
        return Answer(r.status_code, r.headers, r.content)

    async def open(self, url: str, *, json, headers=None) -> Answer:
        try:
            r = await self.client.send(self.client.build_request("POST", url, json=json, headers=headers), stream=True)
        except httpx.HTTPError as e:
            raise as_upstream(e) from e

        async def chunks():
            try:
                if hasattr(r, "_content"):  # a fake answer made whole (httpx.Response(json=...)): no stream to read
                    yield r.content
                    return
                async for chunk in r.aiter_raw():
                    yield chunk
            except httpx.HTTPError as e:
                raise as_upstream(e) from e

        return Answer(r.status_code, r.headers, chunks=chunks(), close=r.aclose)

    async def aclose(self) -> None:
        await self.client.aclose()


def routine(request: httpx.Request, calls: list) -> tuple[str, Optional[dict], Optional[httpx.Response]]:
    """What every fake node answers alike: /health (200), /v1/kv/probe (404: no probing), /v1/kv/release (200).
    (node URL, JSON body or None, that answer or None); every call but health and probes goes into `calls`."""
    url = f"{request.url.scheme}://{request.url.host}"
    if request.url.path in ("/health", "/v1/kv/probe"):
        return url, None, httpx.Response(200 if request.url.path == "/health" else 404, json={})
    body = json.loads(request.content)
    calls.append((url, request.url.path, body))
    return url, body, httpx.Response(200, json={}) if request.url.path == "/v1/kv/release" else None
