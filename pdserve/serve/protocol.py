"""OpenAI request bodies (with vLLM's extra sampling fields) and their translation into a `GenerationRequest`.

Bodies are validated strictly (a string is not a number, 1.0 is not an int) and every failure is a 400 naming the
field. Unknown fields are kept aside so the caller can log them and go on.
"""
from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pdserve.sampling_params import RequestOutputKind, SamplingParams
from pdserve.serve.errors import APIError, bad_request
from pdserve.serve.prompt_handoff import ids_from_params, mark_prompt_input
from pdserve.serve.prompts import ModelInfo, chat_conversation, chat_prompt, check_chars, check_token_ids, \
    completion_prompts, too_long, truncated

logger = logging.getLogger("pdserve.serve")
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "function-after", "json-or-python"}
# Request fields passed to SamplingParams as they are (when the client set them).
_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos",
                    "min_tokens", "repetition_penalty", "presence_penalty", "frequency_penalty",
                    "include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens", "n",
                    "logit_bias", "allowed_token_ids", "bad_words")
_SAMPLING_NAMES = {f.name for f in dataclasses.fields(SamplingParams)} | {"max_completion_tokens", "top_logprobs"}
# vLLM's request fields that change what is generated and that pdserve does not serve, with the values that ask for
# nothing: any other value is a 400 naming the field, never an answer that quietly went without it
_NOT_SERVED = {"use_beam_search": (False,), "length_penalty": (1,), "logprob_token_ids": (),
               "prompt_embeds": (), "structured_outputs": (), "guided_json": (), "guided_regex": (),
               "guided_choice": (), "guided_grammar": (), "watermarking": (), "priority": (0,),
               "repetition_detection": (), "thinking_token_budget": (),
               "functions": ([],), "function_call": ("none",), "documents": ([],), "logits_processors": ([],)}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Common(_Strict):
    model: Optional[str] = None
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    seed: Optional[int] = None
    stop: Union[str, list[str], None] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: Optional[bool] = None
    min_tokens: Optional[int] = None
    repetition_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    include_stop_str_in_output: Optional[bool] = None
    skip_special_tokens: Optional[bool] = None
    spaces_between_special_tokens: Optional[bool] = None
    n: Optional[int] = None
    best_of: Optional[int] = None
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    logit_bias: Optional[dict] = None
    kv_transfer_params: Optional[dict] = None
    return_token_ids: Optional[bool] = False  # vLLM: token ids in the choices and the prompt's in the response
    prompt_logprobs: Optional[int] = None  # vLLM's: each prompt token's logprob and top N
    allowed_token_ids: Optional[list[int]] = None  # vLLM's: only these may be sampled
    bad_words: Optional[list[str]] = None  # vLLM's: never completed in the output
    truncate_prompt_tokens: Optional[int] = Field(None, ge=-1)  # vLLM's: keep k prompt tokens (-1: max_model_len)
    truncation_side: Optional[Literal["left", "right"]] = None  # which end truncation cuts (left: keep the last)
    add_special_tokens: Optional[bool] = None  # vLLM's; unset: true for completions, false for chat (the template)
    response_format: Optional[dict] = None
    cache_salt: Optional[str] = None  # vLLM's: prefix-cache blocks shared only among requests with the same salt
    return_tokens_as_token_ids: Optional[bool] = False  # vLLM's: logprob tokens as "token_id:<id>"


class CompletionRequest(_Common):
    prompt: Any = None
    max_tokens: Optional[int] = 16  # OpenAI's and vLLM's default for completions
    logprobs: Optional[int] = Field(None, ge=0, le=20)
    echo: Optional[bool] = False
    suffix: Optional[str] = None


class ChatRequest(_Common):
    messages: Any = None
    max_completion_tokens: Optional[int] = None
    logprobs: Optional[bool] = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)
    add_generation_prompt: Optional[bool] = True
    continue_final_message: Optional[bool] = False
    chat_template_kwargs: Optional[dict] = None
    tools: Optional[list] = None
    tool_choice: Any = None
    echo: Optional[bool] = False  # vLLM's: the last message's content first, when it has the response's role


@dataclasses.dataclass
class GenerationRequest:
    kind: Literal["completion", "chat"]
    model: str
    prompt_token_ids: list[int]
    prompt_text: Optional[str]
    params: SamplingParams
    stream: bool
    include_usage: bool
    continuous_usage: bool
    echo: str  # the text the answer starts with ("" unless asked for): the prompt, or the last chat message's
    return_token_ids: bool
    unknown_fields: list[str]
    kv_transfer_params: Optional[dict] = None
    prompt_first_text: Optional[str] = None  # completions echo with logprobs: the first prompt token's text
    cache_salt: Optional[str] = None
    tokens_as_ids: bool = False  # return_tokens_as_token_ids
    report_cached: bool = True  # usage names prefix-cache hits (not when P serves a router a request D redoes)
    echo_only: bool = False  # completions max_tokens 0 with echo: the answer is the prompt alone
    ids_from_prefill: bool = False  # D: the prompt's ids are those P signed (prompt_handoff.py), not tokenized here


def _validate(cls, data: dict):
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        path = [str(p) for p in err["loc"] if not (isinstance(p, str) and (p in _TYPE_TAGS or "[" in p))]
        param = ".".join(path) or None
        got = err.get("input")
        got_s = json.dumps(got)[:80] if isinstance(got, (int, float, str, bool, type(None))) else type(got).__name__
        raise bad_request(f"{param}: {err['msg'].rstrip('.')} (got {got_s})", param) from None


def _check_model(req: _Common, info: ModelInfo) -> str:
    if req.model is None:
        return info.names[0]
    if req.model not in info.names:
        raise APIError(404, f"The model `{req.model}` does not exist (served: {', '.join(info.names)}).", "model")
    return info.names[0]


def _unsupported(req: _Common) -> None:
    for name, value in (req.model_extra or {}).items():
        if name in _NOT_SERVED and value is not None and value not in _NOT_SERVED[name]:
            raise bad_request(f"{name}: not supported by pdserve (vLLM's field; leave it out)", name)
    fmt = (req.response_format or {}).get("type", "text")
    if fmt != "text":
        raise bad_request(f"response_format: only type 'text' is supported, got {fmt!r}", "response_format")
    if req.best_of not in (None, 1):
        raise bad_request("best_of: only 1 is supported", "best_of")
    if req.cache_salt == "":
        raise bad_request("cache_salt: must be a non-empty string", "cache_salt")
    if not isinstance(req, ChatRequest) and (req.model_extra or {}).get("chat_template") is not None:
        raise bad_request("chat_template: only chat completions take a chat template", "chat_template")
    if isinstance(req, CompletionRequest) and req.suffix:
        raise bad_request("suffix: not supported", "suffix")
    if isinstance(req, ChatRequest):
        if req.tools or req.tool_choice not in (None, "none"):
            raise bad_request("tools: tool and function calling are not supported", "tools")


def _sampling_params(req: _Common, max_tokens: Optional[int], logprobs: Optional[int],
                     info: ModelInfo, prompt_logprobs: Optional[int] = None) -> SamplingParams:
    explicit = {k: getattr(req, k) for k in _SAMPLING_FIELDS
                if k in req.model_fields_set and getattr(req, k) is not None}
    explicit["max_tokens"] = max_tokens
    explicit["logprobs"] = logprobs
    explicit["prompt_logprobs"] = prompt_logprobs
    explicit["output_kind"] = RequestOutputKind.DELTA  # the server relays deltas only: no per-step copies of the past
    try:
        params = SamplingParams.from_generation_config(info.generation_config, **explicit)
    except ValueError as e:
        msg = str(e)
        word = msg.split(" ", 1)[0]
        raise bad_request(msg, word if word in _SAMPLING_NAMES else None) from None
    check_token_ids(params.stop_token_ids, info, "stop_token_ids")
    check_token_ids(list(params.logit_bias or ()), info, "logit_bias")
    check_token_ids(params.allowed_token_ids or [], info, "allowed_token_ids")
    try:  # here, not in the engine loop: a word of no token is the client's 400
        words = params.bad_words_token_ids(info.tokenizer)
    except ValueError as e:
        raise bad_request(str(e), "bad_words") from None
    check_token_ids([t for w in words or () for t in w], info, "bad_words")
    return params


def _check_context(n_prompt: int, params: SamplingParams, info: ModelInfo, max_tokens_name: str,
                   where: str = "prompt") -> None:
    if n_prompt == 0:
        raise bad_request(f"{where} is empty", "prompt")
    if n_prompt >= info.max_model_len:
        raise too_long(n_prompt, where, info)
    if params.max_tokens is not None and n_prompt + params.max_tokens > info.max_model_len:
        raise bad_request(f"the {where} ({n_prompt} tokens) plus {max_tokens_name} ({params.max_tokens}) is "
                          f"{n_prompt + params.max_tokens} tokens, over the context length (max_model_len "
                          f"{info.max_model_len})", max_tokens_name)


def to_generation_requests(kind: str, data: dict, info: ModelInfo) -> list[GenerationRequest]:
    """One GenerationRequest per prompt (several only for a completions batch), sharing one SamplingParams."""
    req = _validate(CompletionRequest if kind == "completion" else ChatRequest, data)
    model = _check_model(req, info)
    _unsupported(req)
    if req.n is not None and req.n > info.max_num_seqs:  # its choices run as n requests: more than one step's
        # batch holds would let one request take over the queue that every client shares
        raise bad_request(f"n: {req.n} choices are more than this server runs at once (--max-num-seqs "
                          f"{info.max_num_seqs})", "n")
    if req.kv_transfer_params is not None and not info.has_kv_connector and \
            set(req.kv_transfer_params) != {"resume_token_ids"}:  # a resume needs no transfer: any node serves it
        raise bad_request("kv_transfer_params: this server has no KV connector (start it with a KV transfer "
                          "config to take part in P/D)", "kv_transfer_params")
    # D: P's signed ids for this very prompt input (tokenize once); the checks that need no tokenizer still run
    p_ids = ids_from_params(kind, req, info.kv_token, info.vocab_size) if req.kv_transfer_params is not None else None
    if kind == "completion":
        if p_ids is not None:  # a text prompt (its digest says so), sized as if it were tokenized here
            check_chars(len(req.prompt), info, "prompt", "prompt")
            prompts = [(p_ids, req.prompt)]
        else:
            prompts = truncated(completion_prompts(req.prompt, info, req.add_special_tokens is not False,
                                                   req.truncate_prompt_tokens, req.truncation_side),
                                req.truncate_prompt_tokens, req.truncation_side, info)
        max_tokens, mt_name = req.max_tokens, "max_tokens"
        logprobs = req.logprobs
        # as vLLM: echo with logprobs scores the prompt too (its tokens lead the legacy logprobs)
        prompt_lps = req.prompt_logprobs if req.prompt_logprobs is not None else logprobs if req.echo else None
        echoes = [(text if text is not None else info.tokenizer.decode(ids)) if req.echo else ""
                  for ids, text in prompts]
    else:
        if p_ids is not None:  # the rendered text is not needed past tokenizing: only the messages are
            ids, text, conv = p_ids, None, chat_conversation(req, info)
        else:
            ids, text, conv = chat_prompt(req, info, bool(req.add_special_tokens))
        prompts = truncated([(ids, text)], req.truncate_prompt_tokens, req.truncation_side, info)
        # as vLLM: the answer's role is the assistant's, or the last message's when no generation prompt is added
        role = "assistant" if req.add_generation_prompt else conv[-1]["role"]
        echoes = [conv[-1]["content"] if req.echo and conv[-1]["role"] == role else ""]
        use_mct = req.max_completion_tokens is not None
        max_tokens = req.max_completion_tokens if use_mct else req.max_tokens
        mt_name = "max_completion_tokens" if use_mct else "max_tokens"
        if req.top_logprobs and not req.logprobs:  # as vLLM: top_logprobs alone asks for nothing
            raise bad_request("top_logprobs: only allowed when logprobs is true", "top_logprobs")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        # as vLLM: echo scores the prompt with top_logprobs (answered in the top-level prompt_logprobs)
        prompt_lps = req.prompt_logprobs if req.prompt_logprobs is not None else \
            req.top_logprobs if req.echo else None
    if req.stream and req.prompt_logprobs:  # as vLLM: only 0 streams (and is then never sent)
        raise bad_request("prompt_logprobs: not available when stream is true (echo with logprobs streams the "
                          "prompt's logprobs in its first chunk)", "prompt_logprobs")
    if req.stream and not (kind == "completion" and req.echo and logprobs is not None):
        prompt_lps = None  # a stream carries them only as completions echo's logprobs: not computed for nothing
    echo_only = kind == "completion" and bool(req.echo) and max_tokens == 0
    if echo_only:  # as vLLM: the prompt (and its logprobs) alone; the engine's one token is left out of the answer
        max_tokens = 1
    if max_tokens is not None and max_tokens < 1:
        raise bad_request(f"{mt_name}: must be at least 1 (0 only with echo), got {max_tokens}", mt_name)
    params = _sampling_params(req, max_tokens, logprobs, info, prompt_lps)
    kv_params, report_cached = req.kv_transfer_params, True
    local_only = prompt_lps is not None or params.n > 1 or len(prompts) > 1
    if kv_params is not None and local_only and kv_params.get("do_remote_decode") is True and \
            not kv_params.get("do_remote_prefill"):
        # a router's prefill request (vllm-router asks P for every request) for what is not served P/D: served as
        # a plain request and answered without params, so the decode node prefills it itself. Without the prompt's
        # logprobs too: the decode node's answer has them all, and vllm-router would put these in front of those
        logger.info("not served P/D (n > 1, a batch or prompt logprobs): no kv_transfer_params in the answer")
        kv_params, prompt_lps, echoes = None, None, [""] * len(prompts)
        params.prompt_logprobs = None
        # vllm-router also takes P's cached_tokens for D's usage where D reports none: not this run's
        report_cached = False
    if kv_params is not None:  # a P/D transfer carries one sequence's KV
        if prompt_lps is not None:  # imported KV has no logits: every prompt position must be computed here
            raise bad_request("prompt_logprobs: prompt logprobs (or echo with logprobs) are not served with "
                              "kv_transfer_params (P/D)", "prompt_logprobs")
        if params.n > 1:
            raise bad_request(f"n: {params.n} choices are not served with kv_transfer_params (P/D); send n = 1 "
                              "requests", "n")
        if len(prompts) > 1:
            raise bad_request(f"prompt: a batch of {len(prompts)} prompts is not served with kv_transfer_params "
                              "(P/D); send one request per prompt", "prompt")
    if isinstance(kv_params, dict) and "resume_token_ids" in kv_params and logprobs is not None and not req.stream:
        # a whole answer would lack the resumed tokens' logprobs (a resumed stream's client has them already)
        raise bad_request("kv_transfer_params: resume_token_ids with logprobs only on a stream", "kv_transfer_params")
    kv_params = mark_prompt_input(kv_params, kind, req)  # P: the digest its engine signs with the prompt's ids
    for j, (ids, _) in enumerate(prompts):
        _check_context(len(ids), params, info, mt_name, "prompt" if len(prompts) == 1 else f"prompt[{j}]")
    opts = req.stream_options or StreamOptions()
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options: only allowed when stream is true", "stream_options")
    unknown = sorted(req.model_extra or {})
    first = kind == "completion" and bool(req.echo) and logprobs is not None and prompt_lps is not None
    return [GenerationRequest(kind, model, ids, text, params, bool(req.stream), opts.include_usage,
                              opts.continuous_usage_stats, echo, bool(req.return_token_ids), unknown,
                              kv_params, info.tokenizer.decode(ids[:1]) if first else None, req.cache_salt,
                              bool(req.return_tokens_as_token_ids), report_cached, echo_only, p_ids is not None)
            for (ids, text), echo in zip(prompts, echoes)]
