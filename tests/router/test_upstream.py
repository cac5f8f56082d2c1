"""The router's client (router/upstream.py) against real sockets: aiohttp's failures reach the router as the three it
acts on (a refused connection: ConnectFailed, the node down; a close or reset before a whole answer: Reset; no byte
for the timeout: Timeout, never retried as a reset), answers and streams arrive whole and in order, and a stream
closed before its end drops the connection, so the node sees its client go."""
from __future__ import annotations

import asyncio
import socket

import pytest

from pdserve.router.upstream import ConnectFailed, Reset, Timeout, Upstream


def closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


async def read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    return head + await reader.readexactly(length)


def serve(answer):
    """A one-off server on a free loopback port: `answer(reader, writer, n)` handles its n-th request."""
    seen = {"n": 0, "eof": asyncio.Event()}

    async def handle(reader, writer):
        while True:
            try:
                await read_request(reader)
            except (asyncio.IncompleteReadError, ConnectionError):
                seen["eof"].set()
                return
            seen["n"] += 1
            if not await answer(reader, writer, seen["n"]):
                writer.close()
                return
    return handle, seen


async def started(answer):
    handle, seen = serve(answer)
    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", seen


def head(status: int = 200, length=None, kind: str = "application/json") -> bytes:
    size = f"Content-Length: {length}\r\n" if length is not None else "Transfer-Encoding: chunked\r\n"
    return f"HTTP/1.1 {status} X\r\nContent-Type: {kind}\r\n{size}\r\n".encode()


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def run(coro):
    return asyncio.run(coro)


def test_a_refused_connection_is_connect_failed():
    async def go():
        up = Upstream(5.0)
        try:
            with pytest.raises(ConnectFailed):
                await up.request("GET", f"http://127.0.0.1:{closed_port()}/health", timeout=2.0)
            with pytest.raises(ConnectFailed):
                await up.open(f"http://127.0.0.1:{closed_port()}/v1/completions", json={})
        finally:
            await up.aclose()
    run(go())


@pytest.mark.parametrize("how", ["closed before any answer", "body cut short"])
def test_a_node_that_breaks_off_is_a_reset(how):
    async def answer(reader, writer, n):
        if how == "body cut short":
            writer.write(head(200, 100) + b'{"choices": [')
            await writer.drain()
        return False  # close
    async def go():
        server, url, _ = await started(answer)
        up = Upstream(5.0)
        try:
            with pytest.raises(Reset):
                await up.request("POST", url + "/v1/completions", json={"prompt": "x"})
            if how == "closed before any answer":
                with pytest.raises(Reset):
                    await up.open(url + "/v1/completions", json={"prompt": "x"})
            else:
                a = await up.open(url + "/v1/completions", json={"prompt": "x"})
                assert a.status_code == 200
                with pytest.raises(Reset):
                    await a.aread()
                await a.aclose()
        finally:
            await up.aclose()
            server.close()
    run(go())


def test_a_kept_alive_connection_the_node_closed_is_a_reset_then_a_new_one_works():
    async def answer(reader, writer, n):
        if n == 2:
            return False  # the kept-alive connection closed under the second request, unanswered
        writer.write(head(200, 2) + b"{}")
        await writer.drain()
        return True

    async def go():
        server, url, seen = await started(answer)
        up = Upstream(5.0)
        try:
            assert (await up.request("GET", url + "/health")).json() == {}
            with pytest.raises(Reset):  # what the router asks again of the same or another node
                await up.open(url + "/v1/completions", json={})
            assert (await up.request("GET", url + "/health")).status_code == 200  # a fresh connection
        finally:
            await up.aclose()
            server.close()
    run(go())


def test_a_silent_node_is_a_timeout_not_a_reset():
    async def answer(reader, writer, n):
        writer.write(head(200, kind="text/event-stream") + chunk(b"data: 1\n\n"))
        await writer.drain()
        await asyncio.sleep(3)  # then nothing past the client's read timeout
        return False

    async def go():
        server, url, _ = await started(answer)
        up = Upstream(0.3)
        try:
            a = await up.open(url + "/v1/completions", json={})
            got = []
            with pytest.raises(Timeout):
                async for c in a.aiter_raw():
                    got.append(c)
            assert got == [b"data: 1\n\n"]
            await a.aclose()
            with pytest.raises(Timeout):  # a whole answer under the call's own limit
                await up.request("GET", url + "/health", timeout=0.3)
        finally:
            await up.aclose()
            server.close()
    run(go())


def test_a_stream_arrives_in_order_and_closing_it_early_drops_the_connection():
    go_on = asyncio.Event

    async def go():
        more, closed = go_on(), go_on()

        async def answer(reader, writer, n):
            writer.write(head(200, kind="text/event-stream") + chunk(b"data: a\n\n"))
            await writer.drain()
            await more.wait()
            writer.write(chunk(b"data: b\n\n"))
            await writer.drain()
            if await asyncio.wait_for(reader.read(1), 5) == b"":  # the client closed before the end
                closed.set()
            return False

        server, url, seen = await started(answer)
        up = Upstream(5.0)
        try:
            a = await up.open(url + "/v1/completions", json={"prompt": [1, 2]}, headers={"X-Request-Id": "r1"})
            assert a.status_code == 200 and a.headers.get("content-type") == "text/event-stream"
            it = a.aiter_raw()
            assert await it.__anext__() == b"data: a\n\n"
            more.set()
            assert await it.__anext__() == b"data: b\n\n"
            await a.aclose()
            await asyncio.wait_for(closed.wait(), 5)
        finally:
            await up.aclose()
            server.close()
    run(go())
