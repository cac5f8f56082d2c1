"""The direct hand-off on the control channel: D awaits P's params by the router's handoff key, and P answers them
and the KV in one operation, the moment P's engine seals them (serve/handoff.py has the HTTP way it replaces).

1. P's engine finishes a request whose params carry `handoff_key` and posts what it hands over under that key
   (`HandoffBoard.post`): the sealed, signed params, or None and why (its first token ended it, it failed).
2. D's loader sends `await` {key, start, count, wait}; P waits up to `wait` seconds (at most `SLICE`) for the post and
   answers `pending` (D asks again), `none` (with a reason: nothing handed over), `expired` (the lease ended), or
   `ok`: the params as the frame's payload, then the `count` blocks from block `start` as read answers, back to back,
   after which P ends the lease (as a read with `done`).
3. D verifies the params (P's proof, the prompt hash) on its engine thread before the request runs.
What must stay true: an entry is posted once per key and kept `KEEP_SECONDS` whatever happens to it (a D's await
redone on a fresh session gets the same answer); P never holds a D's await longer than one slice, so a D whose
request ended stops asking within a slice.
"""
from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict
from typing import Optional

HANDOFF_KEY = "handoff_key"  # in P's kv_transfer_params (the router's): where its params go besides its answer
AWAIT_KV = "await_kv"  # D's kv_transfer_params: {"host", "port": P's KV endpoint, "key": the handoff key}
SLICE = 0.5  # s: the longest P holds one await before answering `pending`
KEEP_SECONDS = 60.0  # P keeps a post this long
MAX_POSTS = 4096  # P keeps at most this many posts (the oldest go first)
WAIT_SECONDS = 60.0  # D awaits P's post this long in all (as the HTTP hand-off's wait), then prefills itself
_KEY = re.compile(r"[0-9a-f]{32}")


def valid_key(key) -> bool:
    return isinstance(key, str) and _KEY.fullmatch(key) is not None


class HandoffBoard:
    """P: handoff key -> (sealed params or None, why none), posted by the engine thread, read by KV server threads."""

    def __init__(self, keep: float = KEEP_SECONDS, cap: int = MAX_POSTS):
        self.keep, self.cap = keep, cap
        self._posts: OrderedDict[str, tuple[float, Optional[dict], str]] = OrderedDict()
        self._cv = threading.Condition()

    def post(self, key: str, params: Optional[dict], reason: str = "") -> None:
        """The request with `key` ended here: `params` go to the D awaiting it (None: nothing, and why). Once per
        key; a second post is ignored."""
        now = time.monotonic()
        with self._cv:
            while self._posts and (len(self._posts) >= self.cap or next(iter(self._posts.values()))[0] < now -
                                   self.keep):
                self._posts.popitem(last=False)
            if key not in self._posts:
                self._posts[key] = (now, params, reason)
                self._cv.notify_all()

    def wait(self, key: str, timeout: float) -> Optional[tuple[Optional[dict], str]]:
        """(params or None, why none) once posted; None when nothing was posted within `timeout` seconds."""
        until = time.monotonic() + timeout
        with self._cv:
            while key not in self._posts:
                left = until - time.monotonic()
                if left <= 0:
                    return None
                self._cv.wait(left)
            _, params, reason = self._posts[key]
            return params, reason

    def __len__(self) -> int:
        with self._cv:
            return len(self._posts)


def params_payload(params: dict) -> bytes:
    return json.dumps(params, separators=(",", ":")).encode()


def read_params(views: list) -> dict:
    """The params an `ok` answer carried as its payload (authenticated with the frame)."""
    params = json.loads(b"".join(bytes(v) for v in views))
    if not isinstance(params, dict):
        raise ValueError("the producer's hand-off params are not an object")
    return params
