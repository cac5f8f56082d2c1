"""Early decode (`--pd-early-decode`, with `--pd-first-token prefill`): a streamed request's D is asked
when its P is, not after P answers (serve/handoff.py has the nodes' half and the numbered flow).

Each P the router tries gets its own handoff key, and a D the P's proofs verify on is opened with `await_prefill` on
that P and key; a P tried again elsewhere drops the D opened for it. When P answers with params, the open D becomes
the stream's `Attempt` (`pending`), relayed after P's token by router/migration.py; should it fail before its first
byte (refused, reset, any answer but 200, e.g. its wait for P's params ran out), the request goes to a D the usual
way with P's params. When P's answer is all of it (its token ended the request), P failed, or the client left, the
open D is dropped: its connection closes and D abandons the request, whatever point it reached.
"""
from __future__ import annotations

import asyncio
import uuid
from typing import Optional

from pdserve.router.migration import Attempt, drop_open, in_background
from pdserve.router.nodes import Fleet, Node

class EarlyDecode:
    def __init__(self, fleet: Fleet, path: str, body: dict, headers: dict, ask_ids: bool, outcomes=None):
        self.fleet, self.path, self.body, self.headers, self.ask_ids = fleet, path, body, headers, ask_ids
        self.outcomes = outcomes  # pdserve_router_early_decode_total{outcome}: dropped counted here
        self.node: Optional[Node] = None
        self.task: Optional[asyncio.Future] = None

    def launch(self, p: Node) -> Optional[str]:
        """Before P `p` is asked: a D opened to wait for its params; the handoff key P gets (None: no D to ask)."""
        self.drop()
        d = self.fleet.decode_for(p)
        if d is None:
            return None
        key = uuid.uuid4().hex
        d_body = {**self.body, "kv_transfer_params": {"await_prefill": {"url": p.url, "key": key}}}
        if self.ask_ids:
            d_body["return_token_ids"] = True
        d.in_flight += 1
        self.node = d
        self.task = asyncio.ensure_future(self.fleet.client.open(d.url + self.path, json=d_body,
                                                                  headers=self.headers))
        return key

    def attempt(self) -> Attempt:
        """The open D as the stream's attempt (handed over: no longer this object's to drop)."""
        if self.task is None:
            return Attempt()
        out = Attempt(self.node)
        out.pending, self.task, self.node = self.task, None, None
        return out

    def drop(self) -> None:
        """In the background: the client's answer does not wait for D's connection to close."""
        if self.task is not None:
            if self.outcomes is not None:
                self.outcomes.labels("dropped").inc()
            in_background(drop_open(self.task, self.node))
            self.task, self.node = None, None
