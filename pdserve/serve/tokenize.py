"""vLLM's `POST /tokenize` and `POST /detokenize`: the server's tokenizer, without the engine.

/tokenize takes a completion form (`prompt`) or a chat form (`messages`) and answers
`{"count", "max_model_len", "tokens", "token_strs"}`; /detokenize takes `{"tokens": [...]}` and answers
`{"prompt": text}`. The chat form is rendered by the very code /v1/chat/completions uses, and the completion form
is tokenized as /v1/completions tokenizes a string prompt (with the tokenizer's special tokens by default), so a
client's count is the prompt_tokens its generation request will report. Bodies are validated as strictly as the
generation routes' (a 400 naming the field); no token limit applies, since nothing is generated, but the text
limit does (--max-prompt-chars: it bounds the tokenizer's work). Both run on a worker thread, off the event loop.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Optional

from fastapi import FastAPI, Request

from pdserve.serve.errors import bad_request
from pdserve.serve.offload import off_loop
from pdserve.serve.prompts import ModelInfo, chat_prompt, check_chars, check_token_ids
from pdserve.serve.protocol import _check_model, _Strict, _validate

logger = logging.getLogger("pdserve.serve")


class TokenizeCompletionRequest(_Strict):
    model: Optional[str] = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: Optional[bool] = False


class TokenizeChatRequest(_Strict):
    model: Optional[str] = None
    messages: Any = None  # checked by chat_prompt, as for /v1/chat/completions
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # false, as vLLM: the chat template already writes the special tokens it wants
    add_special_tokens: bool = False
    chat_template_kwargs: Optional[dict] = None
    return_token_strs: Optional[bool] = False
    chat_template: Optional[str] = None  # rendered only with --trust-request-chat-template, as for chat completions
    tools: Optional[list] = None  # declared so that it is refused rather than ignored


class DetokenizeRequest(_Strict):
    model: Optional[str] = None
    tokens: list[int]


def _warn_unknown(req: _Strict) -> None:
    if req.model_extra:
        logger.warning("ignoring unknown field(s): %s", ", ".join(sorted(req.model_extra)))


def tokenize(data: dict, info: ModelInfo) -> dict:
    if "messages" in data and "prompt" in data:  # either form would ignore the other's text: say so
        raise bad_request("give either prompt (text) or messages (chat), not both", "messages")
    if "messages" in data:
        req = _validate(TokenizeChatRequest, data)
        _check_model(req, info)
        # vLLM refuses only what the client set itself: continue_final_message alone keeps the default
        # add_generation_prompt, which rendering then drops
        if req.continue_final_message and req.add_generation_prompt and \
                "add_generation_prompt" in req.model_fields_set:
            raise bad_request("continue_final_message and add_generation_prompt cannot both be true",
                              "continue_final_message")
        if req.tools:
            raise bad_request("tools: tool and function calling are not supported", "tools")
        ids = chat_prompt(req, info, add_special_tokens=req.add_special_tokens)[0]
    elif "prompt" in data:
        req = _validate(TokenizeCompletionRequest, data)
        _check_model(req, info)
        check_chars(len(req.prompt), info, "prompt", "prompt")
        ids = info.tokenizer(req.prompt, add_special_tokens=req.add_special_tokens).input_ids
    else:
        raise bad_request("prompt (text) or messages (chat) is required", "prompt")
    _warn_unknown(req)
    strs = info.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
    return {"count": len(ids), "max_model_len": info.max_model_len, "tokens": list(ids), "token_strs": strs}


def detokenize(data: dict, info: ModelInfo) -> dict:
    req = _validate(DetokenizeRequest, data)
    _check_model(req, info)
    _warn_unknown(req)
    ids = check_token_ids(req.tokens, info, "tokens")
    # special tokens kept, as vLLM's: the text is what the ids are, not what a completion would show
    return {"prompt": info.tokenizer.decode(ids)}


def add_tokenize_routes(app: FastAPI, model_info: Callable[[], ModelInfo], read_body, dependencies: list) -> None:
    """`model_info()` raises the 503 while the engine starts; `read_body(request)` parses the JSON body."""
    @app.post("/tokenize", dependencies=dependencies)
    async def tokenize_route(request: Request):
        info = model_info()
        return await off_loop(request, tokenize, await read_body(request), info)

    @app.post("/detokenize", dependencies=dependencies)
    async def detokenize_route(request: Request):
        info = model_info()
        return await off_loop(request, detokenize, await read_body(request), info)
