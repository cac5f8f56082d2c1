"""Request outputs shaped like vLLM's `RequestOutput` / `CompletionOutput`, plus the per-step deltas streaming needs."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class CompletionOutput:
    index: int
    text: str  # text released so far (all of it once finished)
    token_ids: list[int]
    cumulative_logprob: Optional[float] = None
    logprobs: Optional[list[dict]] = None
    finish_reason: Optional[str] = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    delta_text: str = ""  # released by this step
    delta_token_ids: list[int] = field(default_factory=list)  # sampled by this step

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None  # the request's first output token (on D: P's, at admission)
    last_token_time: Optional[float] = None
    # the first token this node computed: the first token's time, except for a request that arrived with tokens
    # (P's first token on D, a resumed stream's), whose queue and first step are only known here
    first_own_token_time: Optional[float] = None
    finished_time: Optional[float] = None
    # a P/D consumer's KV load: from its start to the poll that saw it end, done or failed
    kv_load_start_time: Optional[float] = None
    kv_load_end_time: Optional[float] = None
    # D: the request came with P's KV to take (remote prefill params), and whether a load of it completed
    kv_remote: bool = False
    kv_loaded: bool = False

    @property
    def kv_unused(self) -> bool:
        """D took none of P's KV (refused or failed load, lease gone, all cached here): P may still hold it. Only once
        that is decided (the load ended, or the request ran without one), so it is final once true and may be read
        at any time: a request that came with P's token has an output before its load even started."""
        decided = self.kv_load_end_time is not None or self.first_scheduled_time is not None
        return self.kv_remote and decided and not self.kv_loaded

    @property
    def kv_transfer_time(self) -> float:
        if self.kv_load_start_time is None or self.kv_load_end_time is None:
            return 0.0
        return self.kv_load_end_time - self.kv_load_start_time

    def ttft_split(self) -> Optional[dict]:
        """Where this node's time to its first own token went (seconds): queue (arrival to first scheduled, the KV
        wait taken out), kv_transfer (D: waiting for P's KV), prefill (first scheduled to the first token computed
        here: the prefill, on D the one-token replay, or the first decode step of a request that came with P's
        token) and ttft (arrival to the first token, which for such a request is P's, answered at admission)."""
        if self.first_own_token_time is None or self.first_scheduled_time is None or self.first_token_time is None:
            return None
        kv = self.kv_transfer_time
        return {"queue": max(self.first_scheduled_time - self.arrival_time - kv, 0.0), "kv_transfer": kv,
                "prefill": self.first_own_token_time - self.first_scheduled_time,
                "ttft": self.first_token_time - self.arrival_time}


@dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: Optional[RequestMetrics] = None
    error: Optional[str] = None
    kv_transfer_params: Optional[dict] = None  # P: where a decode node can read this request's prompt KV
    num_external_tokens: int = 0  # prompt tokens whose KV came from elsewhere (a prefill node), at its first token
    num_preemptions: int = 0
    # SamplingParams.prompt_logprobs: None for the first prompt token, then {id: Logprob} per token; in a DELTA
    # request's first output with a token only (vLLM's), in every output once there is one otherwise
    prompt_logprobs: Optional[list] = None
    # on the output of the step that computed the request's first own token (RequestMetrics.ttft_split), fixed then:
    # `metrics` goes on changing (a D's load ends, later steps) before a server reads this output
    timing: Optional[dict] = None
    # a failed request's HTTP status before its first byte, where it is not the server's 500: 409 when the prefill
    # node a decode node awaited handed nothing over
    error_status: Optional[int] = None
