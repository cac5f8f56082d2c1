"""The router's view of its nodes: which are healthy, how loaded, and which P/D pairs can hand KV over.

Invariants:
- a node is out of rotation from a failed /health (or a refused connection, `Router.handle`) until it answers
  /health again; a P that went down and came back loses its P/D refusal hold (it may have been fixed);
- a (P, D) pair is out of rotation only on a definite mismatch (D answers 409 to P's probe, or D says a proof did
  not verify), never on a timeout or a 5xx, and goes back in as soon as a probe verifies;
- with no D to take a request, a healthy P serves it whole (`fallback`; every node can decode) unless the router
  was started with --no-prefill-fallback: a D down or stalled is never a client error while a P is up.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
from dataclasses import dataclass, field
from typing import Callable, Optional

from pdserve.router.upstream import Answer, Upstream, UpstreamError

logger = logging.getLogger("pdserve.router")


@dataclass
class Node:
    url: str
    healthy: bool = True
    in_flight: int = 0
    refused_pd_until: float = 0.0  # monotonic time: a P whose P/D set-up refused a prefill, tried last until then


@dataclass
class Pool:
    nodes: list[Node]
    policy: str
    _rr: itertools.count = field(default_factory=itertools.count)

    def pick(self, exclude: tuple = ()) -> Optional[Node]:
        live = [n for n in self.nodes if n.healthy and n not in exclude]
        if not live:
            return None
        i = next(self._rr) % len(live)
        if self.policy == "least-loaded":  # ties in turn, or a lightly loaded pool would send all to the first
            return min(live[i:] + live[:i], key=lambda n: n.in_flight)
        return live[i]


class Fleet:
    """The prefill and decode pools, their health loop and the pairs P's proofs fail on. `client` is the router's
    one HTTP client (tests swap it for a mock transport)."""

    def __init__(self, prefill: list[str], decode: list[str], policy: str, health_interval: float, timeout: float,
                 prefill_fallback: bool = True):
        self.prefill_fallback = prefill_fallback  # with no D left, a P serves the request whole (`fallback`)
        self.on_fallback: Callable[[], None] = lambda: None  # counts a request a P serves whole for want of a D
        self._falling_back = False  # logged once per spell without a D
        self.prefill = Pool([Node(u.rstrip("/")) for u in prefill], policy)
        self.decode = Pool([Node(u.rstrip("/")) for u in decode], policy)
        self.bad_pairs: dict[tuple[str, str], str] = {}  # (P url, D url) -> why P's proofs fail on that D
        self.health_interval = health_interval
        self.client = Upstream(timeout)

    async def health_loop(self) -> None:
        while True:
            for node in self.prefill.nodes + self.decode.nodes:
                try:
                    r = await self.client.request("GET", node.url + "/health", timeout=2.0)
                    ok = r.status_code == 200
                except UpstreamError:
                    ok = False
                if ok != node.healthy:
                    logger.warning("node %s is %s", node.url, "back" if ok else "down: taken out of rotation")
                    node.refused_pd_until = 0.0  # back from a restart, perhaps with its P/D set-up fixed
                node.healthy = ok
            if self._falling_back and any(n.healthy for n in self.decode.nodes):
                self._falling_back = False
                logger.warning("a decode node is back: requests are served P/D again")
            await self.probe_pairs()
            await asyncio.sleep(self.health_interval)

    async def probe_pairs(self) -> None:
        """Each healthy P's probe to each healthy D: a pair where P's proofs would not verify (D answers 409) goes out
        of rotation. Any other answer (a node without the route, a 5xx) leaves the pair as it was: only a definite
        mismatch takes a pair out, and traffic finds the rest (`_refused`)."""
        for p in (n for n in self.prefill.nodes if n.healthy):
            try:
                r = await self.client.request("GET", p.url + "/v1/kv/probe", timeout=2.0)
                probe = r.json().get("probe") if r.status_code == 200 else None
            except (UpstreamError, ValueError, AttributeError):
                probe = None
            if probe is None:
                continue
            for d in (n for n in self.decode.nodes if n.healthy):
                try:
                    r = await self.client.request("POST", d.url + "/v1/kv/probe", json={"probe": probe}, timeout=2.0)
                except UpstreamError:
                    continue
                if r.status_code in (200, 409):
                    self.mark_pair(p, d, None if r.status_code == 200 else f"probe failed: {message_of(r)}")

    def mark_pair(self, p: Node, d: Node, why: Optional[str]) -> None:
        key = (p.url, d.url)
        if why is None and key in self.bad_pairs:
            del self.bad_pairs[key]
            logger.warning("prefill node %s -> decode node %s: P's KV proofs verify on D again; back in rotation",
                           p.url, d.url)
        elif why is not None and self.bad_pairs.get(key) is None:
            logger.error("prefill node %s -> decode node %s taken out of rotation: %s", p.url, d.url, why)
        if why is not None:
            self.bad_pairs[key] = why

    def decode_for(self, p: Optional[Node], tried: tuple = ()) -> Optional[Node]:
        bad = () if p is None else tuple(d for d in self.decode.nodes if (p.url, d.url) in self.bad_pairs)
        return self.decode.pick(bad + tried)

    def fallback(self, tried: tuple = (), prefer: Optional[Node] = None) -> Optional[Node]:
        """A P to serve a request whole when no D is left to take it (`prefer`, the P that prefilled it and holds its
        prompt in its prefix cache, first), or None (none left, or --no-prefill-fallback)."""
        if not self.prefill_fallback:
            return None
        node = prefer if prefer is not None and prefer.healthy and prefer not in tried else self.prefill.pick(tried)
        if node is not None:
            self.on_fallback()
            if not self._falling_back:
                self._falling_back = True
                logger.warning("no healthy decode node: prefill nodes serve requests whole (collocated) until one is "
                               "back (--no-prefill-fallback answers 503 instead)")
        return node

    def can_serve(self) -> bool:
        """Whether a request can be served at all: a healthy D, or a healthy P to fall back on."""
        return any(n.healthy for n in self.decode.nodes) or \
            self.prefill_fallback and any(n.healthy for n in self.prefill.nodes)

    def no_pair(self) -> Optional[str]:
        """Why no request can be served, when every healthy P's proofs fail on every healthy D (a deployment error:
        the KV tokens differ)."""
        live_p = [p for p in self.prefill.nodes if p.healthy]
        if not live_p or any(p not in self.prefill_exclusions() for p in live_p):
            return None
        pairs = [f"{p.url} -> {d.url}: {why}" for (p_url, d_url), why in self.bad_pairs.items()
                 for p in live_p for d in self.decode.nodes if p.url == p_url and d.url == d_url and d.healthy]
        return "no prefill/decode pair can hand KV over (KV token mismatch): " + "; ".join(pairs)

    def prefill_exclusions(self) -> tuple:
        """Ps with no healthy D their proofs verify on: a prefill there could only hold a lease."""
        live = [d for d in self.decode.nodes if d.healthy]
        return tuple(p for p in self.prefill.nodes if all((p.url, d.url) in self.bad_pairs for d in live))


def message_of(r: Answer) -> str:
    return error_of(r)[0]


def error_of(r: Answer) -> tuple[str, Optional[str]]:
    """(message, param) of an OpenAI-shaped error answer."""
    try:
        err = r.json()["error"]
        return str(err["message"]), err.get("param")
    except (ValueError, KeyError, TypeError, AttributeError):
        return f"HTTP {r.status_code}", None

