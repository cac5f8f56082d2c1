"""OpenAI response bodies and stream chunks for completions and chat completions, built from engine records."""
from __future__ import annotations

import json
from typing import Optional

from pdserve.serve.engine_messages import TokenRecord
from pdserve.serve.protocol import GenerationRequest


def dumps(obj) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def sse(obj) -> str:
    return f"data: {dumps(obj)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def usage(n_prompt: int, n_out: int, n_cached: int = 0) -> dict:
    u = {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}
    if n_cached:
        u["prompt_tokens_details"] = {"cached_tokens": n_cached}
    return u


_MIN_LOGPROB = -9999.0  # vLLM's stand-in for -inf: JSON has no infinity


def _tok(s: Optional[str]) -> str:
    return s if s is not None else ""


def completion_logprobs(entries: list, offset: int) -> tuple[dict, int]:
    """OpenAI's legacy completions shape: tokens, token_logprobs, top_logprobs, text_offset (an echoed prompt's
    first token has no logprob: null in both)."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for entry in entries:
        tok_id, lp, _rank, text = entry[0]
        text = _tok(text)
        out["tokens"].append(text)
        out["token_logprobs"].append(lp if lp is None else max(lp, _MIN_LOGPROB))
        out["top_logprobs"].append(None if lp is None else {_tok(t): max(v, _MIN_LOGPROB) for _, v, _, t in entry})
        out["text_offset"].append(offset)
        offset += len(text)
    return out, offset


def prompt_logprobs_json(entries: list) -> list:
    """vLLM's `prompt_logprobs`: null for the first prompt token, then {token id: {logprob, rank, decoded_token}}
    (-inf as -9999.0, as vLLM's: JSON has no infinity)."""
    return [None if e is None else {str(t): {"logprob": max(v, _MIN_LOGPROB), "rank": r, "decoded_token": s}
                                    for t, v, r, s in e} for e in entries]


def chat_logprobs(entries: list, top_n: int, as_ids: bool = False) -> dict:
    """OpenAI's chat shape; `as_ids`: vLLM's return_tokens_as_token_ids (the chosen token's bytes stay its text's,
    as vLLM's)."""
    content = []
    for entry in entries:
        tok, lp, _, text = entry[0]
        text = _tok(text)
        top = sorted(entry, key=lambda r: r[2])[:top_n]
        if as_ids:
            top = [(t, v, r, f"token_id:{t}") for t, v, r, _ in top]
        content.append({"token": f"token_id:{tok}" if as_ids else text, "logprob": max(lp, _MIN_LOGPROB),
                        "bytes": list(text.encode()),
                        "top_logprobs": [{"token": _tok(t), "logprob": max(v, _MIN_LOGPROB),
                                          "bytes": list(_tok(t).encode())} for _, v, _, t in top]})
    return {"content": content}


class ResponseBuilder:
    """Accumulates a request's records; renders the full response or the stream chunks. With n > 1 or a batch of
    prompts there is one builder per choice (`index`), all sharing `siblings` (every choice's builder, in order),
    which the usage and the full response cover."""

    def __init__(self, greq: GenerationRequest, response_id: str, created: int, index: int = 0,
                 siblings: Optional[list["ResponseBuilder"]] = None):
        self.g = greq
        self.index = index
        self.siblings = siblings if siblings is not None else [self]
        self.id = response_id
        self.created = created
        self.object = "text_completion" if greq.kind == "completion" else "chat.completion"
        self.chunk_object = "text_completion" if greq.kind == "completion" else "chat.completion.chunk"
        self.text_parts: list[str] = []
        self.token_ids: list[int] = []
        self.logprob_entries: list = []
        self.finish_reason: Optional[str] = None
        self.stop_reason = None
        self.num_cached = 0
        self.error: Optional[str] = None
        self.kv_transfer_params: Optional[dict] = None
        self.rejected = False
        self.error_status: Optional[int] = None
        self.timing: Optional[dict] = None  # the engine's TTFT split, from the first token's record
        self.kv_unused = False
        self.prompt_lps: Optional[list] = None  # with the first token, when asked (TokenRecord.prompt_logprobs)
        self._offset = 0
        self._had_tokens = False
        self._role_sent = False
        # completions echo with logprobs: the echo waits for the prompt's logprobs, which lead the first chunk's
        self._echo_waits = greq.prompt_first_text is not None

    def add(self, rec: TokenRecord) -> None:
        if not self._had_tokens:  # the timing that came with the first token (not that of D's own first step)
            self.timing, self._had_tokens = rec.timing, bool(rec.new_token_ids)
        if not self.g.echo_only:
            self.text_parts.append(rec.delta_text)
            self.token_ids.extend(rec.new_token_ids)
            if rec.logprobs:
                self.logprob_entries.extend(rec.logprobs)
        self.num_cached = rec.num_cached_tokens or self.num_cached
        self.kv_unused = self.kv_unused or rec.kv_unused
        if rec.prompt_logprobs is not None:
            self.prompt_lps = rec.prompt_logprobs
        if rec.finished:
            self.finish_reason, self.stop_reason, self.error = rec.finish_reason, rec.stop_reason, rec.error
            self.kv_transfer_params = rec.kv_transfer_params
            self.rejected = rec.rejected
            self.error_status = rec.error_status

    def usage(self) -> dict:
        """Each prompt once, every choice's tokens (as vLLM's for n > 1 and batches); the cached tokens of a prompt
        are its choices' most (its children share its blocks), summed over the prompts."""
        cached: dict[int, int] = {}
        for b in self.siblings:
            cached[id(b.g)] = max(cached.get(id(b.g), 0), b.num_cached)
        prompts = {id(b.g): len(b.g.prompt_token_ids) for b in self.siblings}
        return usage(sum(prompts.values()), sum(len(b.token_ids) for b in self.siblings),
                     sum(cached.values()) if self.g.report_cached else 0)

    def _logprobs(self, entries: list):
        if self.g.params.logprobs is None:
            return None
        if self.g.kind == "chat":
            return chat_logprobs(entries, self.g.params.logprobs, self.g.tokens_as_ids)
        if self.g.tokens_as_ids:  # vLLM's placeholders, which the text offsets then count too
            entries = [[(t, v, r, f"token_id:{t}") for t, v, r, _ in e] for e in entries]
        lp, self._offset = completion_logprobs(entries, self._offset)
        return lp

    # -------------------------------------------------------------- full response

    def full(self) -> dict:
        body = {"id": self.id, "object": self.object, "created": self.created, "model": self.g.model,
                "choices": [b.choice() for b in self.siblings], "usage": self.usage()}
        if self.g.return_token_ids and self.g.kind == "chat":
            body["prompt_token_ids"] = self.g.prompt_token_ids
        if self.g.kind == "chat" and self.prompt_lps is not None:
            body["prompt_logprobs"] = prompt_logprobs_json(self.prompt_lps)
        if self.kv_transfer_params is not None:
            body["kv_transfer_params"] = self.kv_transfer_params
        return body

    def choice(self) -> dict:
        text = self.g.echo + "".join(self.text_parts)
        if self.g.kind == "completion":
            choice = {"index": self.index, "text": text,
                      "logprobs": self._logprobs(self._echo_entries() + self.logprob_entries),
                      "finish_reason": self.finish_reason, "stop_reason": self.stop_reason}
            if self.g.return_token_ids:
                choice["prompt_token_ids"] = self.g.prompt_token_ids
            if self.prompt_lps is not None:
                choice["prompt_logprobs"] = prompt_logprobs_json(self.prompt_lps)
        else:
            choice = {"index": self.index, "message": {"role": "assistant", "content": text},
                      "logprobs": self._logprobs(self.logprob_entries), "finish_reason": self.finish_reason,
                      "stop_reason": self.stop_reason}
        if self.g.return_token_ids:
            choice["token_ids"] = self.token_ids
        return choice

    def _echo_entries(self) -> list:
        """Completions echo with logprobs: the prompt's entries (its first token's without a logprob)."""
        if self.g.prompt_first_text is None or self.prompt_lps is None:
            return []
        k = self.g.params.logprobs + 1  # as vLLM: the legacy shape lists `logprobs` alternatives, whatever
        return [[(self.g.prompt_token_ids[0], None, None, self.g.prompt_first_text)]] + \
            [e[:k] for e in self.prompt_lps[1:]]  # prompt_logprobs asked for

    # -------------------------------------------------------------- stream

    def _chunk(self, choice: dict) -> dict:
        obj = {"id": self.id, "object": self.chunk_object, "created": self.created, "model": self.g.model,
               "choices": [choice]}
        if self.g.continuous_usage:  # this choice's tokens so far, as vLLM's (the final usage sums the choices)
            obj["usage"] = usage(len(self.g.prompt_token_ids), len(self.token_ids),
                                 self.num_cached if self.g.report_cached else 0)
        return obj

    def first_chunks(self) -> str:
        """What goes out before any token: the chat role (then the echoed last message), or the echoed prompt."""
        if self.g.kind == "chat":
            out = sse(self._chunk({"index": self.index, "delta": {"role": "assistant", "content": ""},
                                   "logprobs": None, "finish_reason": None}))
            if self.g.echo:
                out += sse(self._chunk({"index": self.index, "delta": {"content": self.g.echo},
                                        "logprobs": None, "finish_reason": None}))
            return out
        if self.g.echo and not self._echo_waits:
            choice = {"index": self.index, "text": self.g.echo, "logprobs": None, "finish_reason": None}
            if self.g.return_token_ids:
                choice["prompt_token_ids"] = self.g.prompt_token_ids
            return sse(self._chunk(choice))
        return ""

    def chunks(self, recs: list[TokenRecord]) -> str:
        """SSE text for records received together (one chunk; the finish reason on the last)."""
        for rec in recs:
            self.add(rec)
        last = recs[-1]
        text = "".join(r.delta_text for r in recs)
        ids = [t for r in recs for t in r.new_token_ids]
        entries = [e for r in recs for e in (r.logprobs or ())]
        if self.g.echo_only:
            text, ids, entries = "", [], []
        echoed = self._echo_waits and self.prompt_lps is not None
        if echoed:  # the prompt, its logprobs first, with the first token (vLLM's first chunk)
            self._echo_waits = False
            text, entries = self.g.echo + text, self._echo_entries() + entries
        if last.finished and last.finish_reason == "error":
            err = {"message": last.error or "request failed", "type": "InternalServerError", "param": None, "code": 500}
            if len(self.siblings) > 1:
                err["index"] = self.index  # which choice failed (n > 1: the others go on)
            return sse({"error": err})
        if not text and not last.finished and not entries and not self.g.return_token_ids:
            return ""
        fr = last.finish_reason if last.finished else None
        if self.g.kind == "completion":
            choice = {"index": self.index, "text": text, "logprobs": self._logprobs(entries), "finish_reason": fr}
            if echoed and self.g.return_token_ids:
                choice["prompt_token_ids"] = self.g.prompt_token_ids
        else:
            choice = {"index": self.index, "delta": {"content": text} if text or not last.finished else {},
                      "logprobs": self._logprobs(entries), "finish_reason": fr}
        if last.finished:
            choice["stop_reason"] = last.stop_reason
        if self.g.return_token_ids:
            choice["token_ids"] = ids
        chunk = self._chunk(choice)
        if last.finished and self.kv_transfer_params is not None:
            chunk["kv_transfer_params"] = self.kv_transfer_params
        return sse(chunk)

    def final_chunks(self) -> str:
        out = ""
        if self.g.include_usage:
            out += sse({"id": self.id, "object": self.chunk_object, "created": self.created,
                        "model": self.g.model, "choices": [], "usage": self.usage()})
        return out + SSE_DONE
