"""Incremental detokenization and stop-string handling for one request.

Text only ever grows by appending (until a stop string truncates it), so the
deltas handed out by get_delta() always concatenate to output_text.
"""
from __future__ import annotations

from typing import Optional, Sequence

# Prompt tokens used as decode context for the first output tokens, so that
# decoders which treat the first token specially (e.g. SentencePiece/Metaspace
# dropping a leading space) decode the output as it appears after the prompt.
# Byte-level BPE is unaffected by this context.
_PROMPT_CONTEXT = 5
# A valid UTF-8 char spans at most 4 bytes; if this many tokens still end in an
# incomplete char the bytes are garbage, so commit them rather than letting the
# decode window (and per-token cost) grow without bound.
_MAX_PENDING = 16
_REPLACEMENT = "\ufffd"


def backend_decoder(tokenizer):
    """The Rust `tokenizers` decode under a fast tokenizer, when transformers' own decode would only wrap it (no
    clean-up of tokenization spaces): transformers' wrapper walks the id list in Python (an isinstance per id), 10-30x
    the decode itself, twice per token per request. None: use `tokenizer.decode`."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or not hasattr(backend, "decode") or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return None
    return backend.decode


class IncrementalDetokenizer:
    def __init__(self, tokenizer, *, stop: Sequence[str] = (), include_stop_str_in_output: bool = False,
                 skip_special_tokens: bool = True, prompt_token_ids: Optional[Sequence[int]] = None,
                 min_tokens: int = 0):
        self.tokenizer = tokenizer
        self._backend_decode = backend_decoder(tokenizer)
        # As vLLM: text committed while there are at most min_tokens output tokens is not searched, so a stop
        # string must end in text after it (it may start inside it).
        self.min_tokens = min_tokens
        self.stop = [s for s in ([stop] if isinstance(stop, str) else stop) if s]
        self.include_stop_str_in_output = include_stop_str_in_output
        self.skip_special_tokens = skip_special_tokens
        self.stop_reason: Optional[str] = None  # the stop string that ended the text, if any
        self._max_stop = max((len(s) for s in self.stop), default=0)

        ctx = list(prompt_token_ids[-_PROMPT_CONTEXT:]) if prompt_token_ids else []
        prefix_text = self._decode(ctx)
        if prefix_text.endswith(_REPLACEMENT):
            # The prompt ends mid-character; its tail bytes are not ours to emit, and a
            # window ending in a partial char cannot be diffed, so decode without context.
            ctx, prefix_text = [], ""
        self._ids = ctx                # decode context + output token ids
        self._n_ctx = len(ctx)
        self._prefix = 0               # window start: tokens decoded only as context
        self._read = len(ctx)          # tokens before this are committed to _text
        self._prefix_text = prefix_text  # == decode(_ids[_prefix:_read])
        self._text = ""                # committed output text (already truncated on stop)
        self._released = 0             # chars of _text handed out by get_delta

    def _decode(self, ids: Sequence[int]) -> str:
        if not ids:
            return ""
        if self._backend_decode is not None:
            return self._backend_decode(ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    @property
    def num_consumed(self) -> int:
        """Tokens taken so far (context included): `update` takes none after a stop-string match."""
        return len(self._ids)

    @property
    def token_ids(self) -> list[int]:
        """Output tokens consumed so far; tokens after a stop-string match are not included."""
        return self._ids[self._n_ctx:]

    @property
    def finished(self) -> bool:
        return self.stop_reason is not None

    def update(self, new_token_ids: Sequence[int], final: bool = False) -> Optional[str]:
        """Append tokens; return the stop string matched (and truncate the text) or None. `final`: these are the
        request's last tokens, so an incomplete tail is committed (and searched) now, while a match can still
        set the finish reason, rather than by the flush in get_delta."""
        for i, tok in enumerate(new_token_ids):
            if self.stop_reason is not None:
                break
            self._ids.append(tok)
            last = final and i == len(new_token_ids) - 1
            if self._advance(force=last or len(self._ids) - self._read >= _MAX_PENDING):
                return self.stop_reason
        if final and not new_token_ids and self.stop_reason is None and self._read < len(self._ids):
            return self.stop_reason if self._advance(force=True) else None  # the tail of the tokens before
        return None

    def _advance(self, force: bool) -> bool:
        """Commit the pending tokens' text if it is complete; True when a stop string hit."""
        full = self._decode(self._ids[self._prefix:])
        if not force and (len(full) <= len(self._prefix_text) or full.endswith(_REPLACEMENT)):
            return False  # nothing new yet, or a multi-byte char is still incomplete
        new = full[len(self._prefix_text):]
        self._prefix, self._read = self._read, len(self._ids)
        self._prefix_text = self._decode(self._ids[self._prefix:self._read])
        return self._append(new)

    def _append(self, new: str) -> bool:
        old_len = len(self._text)
        self._text += new
        if not self.stop or not new or len(self._ids) - self._n_ctx <= self.min_tokens:
            return False
        best = None  # (end, start, stop): the match that completes first, as if streamed char by char
        for s in self.stop:  # only matches that end in the new text (as vLLM's check_stop_strings): one lying
            i = self._text.find(s, max(0, old_len - len(s) + 1))  # wholly in older text was not searched for
            # because it came before min_tokens
            if i >= 0 and (best is None or (i + len(s), i) < best[:2]):
                best = (i + len(s), i, s)
        if best is None:
            return False
        end, i, s = best
        self._text = self._text[:end if self.include_stop_str_in_output else i]
        self.stop_reason = s
        return True

    def _pending_text(self) -> str:
        if self.stop_reason is not None or self._read == len(self._ids):
            return ""
        return self._decode(self._ids[self._prefix:])[len(self._prefix_text):]

    @property
    def output_text(self) -> str:
        """Text so far including held-back chars and any incomplete tail (as currently
        decoded), truncated at a stop string."""
        return self._text + self._pending_text()

    @property
    def released_text(self) -> str:
        """All the text get_delta has handed out."""
        return self._text[:self._released]

    def get_delta(self, finished: bool) -> str:
        """Text released since the last call. Until finished (or stopped) holds back an
        incomplete trailing char and the last max_stop_len-1 chars that could still start
        a stop string; when finished, flushes everything."""
        if finished and self.stop_reason is None and self._read < len(self._ids):
            self._advance(force=True)
        if finished or self.stop_reason is not None:
            upto = len(self._text)
        else:
            upto = max(self._released, len(self._text) - max(self._max_stop - 1, 0))
        delta = self._text[self._released:upto]
        self._released = upto
        return delta
