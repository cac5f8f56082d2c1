"""OutputProcessor: a step's new tokens into RequestOutputs (vLLM's name): detokenization, stop strings, logprob
texts and the output kinds (DELTA, CUMULATIVE, FINAL_ONLY).

Per request and step, in this order:
1. The scheduler has appended the step's tokens (one, or a drafting row's emitted ones) and set a stop it saw in
   the tokens (EOS, a stop token id, a length cap).
2. Logprob entries are appended, one per emitted token.
3. The detokenizer is fed as plain decoding would feed it, one step per token: the text of a stopping token is
   left out unless include_stop_str_in_output, and an incomplete UTF-8 tail is flushed (and searched) only at the
   end.
4. A stop string found mid-draft drops the tokens after it (plain decoding never sampled them) and finishes the
   request; the scheduler frees its blocks.
5. An output is made when the request finished or its kind streams.

What only the outputs need of a request (its detokenizer, metrics, prompt text, logprob entries) is the processor's
own `OutputState`, by request id, from `add_request` to the request's final output: every finished request gets one
(a stop, a stop string, an abort, a failed step or load all end in `make_output`), so that drops it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from pdserve.detokenizer import IncrementalDetokenizer, backend_decoder
from pdserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pdserve.request import Request, RequestStatus
from pdserve.sampling_params import RequestOutputKind


@dataclass(eq=False)
class OutputState:
    """The output side of one request."""
    detok: IncrementalDetokenizer
    metrics: RequestMetrics
    prompt_text: Optional[str]  # the prompt as given, when it was text
    logprobs: list = field(default_factory=list)  # per output token, when sampling_params.logprobs is set
    # with sampling_params.prompt_logprobs: per prompt token, None for the first (nothing predicts it), then
    # {id: Logprob} as the model runner's steps make them (add_prompt_logprobs)
    prompt_logprobs: Optional[list] = None
    split_due: bool = False  # the first own token's TTFT split waits for the next output made (FINAL_ONLY: the last)


class OutputProcessor:
    def __init__(self, tokenizer, finish_request: Callable[[str, RequestStatus], object],
                 seal_params: Optional[Callable[[Request, Optional[dict]], Optional[dict]]] = None):
        self._tokenizer = tokenizer
        self._finish_request = finish_request  # the scheduler's: frees a request a stop string ended
        # P: a finished request's kv_transfer_params as they leave (the engine's: with the first token and its
        # logprob entry, or None when that token ended the request); after the stop strings were searched
        self._seal_params = seal_params
        self._token_texts: dict[int, str] = {}  # one token's text never changes: decoded once per id
        fast = backend_decoder(tokenizer)  # the Rust decode where transformers' wrapper would only wrap it
        self._decode_one = (lambda t: fast([t], skip_special_tokens=False)) if fast else \
            (lambda t: tokenizer.decode([t]))
        self.states: dict[str, OutputState] = {}  # by request id, until the request's final output

    def add_request(self, req: Request, prompt_text: Optional[str]) -> OutputState:
        """The output state of a request about to be scheduled."""
        if req.request_id in self.states:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        sp = req.sampling_params
        detok = IncrementalDetokenizer(
            self._tokenizer, stop=sp.stop, include_stop_str_in_output=sp.include_stop_str_in_output,
            skip_special_tokens=sp.skip_special_tokens, prompt_token_ids=req.prompt_token_ids, min_tokens=sp.min_tokens)
        metrics = RequestMetrics(req.arrival_time,
                                 kv_remote=bool((req.kv_transfer_params or {}).get("do_remote_prefill")))
        st = self.states[req.request_id] = OutputState(
            detok, metrics, prompt_text, prompt_logprobs=None if sp.prompt_logprobs is None else [None])
        return st

    def drop(self, request_id: str) -> None:
        """Forget a request that will make no output (one the scheduler did not take)."""
        self.states.pop(request_id, None)

    def add_prompt_logprobs(self, new: dict[str, list]) -> None:
        """A step's prompt-logprob entries by request id, in order after those already here."""
        for rid, entries in new.items():
            if (st := self.states.get(rid)) is not None:
                st.prompt_logprobs.extend(entries)

    def process(self, updated: list[Request], lp_by_req: dict) -> list[RequestOutput]:
        """The outputs of the requests a step updated (`num_new_tokens` set), with their logprob entries by id."""
        now = time.monotonic()
        outputs = []
        for req in updated:
            st = self.states[req.request_id]
            m = st.metrics
            m.first_token_time = m.first_token_time or now
            m.last_token_time = now
            if m.first_own_token_time is None and m.first_scheduled_time is not None:  # not tokens it came with
                m.first_own_token_time, st.split_due = now, True
            out = self._process_one(req, st, lp_by_req.get(req.request_id))
            if out is not None:
                if st.split_due:  # fixed now: the metrics change before a server reads the output
                    st.split_due, out.timing = False, m.ttft_split()
                outputs.append(out)
        return outputs

    def _process_one(self, req: Request, st: OutputState, lp) -> RequestOutput | None:
        k = req.num_new_tokens
        if lp is not None:
            if isinstance(lp, list):  # a drafting row: one entry per emitted token, cut where it stopped
                st.logprobs.extend(lp[:k])
            else:
                st.logprobs.append(lp)
        new = req.output_token_ids[-k:]
        # As vLLM, the text of a token that stopped the request (EOS, a stop token id) is left out unless
        # include_stop_str_in_output; a stop string completed by the text that is kept wins over the stop the
        # scheduler saw in the same token (the length cap): the text was cut at the string.
        keep = req.status != RequestStatus.FINISHED_STOPPED or req.sampling_params.include_stop_str_in_output
        detok = st.detok
        fed = detok.num_consumed
        # Fed as plain decoding feeds them, one step each: a stopping token whose text is left out ends its step
        # with nothing new, and only then is an incomplete tail flushed (and searched).
        # a P request handed to D is not over for its client: its text stays held as mid-stream (D goes on)
        stop = detok.update(new if keep else new[:-1], final=req.is_finished and keep and not req.handed_off)
        flushed = False
        if stop is None and not keep:
            stop = detok.update((), final=True)
            flushed = stop is not None
        if stop is not None:
            consumed = detok.num_consumed - fed
            if not flushed and consumed < k:  # a drafting row's tokens past the stop string: never sampled
                new = self._drop_after_stop(req, st, k - consumed)
            req.stop_reason = stop
            if req.is_finished:
                req.status = RequestStatus.FINISHED_STOPPED
            else:
                self._finish_request(req.request_id, RequestStatus.FINISHED_STOPPED)
        if req.is_finished or req.sampling_params.output_kind != RequestOutputKind.FINAL_ONLY:
            return self.make_output(req, new)
        return None

    @staticmethod
    def _drop_after_stop(req: Request, st: OutputState, n: int) -> list[int]:
        """Remove the request's last `n` tokens (a drafting row's tokens after a stop string): not in its output,
        logprobs or usage. It is finishing, so its KV state no longer matters. Returns this step's kept tokens."""
        del req.output_token_ids[-n:], req.all_token_ids[-n:]
        if st.logprobs and len(st.logprobs) > req.num_output_tokens:
            del st.logprobs[req.num_output_tokens:]
        req.num_new_tokens -= n
        return req.output_token_ids[len(req.output_token_ids) - req.num_new_tokens:]

    def make_output(self, req: Request, new_ids: list[int]) -> RequestOutput:
        """The request's output after a step, as its `output_kind` asks: DELTA carries only this step's text, tokens
        and logprobs (per-step work proportional to them), CUMULATIVE and FINAL_ONLY everything so far. The final
        one drops the request's output state."""
        finished = req.is_finished
        st = self.states.pop(req.request_id) if finished else self.states[req.request_id]
        detok = st.detok
        delta = detok.get_delta(finished and not req.handed_off)
        kind = req.sampling_params.output_kind
        cumulative = kind != RequestOutputKind.DELTA
        logprobs = None
        if req.sampling_params.logprobs is not None:
            logprobs = st.logprobs if cumulative else st.logprobs[len(st.logprobs) - len(new_ids):]
            fresh = logprobs if kind == RequestOutputKind.FINAL_ONLY else logprobs[len(logprobs) - len(new_ids):]
            self._decode_entries(fresh)
        prompt_lps = None
        if st.prompt_logprobs is not None and req.num_output_tokens and (
                cumulative or req.num_output_tokens == len(new_ids)):
            prompt_lps = st.prompt_logprobs
            if len(prompt_lps) > 1 and next(iter(prompt_lps[-1].values())).decoded_token is None:  # first time out
                self._decode_entries(prompt_lps[1:])
        metrics = st.metrics
        if finished:
            metrics.finished_time = time.monotonic()
        if finished and self._seal_params is not None and (req.kv_transfer_params or {}).get("do_remote_decode"):
            req.kv_transfer_params_out = self._seal_params(req, st.logprobs[0] if st.logprobs else None)
        comp = CompletionOutput(0, detok.released_text if cumulative else delta,
                                list(req.output_token_ids) if cumulative else new_ids, None, logprobs,
                                req.status.finish_reason, req.stop_reason, delta, new_ids)
        return RequestOutput(req.request_id, st.prompt_text, req.prompt_token_ids, [comp], finished,
                             max(req.num_cached_tokens, 0), metrics, req.error, req.kv_transfer_params_out,
                             req.num_external_tokens, req.num_preemptions, prompt_lps)

    def _decode_entries(self, entries: list) -> None:
        """Each logprob entry's token texts (one decode per distinct id, cached)."""
        texts = self._token_texts
        for entry in entries:
            for tok, lp in entry.items():
                text = texts.get(tok)
                if text is None:
                    text = texts[tok] = self._decode_one(tok)
                lp.decoded_token = text
