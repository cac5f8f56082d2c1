"""The router's HTTP client to its nodes: aiohttp, behind the few calls the router makes, with its failures sorted
into the three the router acts on.

aiohttp, not httpx: a router request makes two upstream calls (P, then D's stream) on the P/D first-token path, and
`benchmarks/http_client_cost.py` measured httpx at 0.66 ms of CPU per POST against aiohttp's 0.16 on this machine.

What the router must be able to tell apart (router/app.py, router/migration.py):
- `ConnectFailed`: nothing reached the node (refused, unreachable): it is down, out of rotation;
- `Reset`: the node closed or reset the connection, or broke HTTP, before a whole answer: before any answer it is safe
  to ask again (a kept-alive connection the node had closed), during a body it is a node that broke off;
- `Timeout`: no byte for --timeout seconds (or the call's own limit): the node may still be working on it, so it
  is never retried as a reset is.
Every failure is an `UpstreamError` whose text names what happened (aiohttp's often have none of their own).
"""
from __future__ import annotations

import asyncio
import json as _json
from typing import AsyncIterator, Awaitable, Callable, Optional

import aiohttp

CONNECT_TIMEOUT = 5.0  # s to open a connection to a node


class UpstreamError(Exception):
    """A node's answer did not come, or not whole."""


class ConnectFailed(UpstreamError):
    pass


class Reset(UpstreamError):
    pass


class Timeout(UpstreamError):
    pass


def describe(e: BaseException) -> str:
    """An exception's type and text (resets and timeouts often have no text)."""
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


def upstream_error(e: BaseException) -> UpstreamError:
    """aiohttp's (or the socket's) exception as one of ours, its type and text in the message."""
    what = describe(e)
    if isinstance(e, aiohttp.ClientConnectorError):  # before ClientOSError, its base: no connection was made
        return ConnectFailed(what)
    if isinstance(e, (asyncio.TimeoutError, TimeoutError)):  # aiohttp's socket timeouts are TimeoutErrors too
        return Timeout(what)
    if isinstance(e, (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError, aiohttp.ClientPayloadError,
                      aiohttp.ClientResponseError, ConnectionError)):
        return Reset(what)
    return UpstreamError(what)


class Answer:
    """A node's answer: its status and headers, and either its whole body (`content`) or, for one opened as a
    stream, the body still to read (`aiter_raw`, `aread`) until `aclose`, which drops the connection if the body
    was not read to its end (so the node sees the client go)."""

    def __init__(self, status_code: int, headers, content: Optional[bytes] = None,
                 chunks: Optional[AsyncIterator[bytes]] = None, close: Optional[Callable[[], Awaitable[None]]] = None):
        self.status_code, self.headers, self.content = status_code, headers, content
        self._chunks, self._close = chunks, close

    def json(self):
        return _json.loads(self.content)

    @property
    def text(self) -> str:
        return (self.content or b"").decode(errors="replace")

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        """The body still to read (nothing once read)."""
        chunks, self._chunks = self._chunks, None
        if chunks is not None:
            async for chunk in chunks:
                yield chunk

    async def aread(self) -> bytes:
        if self._chunks is not None:
            self.content = b"".join([c async for c in self.aiter_raw()])
        return self.content or b""

    async def aclose(self) -> None:
        if self._close is not None:
            close, self._close = self._close, None
            await close()


class Upstream:
    """One aiohttp session for all nodes, made on first use (it belongs to the running event loop). No cap on
    connections: each in-flight stream holds one, and a cap would queue the next client behind them. Idle ones close
    after 5 s, before a node's keep-alive (30 s) could close one under a request being written (a reset before any
    answer is asked again anyway: app.py)."""

    def __init__(self, timeout: float):
        self.timeout = aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT, sock_read=timeout)
        self._session: Optional[aiohttp.ClientSession] = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=5.0),  # names resolved again after 10 s
                timeout=self.timeout, auto_decompress=False)  # a stream is relayed as the node sent it
        return self._session

    async def request(self, method: str, url: str, *, json=None, content: Optional[bytes] = None,
                      headers: Optional[dict] = None, timeout: Optional[float] = None) -> Answer:
        """The node's whole answer; `timeout`: seconds for all of it (default: --timeout between bytes)."""
        limit = {} if timeout is None else \
            {"timeout": aiohttp.ClientTimeout(total=timeout, sock_connect=min(timeout, CONNECT_TIMEOUT))}
        try:
            async with self._client().request(method, url, data=_body(json, content), headers=_headers(json, headers),
                                              **limit) as r:
                return Answer(r.status, r.headers, await r.read())
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as e:
            raise upstream_error(e) from e

    async def open(self, url: str, *, json, headers: Optional[dict] = None) -> Answer:
        """POST `json` and return the answer once its headers are in, its body to be read (`Answer.aiter_raw`)."""
        try:
            r = await self._client().post(url, data=_body(json, None), headers=_headers(json, headers))
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as e:
            raise upstream_error(e) from e

        async def chunks() -> AsyncIterator[bytes]:
            try:
                async for chunk in r.content.iter_any():
                    yield chunk
            except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as e:
                raise upstream_error(e) from e

        async def close() -> None:
            r.release()  # back to the pool if read to its end, else closed (the node sees its client go)

        return Answer(r.status, r.headers, chunks=chunks(), close=close)

    async def aclose(self) -> None:
        if self._session is not None:
            session, self._session = self._session, None
            await session.close()


def _body(json, content: Optional[bytes]) -> Optional[bytes]:
    return _json.dumps(json).encode() if json is not None else content


def _headers(json, headers: Optional[dict]) -> Optional[dict]:
    return {**(headers or {}), "Content-Type": "application/json"} if json is not None else headers
