"""What the client already has of a stream, and a node's SSE with that cut out.

A stream can pass through several nodes: P's first token (`--pd-first-token prefill`), then a D, then, when that D
breaks off mid-stream, another node that resumes it (`--max-migrations`). Each later node's stream starts over
with what the client has: the chat role, the text of the tokens it resumes from, their token ids (and, after P's
first token, its logprob entry). `Splice` cuts those out, by characters for the text (a node's text is a stream's,
so its first characters are what the client has, however it cuts them into chunks), and keeps the tally the next
resume needs: every token id and character that went out. What must stay true: the client sees every character,
logprob entry and token id once, in order, and the last node's finish reason, usage and `[DONE]` as it sent them.

Token ids: the router asks each node for them (`return_token_ids`) so a resume knows where the stream stands; a
client that did not ask gets chunks without them (`strip_ids`).
"""
from __future__ import annotations

import json
from typing import Optional

from pdserve.serve.responses import SSE_DONE, sse


def sse_bytes(obj) -> bytes:
    return sse(obj).encode()  # the nodes' own encoding, so spliced chunks read as the node wrote them


def lp_len(lp) -> int:
    if not isinstance(lp, dict):
        return 0
    return len(lp.get("content") or ()) if "content" in lp else len(lp.get("tokens") or ())


def _lp_cut(lp, k: int):
    """Logprobs (chat's content list, or completions' parallel lists) without their first k entries."""
    if not isinstance(lp, dict) or k <= 0:
        return lp
    if "content" in lp:
        return {**lp, "content": (lp.get("content") or [])[k:]}
    return {key: (v[k:] if isinstance(v, list) else v) for key, v in lp.items()}


class Splice:
    """A node's SSE bytes in, what the client does not have yet out (whole events only)."""

    def __init__(self, chars: int = 0, entries: int = 0, ids: Optional[list[int]] = None, role_sent: bool = False,
                 strip_ids: bool = False, hold_errors: bool = False):
        # what the node in front repeats of what the client has: cut from its stream
        self.skip_chars, self.skip_entries = chars, entries
        self.skip_ids = len(ids or ())
        self.drop_role = role_sent
        # what the client has
        self.chars = chars
        self.token_ids: list[int] = list(ids or ())
        self.strip_ids = strip_ids  # the client did not ask for token ids: the router did
        self.hold_errors = hold_errors  # a node's 5xx error event is kept back (`failed`): the stream can resume
        self.buf = b""
        self.sent_tokens = False  # an event past what is skipped went out (a node tried again would repeat it)
        self.finished = False  # a finish reason went out: the stream is over but for usage and [DONE]
        self.done = False  # [DONE] went out
        self.failed: Optional[str] = None  # the node's error event, held back
        self.untracked = bool(chars) and ids is None  # text went out whose token ids are not known: no resume

    def resume(self) -> None:
        """The next node repeats all the client has (the resumed tokens' text and ids; no logprob entries, which
        only the sampling node had): cut that from its stream."""
        self.skip_chars, self.skip_entries, self.skip_ids = self.chars, 0, len(self.token_ids)
        self.drop_role = True
        self.buf, self.failed = b"", None

    def feed(self, data: bytes) -> bytes:
        self.buf += data
        out = b""
        while b"\n\n" in self.buf and self.failed is None:
            event, self.buf = self.buf.split(b"\n\n", 1)
            out += self._event(event)
        return out

    def _event(self, event: bytes) -> bytes:
        raw = event.strip()
        if not raw.startswith(b"data:"):
            return event + b"\n\n" if raw else b""
        payload = raw[5:].strip()
        if payload == b"[DONE]":
            self.done = True
            return SSE_DONE.encode()
        try:
            obj = json.loads(payload)
        except ValueError:
            return event + b"\n\n"
        if not isinstance(obj, dict):
            return event + b"\n\n"
        err = obj.get("error")
        if self.hold_errors and isinstance(err, dict) and isinstance(err.get("code"), int) and err["code"] >= 500:
            self.failed = str(err.get("message") or "the node failed the request")
            return b""
        choices = obj.get("choices")
        changed = self.strip_ids and obj.pop("prompt_token_ids", None) is not None
        if not choices:  # the usage chunk, an error event
            return sse_bytes(obj) if changed else event + b"\n\n"
        c = choices[0]
        changed |= self.strip_ids and c.pop("prompt_token_ids", None) is not None
        delta: Optional[dict] = c.get("delta")
        if delta is not None and "role" in delta and self.drop_role:  # the client has the role already
            delta.pop("role")
            if not delta.get("content"):
                delta.pop("content", None)
            changed = True
        elif delta is not None and "role" in delta:
            self.drop_role = True
        text = (delta or {}).get("content") if delta is not None else c.get("text")
        if text and not isinstance(c.get("token_ids"), list):
            self.untracked = True
        if text and self.skip_chars:
            cut = min(self.skip_chars, len(text))
            self.skip_chars -= cut
            text = text[cut:]
            if delta is not None:
                if text:
                    delta["content"] = text
                else:
                    delta.pop("content")
            else:
                c["text"] = text
            changed = True
        self.chars += len(text or "")
        n = lp_len(c.get("logprobs"))
        if self.skip_entries and n:
            k = min(self.skip_entries, n)
            self.skip_entries -= k
            c["logprobs"] = _lp_cut(c["logprobs"], k)
            changed = True
        ids = c.get("token_ids")
        if isinstance(ids, list):
            k = min(self.skip_ids, len(ids))
            self.skip_ids -= k
            ids = ids[k:]
            self.token_ids += ids
            if self.strip_ids:
                del c["token_ids"]
            else:
                c["token_ids"] = ids
            changed |= self.strip_ids or k > 0
        tokens = bool(text) or lp_len(c.get("logprobs")) or bool(ids) or c.get("finish_reason")
        if not tokens and "role" not in (delta or {}):
            return b""  # nothing the client does not have (or ids it did not ask for)
        self.finished = self.finished or bool(c.get("finish_reason"))
        self.sent_tokens = self.sent_tokens or bool(tokens)
        return sse_bytes(obj) if changed else event + b"\n\n"
