"""`--pd-first-token prefill`: the client's stream starts with the first token P sampled, then goes on with D's.

P answers a whole (non-streamed) response for its one token; `FirstToken.chunks` renders it as the SSE a node
streams for that token (the chat role first). D's own stream, which holds the same first token (D answers it too, so
a whole answer and vllm-router stay unchanged), passes through the `Splice` (router/splice.py) `FirstToken.splice`
makes, which drops what the client already has: the role chunk, the first token's text, its logprob entry and id.
"""
from __future__ import annotations

from pdserve.router.splice import Splice, lp_len, sse_bytes as _sse
from pdserve.serve.responses import SSE_DONE


class FirstToken:
    """What P's answer gave the client: the first token's text, logprob entries and token ids."""

    def __init__(self, answer: dict, show_ids: bool = True):
        self.answer = answer
        self.show_ids = show_ids  # the client asked for token ids (the router may have asked P for them itself)
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
            if self.token_ids is not None and self.show_ids:
                choice["token_ids"] = self.token_ids
            out += _sse({**head, "choices": [choice]})
        if final:
            if include_usage and a.get("usage") is not None:
                out += _sse({**head, "choices": [], "usage": a["usage"]})
            out += SSE_DONE.encode()
        return out

    def splice(self, hold_errors: bool = False) -> Splice:
        """What cuts this token out of a D's stream that repeats it (and keeps the tally of what the client has)."""
        return Splice(len(self.text), lp_len(self.logprobs), self.token_ids, role_sent=True,
                      strip_ids=not self.show_ids, hold_errors=hold_errors)
