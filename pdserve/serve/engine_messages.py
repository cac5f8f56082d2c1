"""What the engine loop (engine_core.py) sends the server: msgspec structs, so the thread backend hands them over as
they are and the process backend writes each step's batch as one msgpack frame (`Wire`). `record()` turns one
engine RequestOutput into the request's TokenRecord.

The wire: a step's frame holds only what the step changed (one record per request that got tokens or ended, the
answers to queries asked since the last step), arrays in place of field names, defaults left out. Decoding is typed,
so a frame that does not match these structs is an error, not a surprise later. What msgspec cannot encode (an
exception answering a query, an object in a stats dict) travels as a pickled msgpack extension, per object.
"""
from __future__ import annotations

import pickle
from typing import Any, Optional, Union

import msgspec


class TokenRecord(msgspec.Struct, array_like=True, omit_defaults=True):
    """One request's progress in one step (or its end)."""
    request_id: str
    new_token_ids: list[int]
    delta_text: str
    finished: bool
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None
    logprobs: Optional[list] = None  # per new token: [(token_id, logprob, rank, decoded), ...], sampled first
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prefix-cache hit
    error: Optional[str] = None
    kv_transfer_params: Optional[dict] = None  # P/D producer: where a decode node reads this request's KV
    rejected: bool = False  # the engine refused the request (its add_request raised ValueError): a 400
    error_status: Optional[int] = None  # RequestOutput.error_status: another status than 500 for a failed request
    # on the record of the step that computed the request's first own token (RequestOutput.timing): seconds by
    # stage (RequestMetrics.ttft_split); for a request that came with tokens (P's first token on D) a later record
    timing: Optional[dict] = None
    kv_unused: bool = False  # D took none of P's KV, once that is decided (RequestMetrics.kv_unused)
    num_external_tokens: int = 0  # prompt tokens imported from a prefill node (or the arrival driver)
    num_preemptions: int = 0  # on the finished record
    # with the first token, when asked: per prompt token its entry as in `logprobs`, None for the first token
    prompt_logprobs: Optional[list] = None


class StepBatch(msgspec.Struct, array_like=True, tag=True):
    time: float  # time.monotonic() when the step's outputs were ready (CLOCK_MONOTONIC: same clock across processes)
    records: list[TokenRecord] = msgspec.field(default_factory=list)
    replies: list[tuple[int, Any]] = msgspec.field(default_factory=list)  # (query id, result or exception)


class EngineInfo(msgspec.Struct, array_like=True, tag=True):
    """Sent once start-up is done."""
    max_model_len: int
    vocab_size: int
    num_blocks: int
    device: str
    has_kv_connector: bool
    async_scheduling: bool = False  # as resolved for the device (the flag's default is auto)


class EngineFailed(msgspec.Struct, array_like=True, tag=True):
    """The engine did not start or its loop died: the server fails every request and exits (process backend; the
    thread backend hands the exception itself over)."""
    message: str


_PICKLED = 1  # msgpack extension code of an object msgspec cannot encode


def _enc_hook(obj: Any) -> msgspec.msgpack.Ext:
    return msgspec.msgpack.Ext(_PICKLED, pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def _ext_hook(code: int, data: memoryview) -> Any:
    if code != _PICKLED:
        raise ValueError(f"unknown msgpack extension {code}")
    return pickle.loads(data)


class Wire:
    """The process backend's codec for engine -> server frames (one per step): `encode` in the engine process,
    `decode` in the server's; an exception from the engine crosses as EngineFailed and comes out as RuntimeError."""

    def __init__(self):
        self._enc = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
        self._dec = msgspec.msgpack.Decoder(Union[StepBatch, EngineInfo, EngineFailed], ext_hook=_ext_hook)

    def encode(self, obj: Any) -> bytes:
        if isinstance(obj, BaseException):
            obj = EngineFailed(str(obj))
        return self._enc.encode(obj)

    def decode(self, frame: bytes) -> Any:
        obj = self._dec.decode(frame)
        return RuntimeError(obj.message) if isinstance(obj, EngineFailed) else obj


def record(out) -> TokenRecord:
    c = out.outputs[0]
    lps = None
    if c.logprobs is not None and c.delta_token_ids:
        lps = [_entry(tok, entry) for tok, entry in zip(c.delta_token_ids, c.logprobs[-len(c.delta_token_ids):])]
    plps = None
    if out.prompt_logprobs is not None:
        plps = [None] + [_entry(tok, e) for tok, e in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:])]
    return TokenRecord(out.request_id, list(c.delta_token_ids), c.delta_text, out.finished, c.finish_reason,
                       c.stop_reason, lps, len(out.prompt_token_ids), out.num_cached_tokens, out.error,
                       getattr(out, "kv_transfer_params", None), timing=out.timing,
                       kv_unused=bool(out.metrics and out.metrics.kv_unused),
                       num_external_tokens=out.num_external_tokens,
                       num_preemptions=out.num_preemptions, prompt_logprobs=plps,
                       error_status=getattr(out, "error_status", None))


def _entry(tok: int, entry: dict) -> list:
    """[(token id, logprob, rank, text), ...]: the token itself first, then the rest by rank."""
    chosen = entry[tok]
    rest = [(t, lp.logprob, lp.rank, lp.decoded_token) for t, lp in entry.items() if t != tok]
    return [(tok, chosen.logprob, chosen.rank, chosen.decoded_token)] + sorted(rest, key=lambda r: r[2])
