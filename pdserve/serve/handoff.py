"""Early decode (`pdserve router --pd-first-token prefill --pd-early-decode`): D takes the request while P still
prefills it, and P hands D its params itself the moment they exist, so the router's hop, D's request translation and
its wire are off the path from P's first token to D's first.

1. The router makes a handoff key (32 hex digits, random) and sends P the request with `kv_transfer_params.
   handoff_key` and, at the same time, D the client's request with `kv_transfer_params = {"await_prefill": {"url":
   P's URL, "key": ...}}`.
2. D translates it (template, tokenizer, checks) and asks P `GET /v1/kv/handoff/{key}` with `X-PD-Handoff-Proof`,
   an HMAC of the key with the KV token, so only a holder of the deployment's KV token is answered. D dials only a
   host of its `kv_peers` (loopback when it has none), the rule its KV transfers follow.
3. P's serving layer answers that call as soon as its engine's last record for the request is in (before P's own
   HTTP answer is built): `{"kv_transfer_params": {...}}`, P's signed params, or `{"kv_transfer_params": null,
   "reason": ...}` when P hands nothing over (its token ended the request, or it failed or was refused).
4. D goes on as if the router had sent it those params (the engine checks P's proof and the prompt hash as
   always), its arrival being when they came; with none it answers 409, and the router, which has P's answer by
   then, takes the usual way (router/app.py).
What must stay true: P resolves every key it registered, whatever way its request ends (`Handoffs.resolve` in a
`finally`), and an entry nobody takes is dropped after `KEEP_SECONDS`; D's wait ends when its client goes away.
"""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import time
from typing import Optional
from urllib.parse import urlsplit

from pdserve.kv_transfer_config import LOOPBACK
from pdserve.transfer.channel.handoffs import HANDOFF_KEY, valid_key  # noqa: F401  (re-exported)

AWAIT_PREFILL = "await_prefill"  # D's kv_transfer_params: {"url": P's URL, "key": the handoff key}
PROOF_HEADER = "X-PD-Handoff-Proof"
WAIT_SECONDS = 60.0  # D waits this long for P's params (P's queue included), then answers 409
KEEP_SECONDS = 60.0  # P keeps params no D has taken this long
MAX_WAITING = 4096  # keys D asks for that P has not seen: more is refused (503), so no client fills P's memory
_LABEL = b"pdserve handoff v1\0"


def handoff_proof(kv_token: str, key: str) -> str:
    return hmac.new(kv_token.encode(), _LABEL + key.encode(), hashlib.sha256).hexdigest()


class Handoffs:
    """P: handoff key -> the params its request ended with, for the one D that asks (event loop only)."""

    def __init__(self):
        self._entries: dict[str, asyncio.Future] = {}
        self._resolved_at: dict[str, float] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def _entry(self, key: str) -> asyncio.Future:
        fut = self._entries.get(key)
        if fut is None:
            fut = self._entries[key] = asyncio.get_running_loop().create_future()
        return fut

    def _sweep(self) -> None:
        old = time.monotonic() - KEEP_SECONDS
        for key in [k for k, t in self._resolved_at.items() if t < old]:
            self._resolved_at.pop(key)
            self._entries.pop(key, None)

    def register(self, key: str) -> None:
        """P took a request with this key: a D asking from now on waits for its end."""
        self._sweep()
        self._entry(key)

    def resolve(self, key: str, params: Optional[dict], reason: str = "") -> None:
        """The request's end: its params (None: nothing handed over, and why). Later calls change nothing."""
        fut = self._entry(key)
        if not fut.done():
            fut.set_result((params, reason))
            self._resolved_at[key] = time.monotonic()

    async def take(self, key: str, timeout: float = WAIT_SECONDS) -> tuple[Optional[dict], str]:
        """(params or None, reason) once the request with this key ended; LookupError when too many keys are
        awaited that P never saw; TimeoutError past `timeout`."""
        if key not in self._entries and len(self._entries) - len(self._resolved_at) >= MAX_WAITING:
            self._sweep()
            raise LookupError(f"more than {MAX_WAITING} handoff keys are awaited here")
        fut = self._entry(key)
        try:
            return await asyncio.wait_for(asyncio.shield(fut), timeout)
        finally:  # one taker: gone once answered, timed out or abandoned
            self._entries.pop(key, None)
            self._resolved_at.pop(key, None)


class KVEndpoints:
    """D: each P's KV endpoint by its URL, learnt from the params P handed over through `GET /v1/kv/handoff`, so
    later requests' engines await P's params on P's KV channel itself (channel/handoffs.py) instead. An endpoint is
    used for `TTL` seconds, then learnt again the HTTP way: a P restarted on other ports is found within that
    (meanwhile its requests' awaits fail to connect and are prefilled here). Event loop only."""
    TTL = 30.0

    def __init__(self):
        self._by_url: dict[str, tuple[str, int, float]] = {}

    def learn(self, url: str, params: dict) -> None:
        host, port = params.get("remote_host"), params.get("remote_port")
        if params.get("kv_connector", "TcpConnector") == "TcpConnector" and isinstance(host, str) and \
                isinstance(port, int) and not isinstance(port, bool):
            self._by_url[url] = (host, port, time.monotonic() + self.TTL)

    def get(self, url: str) -> Optional[tuple[str, int]]:
        got = self._by_url.get(url)
        if got is None or got[2] < time.monotonic():
            self._by_url.pop(url, None)
            return None
        return got[0], got[1]


def dialable(url: str, peer_hosts: frozenset) -> Optional[str]:
    """None when D may ask `url` for params (an http(s) URL on a host of its kv_peers, or on loopback when it has
    none), else why not."""
    try:
        parts = urlsplit(url)
        host = parts.hostname
        parts.port  # noqa: B018 (a bad port raises here)
    except (ValueError, TypeError):
        return f"{url!r} is not a URL"
    if parts.scheme not in ("http", "https") or not host:
        return f"{url!r} is not an http(s) URL"
    if peer_hosts:
        return None if host in peer_hosts else f"host {host} is none of this node's kv_peers"
    return None if host in LOOPBACK else f"host {host} is not loopback, and this node has no kv_peers naming it"


class ParamsClient:
    """D: asks P for a handoff's params (one aiohttp session, made on first use in the running loop)."""

    def __init__(self, kv_token: str):
        self.kv_token = kv_token
        self._session = None

    async def fetch(self, url: str, key: str) -> tuple[Optional[dict], str]:
        """(P's params or None, why none)."""
        import aiohttp
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=5.0),
                timeout=aiohttp.ClientTimeout(total=WAIT_SECONDS + 5.0, sock_connect=5.0))
        try:
            async with self._session.get(f"{url.rstrip('/')}/v1/kv/handoff/{key}",
                                         headers={PROOF_HEADER: handoff_proof(self.kv_token, key)}) as r:
                if r.status != 200:
                    return None, f"the prefill node answered {r.status}: {(await r.text())[:200]}"
                data = await r.json()
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ValueError) as e:
            return None, f"the prefill node did not answer: {type(e).__name__}: {e}"
        params = data.get("kv_transfer_params") if isinstance(data, dict) else None
        if not isinstance(params, dict):
            return None, str(data.get("reason") or "nothing to hand over") if isinstance(data, dict) else "no answer"
        return params, ""

    async def aclose(self) -> None:
        if self._session is not None:
            session, self._session = self._session, None
            await session.close()
