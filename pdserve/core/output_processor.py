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
"""
from __future__ import annotations

import time
from typing import Callable

from pdserve.detokenizer import backend_decoder
from pdserve.outputs import CompletionOutput, RequestOutput
from pdserve.request import Request, RequestStatus
from pdserve.sampling_params import RequestOutputKind


class OutputProcessor:
    def __init__(self, tokenizer, finish_request: Callable[[str, RequestStatus], object]):
        self._finish_request = finish_request  # the scheduler's: frees a request a stop string ended
        self._token_texts: dict[int, str] = {}  # one token's text never changes: decoded once per id
        fast = backend_decoder(tokenizer)  # the Rust decode where transformers' wrapper would only wrap it
        self._decode_one = (lambda t: fast([t], skip_special_tokens=False)) if fast else \
            (lambda t: tokenizer.decode([t]))

    def process(self, updated: list[Request], lp_by_req: dict) -> list[RequestOutput]:
        """The outputs of the requests a step updated (`num_new_tokens` set), with their logprob entries by id."""
        now = time.monotonic()
        outputs = []
        for req in updated:
            m = req.metrics
            m.first_token_time = m.first_token_time or now
            m.last_token_time = now
            out = self._process_one(req, lp_by_req.get(req.request_id))
            if out is not None:
                outputs.append(out)
        return outputs

    def _process_one(self, req: Request, lp) -> RequestOutput | None:
        k = req.num_new_tokens
        if lp is not None:
            if isinstance(lp, list):  # a drafting row: one entry per emitted token, cut where it stopped
                req.logprobs.extend(lp[:k])
            else:
                req.logprobs.append(lp)
        new = req.output_token_ids[-k:]
        # As vLLM, the text of a token that stopped the request (EOS, a stop token id) is left out unless
        # include_stop_str_in_output; a stop string completed by the text that is kept wins over the stop the
        # scheduler saw in the same token (the length cap): the text was cut at the string.
        keep = req.status != RequestStatus.FINISHED_STOPPED or req.sampling_params.include_stop_str_in_output
        detok = req.detok
        fed = detok.num_consumed
        # Fed as plain decoding feeds them, one step each: a stopping token whose text is left out ends its step
        # with nothing new, and only then is an incomplete tail flushed (and searched).
        stop = detok.update(new if keep else new[:-1], final=req.is_finished and keep)
        flushed = False
        if stop is None and not keep:
            stop = detok.update((), final=True)
            flushed = stop is not None
        if stop is not None:
            consumed = detok.num_consumed - fed
            if not flushed and consumed < k:  # a drafting row's tokens past the stop string: never sampled
                new = self._drop_after_stop(req, k - consumed)
            req.stop_reason = stop
            if req.is_finished:
                req.status = RequestStatus.FINISHED_STOPPED
            else:
                self._finish_request(req.request_id, RequestStatus.FINISHED_STOPPED)
        if req.is_finished or req.sampling_params.output_kind != RequestOutputKind.FINAL_ONLY:
            return self.make_output(req, new)
        return None

    @staticmethod
    def _drop_after_stop(req: Request, n: int) -> list[int]:
        """Remove the request's last `n` tokens (a drafting row's tokens after a stop string): not in its output,
        logprobs or usage. It is finishing, so its KV state no longer matters. Returns this step's kept tokens."""
        del req.output_token_ids[-n:], req.all_token_ids[-n:]
        if req.logprobs and len(req.logprobs) > req.num_output_tokens:
            del req.logprobs[req.num_output_tokens:]
        req.num_new_tokens -= n
        return req.output_token_ids[len(req.output_token_ids) - req.num_new_tokens:]

    def make_output(self, req: Request, new_ids: list[int]) -> RequestOutput:
        """The request's output after a step, as its `output_kind` asks: DELTA carries only this step's text, tokens
        and logprobs (per-step work proportional to them), CUMULATIVE and FINAL_ONLY everything so far."""
        finished = req.is_finished
        detok = req.detok
        delta = detok.get_delta(finished)
        kind = req.sampling_params.output_kind
        cumulative = kind != RequestOutputKind.DELTA
        logprobs = None
        if req.sampling_params.logprobs is not None:
            logprobs = req.logprobs if cumulative else req.logprobs[len(req.logprobs) - len(new_ids):]
            fresh = logprobs if kind == RequestOutputKind.FINAL_ONLY else logprobs[len(logprobs) - len(new_ids):]
            self._decode_entries(fresh)
        prompt_lps = None
        if req.prompt_logprobs is not None and req.num_output_tokens and (
                cumulative or req.num_output_tokens == len(new_ids)):
            prompt_lps = req.prompt_logprobs
            if len(prompt_lps) > 1 and next(iter(prompt_lps[-1].values())).decoded_token is None:  # first time out
                self._decode_entries(prompt_lps[1:])
        metrics = req.metrics
        if finished:
            metrics.finished_time = time.monotonic()
        comp = CompletionOutput(0, detok.released_text if cumulative else delta,
                                list(req.output_token_ids) if cumulative else new_ids, None, logprobs,
                                req.status.finish_reason, req.stop_reason, delta, new_ids)
        return RequestOutput(req.request_id, req.prompt_text, req.prompt_token_ids, [comp], finished,
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
