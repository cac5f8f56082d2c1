"""CPU per request of the HTTP client libraries a router could use (issue 35: the router's own CPU is on the P/D
TTFT path; `benchmarks/pd_hops.py` splits it per process).

A bare ASGI app under uvicorn (its own process) answers a small JSON body; this process POSTs the body a router
sends P (a 128-token prompt) one request at a time on uvloop, with httpx.AsyncClient (the router's client) and with
aiohttp.ClientSession, alternating, and reports the client process's CPU ms per request (user + system).

    .venv/bin/python benchmarks/http_client_cost.py        # ~10 s
Writes benchmarks/results/http_client_cost.json.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_file import write_result  # noqa: E402

from pdserve.bench.launcher import free_port  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
SERVER = r'''
import sys, uvicorn
async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": b'{"ok": 1}'})
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="error")
'''
BODY = {"model": "m", "prompt": list(range(128)), "max_tokens": 1, "stream": False}


def cpu() -> float:
    t = os.times()
    return t.user + t.system


async def with_httpx(url: str, n: int) -> float:
    async with httpx.AsyncClient() as c:
        for _ in range(20):  # the connection and the libraries warmed up
            (await c.post(url, json=BODY)).json()
        t0 = cpu()
        for _ in range(n):
            (await c.post(url, json=BODY)).json()
        return (cpu() - t0) / n * 1e3


async def with_aiohttp(url: str, n: int) -> float:
    async with aiohttp.ClientSession() as c:
        for _ in range(20):
            async with c.post(url, json=BODY) as r:
                await r.json()
        t0 = cpu()
        for _ in range(n):
            async with c.post(url, json=BODY) as r:
                await r.json()
        return (cpu() - t0) / n * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=500, help="Requests per client and round (default: 500).")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "http_client_cost.json"))
    args = ap.parse_args()
    import uvloop
    port = free_port()
    server = subprocess.Popen([sys.executable, "-c", SERVER, str(port)])
    url = f"http://127.0.0.1:{port}/"
    res: dict[str, list[float]] = {"httpx": [], "aiohttp": []}
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.post(url, json=BODY)
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline, "the ASGI server did not start"
                time.sleep(0.1)
        for r in range(args.rounds):
            for name in (("httpx", "aiohttp") if r % 2 == 0 else ("aiohttp", "httpx")):
                fn = with_httpx if name == "httpx" else with_aiohttp
                res[name].append(uvloop.run(fn(url, args.requests)))
    finally:
        server.terminate()
        server.wait(10)
    summary = {k: statistics.median(v) for k, v in res.items()}
    for k, v in summary.items():
        print(f"{k:>8}: {v:.3f} ms of CPU per request (median of {args.rounds} rounds)")
    write_result(args.out, args, cpu_ms_per_request=summary, rounds=res, httpx=httpx.__version__,
                 aiohttp=aiohttp.__version__)
    return 0


if __name__ == "__main__":
    sys.exit(main())
