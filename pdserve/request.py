"""A request's record: what the scheduler needs of it (ids, tokens, status, progress, limits, block hashes) and its
P/D fields. The state other parts keep per request is their own, each with its owner (as nano-vllm's Sequence):
the sampler's seeded generator, penalty counts and allowed ids (`model/sampler.py`, SamplerState), the n-gram
proposer's token mirror (`spec_decode/ngram_proposer.py`), the runner's prompt-logprobs progress
(`worker/prompt_logprobs.py`), and the output side's detokenizer, metrics, prompt text and logprob entries
(`core/output_processor.py`, OutputState)."""
from __future__ import annotations

import enum
import sys
import time
from typing import Optional

from pdserve.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    WAITING_FOR_REMOTE_KV = enum.auto()  # P/D consumer: blocks allocated, KV being pulled from the producer
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Everything after this line is finished; `is_finished` relies on the order.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> Optional[str]:
        """OpenAI finish_reason for a finished status."""
        return {RequestStatus.FINISHED_STOPPED: "stop", RequestStatus.FINISHED_LENGTH: "length",
                RequestStatus.FINISHED_ABORTED: "abort", RequestStatus.FINISHED_ERROR: "error"}.get(self)


class Request:
    def __init__(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                 eos_token_ids: frozenset[int] = frozenset(), arrival_time: Optional[float] = None,
                 max_tokens: Optional[int] = None, kv_transfer_params: Optional[dict] = None,
                 cache_salt: Optional[str] = None):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        # Effective output cap: sampling_params.max_tokens, or what the context leaves when it is None.
        self.max_tokens = next((m for m in (max_tokens, sampling_params.max_tokens) if m is not None), sys.maxsize)
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        # Tokens a row computes as its prefill: the prompt; after a preemption every token it had then
        self.prefill_len = len(self.prompt_token_ids)
        self.num_cached_tokens = -1  # prefix-cache hit at first admission; -1 until admitted
        self.num_preemptions = 0
        self.stop_reason: int | str | None = None
        self.error: Optional[str] = None
        self.num_new_tokens = 0  # tokens the last step appended (a drafting row may append several)
        # Async scheduling (vLLM's num_output_placeholders): the token an in-flight step will append (0 or 1); it is
        # not in output_token_ids, which the in-flight sampler reads, but the scheduler counts it as if it were.
        self.num_output_placeholders = 0
        # sampling_params.bad_words tokenized, set by the engine (it has the tokenizer), read by the sampler: an
        # input of the request like its params, not state the sampler makes, so it stays here
        self.bad_words_token_ids: Optional[list[list[int]]] = None
        self.block_hashes: list[bytes] = []  # chained hashes of full blocks of all_token_ids
        # vLLM's cache_salt: the first block's hash starts from it, so only requests with the same salt share blocks
        self.hash_seed: Optional[bytes] = None if cache_salt is None else b"salt:" + cache_salt.encode()
        # ---- P/D, all together: the scheduler's P/D half (core/kv_transfers.py) writes them, connectors read them
        self.kv_transfer_params = kv_transfer_params  # what the router sent, as checked (do_remote_decode / _prefill)
        self.kv_transfer_params_out: Optional[dict] = None  # P: where D can read this request's KV (signed)
        self.kv_load_tried = False  # D: the load was started or given up; a failed load recomputes locally
        self.num_external_tokens = 0  # prompt tokens whose KV was imported (P/D consumer, arrival driver)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_with_placeholders(self) -> int:
        return len(self.all_token_ids) + self.num_output_placeholders

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    # ---- P/D, derived from the params ----------------------------------------------------------------------------
    @property
    def hands_off_first_token(self) -> bool:
        """P: the router asked for the first token (`first_token` in its do_remote_decode params): the request runs
        with the client's own params and stops after one token, which goes to D with the prompt's KV."""
        p = self.kv_transfer_params or {}
        return bool(p.get("do_remote_decode")) and p.get("first_token") is True

    @property
    def handed_off(self) -> bool:
        """P: finished only to go on on D (not a stop, not its real length cap): its text is not final."""
        return self.hands_off_first_token and self.status == RequestStatus.FINISHED_LENGTH and \
            self.num_output_tokens < self.max_tokens

    @property
    def num_importable_tokens(self) -> int:
        """D: prompt tokens whose KV comes from P: n - 1 when D replays the last one (vLLM's way), all n when P's
        params carry the first token (D's first step is then a plain decode of it), or while D awaits P's params
        (`await_kv`: the router's early decode asks P for the first token)."""
        p = self.kv_transfer_params or {}
        return self.num_prompt_tokens - (0 if p.get("first_token") or p.get("await_kv") else 1)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.name}, prompt={self.num_prompt_tokens}, "
                f"out={self.num_output_tokens}, computed={self.num_computed_tokens})")
