"""What a greedy request must produce on the fake model, in pure Python: the fake's next token under vLLM's stop
semantics. That is the oracle for every finished request, whatever batching, preemption, caching or import happened.

vLLM's order for output token k: (1) the scheduler, once k >= min_tokens, stops on EOS (unless ignore_eos) or a stop
token id; (2) then on length (max_tokens, max_model_len); (3) the detokenizer, once k > min_tokens, stops on a stop
string ending in token k's text, which overrides (1) and (2) (its stop_reason is the string). A token that stopped in
(1) has its text left out unless include_stop_str_in_output, so only then can it complete a stop string (vLLM's
detokenizer update(new_token_ids, stop_terminated)). Before min_tokens the sampler bans EOS and the stop token ids.

QUIRKS name the current engine's departures from that order; `explain` finds which of them reproduce an observed
output, so a failure is labelled with the defect it most likely is.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Optional

from tests.fuzz.fake_model import EOS, MOD, VOCAB, finish, weight

QUIRKS = {
    "stopstr_before_min_tokens": "defect 5 (stop strings matched before min_tokens)",
    "length_before_stopstr": "defect 6 (stop string in the last allowed token reports length)",
    "length_before_eos": "NEW: EOS/stop token id as the last allowed token reports length, vLLM reports stop",
    "stop_token_text": "NEW: a stop token id's text is kept in the output, vLLM leaves it out",
    "stopstr_window": "NEW (defect 5's fix incomplete): a stop string wholly inside the first min_tokens tokens' "
                      "text still matches when it ends within max_stop - 1 chars of their end",
    "stopstr_cuts_token_stop": "NEW: a stop string ending in the token that stopped on a stop token id still cuts the "
                               "text (vLLM checks no stop string then)",
}


@dataclass
class Expect:
    tokens: list[int]
    finish_reason: str
    stop_reason: object
    text: str


class Context:
    """next_token over a growing context in O(1) per token."""

    def __init__(self, tokens: list[int]):
        self.n, self.h = 0, 0
        for t in tokens:
            self.append(t)

    def append(self, t: int) -> None:
        self.h += (t + 1) * weight(self.n)
        self.n += 1

    def next(self) -> int:
        return finish(self.h % MOD)


def expect(prompt: list[int], sp, max_model_len: int, chars: list[str], quirks=frozenset()) -> Expect:
    """The whole output of a greedy request (its temperature is ignored)."""
    ctx = Context(prompt)
    max_tokens = sp.max_tokens if sp.max_tokens is not None else max_model_len - len(prompt)
    stop_ids = set(sp.stop_token_ids or ())
    stops = [sp.stop] if isinstance(sp.stop, str) else list(sp.stop or ())
    out, text = [], ""
    while True:
        h = ctx.next()
        banned = (stop_ids | (set() if sp.ignore_eos else {EOS})) if len(out) < sp.min_tokens else set()
        tok = h if h not in banned else min(set(range(VOCAB)) - banned)  # argmax: the first of the zero logits
        out.append(tok)
        ctx.append(tok)
        k = len(out)
        length = len(prompt) + k >= max_model_len or k >= max_tokens
        stopped = None
        if k >= sp.min_tokens and not (length and "length_before_eos" in quirks):
            if not sp.ignore_eos and tok == EOS:
                stopped = (None,)
            elif tok in stop_ids:
                stopped = (tok,)
        full = text + chars[tok]
        if stopped is None or sp.include_stop_str_in_output or "stopstr_cuts_token_stop" in quirks:
            if stops and len(full) > len(text) and (k > sp.min_tokens or "stopstr_before_min_tokens" in quirks):
                hit = next((s for s in stops if full.endswith(s)), None)
                if "stopstr_window" in quirks:  # the first match to end in the last max_stop - 1 old chars + new
                    w = full[max(0, len(text) - max(map(len, stops)) + 1):]
                    at = min(((w.find(s) + len(s), w.find(s), s) for s in stops if s in w), default=None)
                    if at is not None:
                        hit, full = at[2], full[:len(full) - len(w) + at[0]]
                if hit is not None:
                    full = full if sp.include_stop_str_in_output else full[:len(full) - len(hit)]
                    if stopped is not None and "stopstr_cuts_token_stop" in quirks:
                        return Expect(out, "stop", stopped[0], full)
                    if length and stopped is None and "length_before_stopstr" in quirks:
                        return Expect(out, "length", None, full)
                    return Expect(out, "stop", hit, full)
        if stopped is not None:
            keep = sp.include_stop_str_in_output or "stop_token_text" in quirks
            return Expect(out, "stop", stopped[0], full if keep else text)
        text = full
        if length:
            return Expect(out, "length", None, text)


def explain(prompt, sp, max_model_len, chars, observed) -> Optional[str]:
    """The smallest set of QUIRKS whose expectation equals `observed` (tokens, finish, stop_reason, text), as text;
    None when none does (a NEW defect, or a wrong KV read)."""
    for r in range(1, len(QUIRKS) + 1):
        for qs in itertools.combinations(QUIRKS, r):
            e = expect(prompt, sp, max_model_len, chars, frozenset(qs))
            if (e.tokens, e.finish_reason, e.stop_reason, e.text) == observed:
                return "; ".join(QUIRKS[q] for q in qs)
    return None
