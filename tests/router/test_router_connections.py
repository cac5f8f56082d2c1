"""The router holds as many requests in flight to a node as clients send: no cap on its upstream connections (httpx's
default of 100 queued the 101st client's request behind the first 100 streams until one ended)."""
from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx

from pdserve.router.app import Router, build_app

N = 120  # more than httpx's default cap


def test_more_than_100_requests_in_flight_to_one_decode_node():
    barrier = threading.Barrier(N, timeout=15)  # every request waits until all N are in at once

    class D(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            try:
                barrier.wait()
                status, body = 200, json.dumps({"choices": [{"text": "ok"}]}).encode()
            except threading.BrokenBarrierError:
                status, body = 500, b'{"error": {"message": "not all in flight", "code": 500}}'
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    class Server(ThreadingHTTPServer):
        request_queue_size = 4 * N  # the listen backlog: all N connect at once

    server = Server(("127.0.0.1", 0), D)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    d_url = f"http://127.0.0.1:{server.server_address[1]}"
    router = Router([d_url], [d_url], "round-robin", health_interval=3600)

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(build_app(router)), base_url="http://router",
                                     timeout=30) as c:
            # a one-token token-id prompt goes straight to D (no P asked)
            rs = await asyncio.gather(*[c.post("/v1/completions", json={"prompt": [5], "max_tokens": 1})
                                        for _ in range(N)])
        await router.client.aclose()
        return rs

    try:
        rs = asyncio.run(main())
    finally:
        server.shutdown()
        server.server_close()
    assert [r.status_code for r in rs] == [200] * N, {r.status_code for r in rs}
