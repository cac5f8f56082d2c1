"""`--pd-first-token prefill`: the client's stream starts with the first token P sampled, then goes on with D's.

P answers a whole (non-streamed) response for its one token; `answer_chunks` renders it as the SSE a node streams
for that token (the chat role first). D's own stream, which holds the same first token (D answers it too, so a
whole answer and vllm-router stay unchanged), passes through a `Splice` that drops what the client already has:
the role chunk, the first token's text (by characters: D's text is a node's stream, so its first characters are
P's; how they are cut into chunks may differ), its logprob entry and token id. What must stay true: the client sees
every character, logprob entry and token id once, in order, and D's finish reason, usage and `[DONE]` as D sent them.
"""
from __future__ import annotations

import json
from typing import Optional

from pdserve.serve.responses import SSE_DONE, sse


def _sse(obj) -> bytes:
    return sse(obj).encode()  # the nodes' own encoding, so spliced chunks read as the node wrote them


def _lp_len(lp) -> int:
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


class FirstToken:
    """What P's answer gave the client: the first token's text, logprob entries and token ids."""

    def __init__(self, answer: dict):
        self.answer = answer
        choice = (answer.get("choices") or [{}])[0]
        self.chat = "message" in choice
        self.text = (choice.get("message") or {}).get("content") or "" if self.chat else choice.get("text") or ""
        self.logprobs = choice.get("logprobs")
        self.token_ids = choice.get("token_ids")
        self.finish_reason = choice.get("finish_reason")
        self.stop_reason = choice.get("stop_reason")

    def chunks(self, final: bool, include_usage: bool) -> bytes:
        """P's answer as stream chunks: the first token's (with the finish reason when it ended the request), then,
        when final, the usage chunk if asked and `[DONE]`."""
        a = self.answer
        head = {"id": a.get("id"), "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": a.get("created"), "model": a.get("model")}
        out = b""
        if self.chat:
            out += _sse({**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                              "logprobs": None, "finish_reason": None}]})
        fr = self.finish_reason if final else None
        if self.text or self.logprobs or self.token_ids or final:
            if self.chat:
                choice = {"index": 0, "delta": {"content": self.text} if self.text or not final else {},
                          "logprobs": self.logprobs, "finish_reason": fr}
            else:
                choice = {"index": 0, "text": self.text, "logprobs": self.logprobs, "finish_reason": fr}
            if final:
                choice["stop_reason"] = self.stop_reason
            if self.token_ids is not None:
                choice["token_ids"] = self.token_ids
            out += _sse({**head, "choices": [choice]})
        if final:
            if include_usage and a.get("usage") is not None:
                out += _sse({**head, "choices": [], "usage": a["usage"]})
            out += SSE_DONE.encode()
        return out


class Splice:
    """D's SSE bytes in, what the client does not have yet out (whole events only)."""

    def __init__(self, first: FirstToken):
        self.chars = len(first.text)
        self.entries = _lp_len(first.logprobs)
        self.ids = len(first.token_ids or ())
        self.buf = b""
        self.sent_tokens = False  # an event past the first token went out (a retry on another D would repeat it)

    def feed(self, data: bytes) -> bytes:
        self.buf += data
        out = b""
        while b"\n\n" in self.buf:
            event, self.buf = self.buf.split(b"\n\n", 1)
            out += self._event(event)
        return out

    def _event(self, event: bytes) -> bytes:
        raw = event.strip()
        if not raw.startswith(b"data:"):
            return event + b"\n\n" if raw else b""
        payload = raw[5:].strip()
        if payload == b"[DONE]":
            return SSE_DONE.encode()
        try:
            obj = json.loads(payload)
        except ValueError:
            return event + b"\n\n"
        choices = obj.get("choices") if isinstance(obj, dict) else None
        if not choices:  # the usage chunk, an error event
            return event + b"\n\n"
        c = choices[0]
        delta: Optional[dict] = c.get("delta")
        if delta is not None and "role" in delta:  # the client has the role from P's chunk
            delta.pop("role")
            if not delta.get("content"):
                delta.pop("content", None)
        text = (delta or {}).get("content") if delta is not None else c.get("text")
        if text:
            cut = min(self.chars, len(text))
            self.chars -= cut
            text = text[cut:]
            if delta is not None:
                if text:
                    delta["content"] = text
                else:
                    delta.pop("content")
            else:
                c["text"] = text
        n = _lp_len(c.get("logprobs"))
        if self.entries and n:
            k = min(self.entries, n)
            self.entries -= k
            c["logprobs"] = _lp_cut(c["logprobs"], k)
        if self.ids and isinstance(c.get("token_ids"), list):
            k = min(self.ids, len(c["token_ids"]))
            self.ids -= k
            c["token_ids"] = c["token_ids"][k:]
        left = bool(text) or _lp_len(c.get("logprobs")) or bool(c.get("token_ids")) or c.get("finish_reason")
        if not left:
            return b""
        self.sent_tokens = True
        return _sse(obj)
