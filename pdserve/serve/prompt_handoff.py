"""Tokenize once, the serving layer's half (transfer/channel/prompt_ids.py has the wire half).

P: a P/D prefill's params gain the digest of its prompt input (`mark_prompt_input`); P's engine then signs it with
the prompt's token ids. D: a request whose params P's proof covers, with ids and a digest equal to its own body's,
takes P's ids (`ids_from_params`) and skips the chat template and the tokenizer; anything else (no ids, another
prompt input, a proof that does not hold) tokenizes here as before, never an error of its own: the engine's checks
of the proof and of the prompt hash then decide as they always did.

The digest covers what decides the ids and nothing else, as the request's fields were validated (so a router that
adds a field at its default, on one hop only, changes nothing): completions `prompt` (text only: a token-id prompt
has its ids already) and add_special_tokens; chat `messages`, add_generation_prompt, continue_final_message,
add_special_tokens and chat_template_kwargs (tools and documents are refused, so never rendered). A truncated
prompt is not handed off (D could not tell P's cut ids from the prompt's), nor one with the request's own top-level
chat_template (--trust-request-chat-template): D renders that itself.
"""
from __future__ import annotations

import hashlib
import json
import logging
from typing import Optional

from pdserve.transfer.channel.prompt_ids import PROMPT_INPUT_DIGEST, PROMPT_TOKEN_IDS, unpack_token_ids
from pdserve.transfer.channel.proof import verified_params

logger = logging.getLogger("pdserve.serve")
_LABEL = b"pdserve prompt input v1\0"  # a change of what the digest covers changes the label


def prompt_input_digest(kind: str, req) -> Optional[str]:
    """The digest of what decides `req`'s prompt token ids (a validated CompletionRequest or ChatRequest); None for
    a prompt that is not handed off."""
    if req.truncate_prompt_tokens is not None:
        return None
    if kind == "completion":
        if not isinstance(req.prompt, str):
            return None
        fields = ["completion", req.prompt, req.add_special_tokens is not False]
    else:
        if (req.model_extra or {}).get("chat_template") is not None:
            return None
        fields = ["chat", req.messages, bool(req.add_generation_prompt), bool(req.continue_final_message),
                  bool(req.add_special_tokens), req.chat_template_kwargs or {}]
    try:
        body = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    except (TypeError, ValueError, RecursionError):
        return None
    return hashlib.sha256(_LABEL + body.encode()).hexdigest()


def mark_prompt_input(kv_params: Optional[dict], kind: str, req) -> Optional[dict]:
    """P: `kv_params` as the engine gets them: a P/D prefill's with its prompt input's digest (signed with the ids
    when P hands over its KV); a client's own digest is never passed on."""
    if kv_params is None or kv_params.get("do_remote_prefill"):
        return kv_params
    kv_params = {k: v for k, v in kv_params.items() if k != PROMPT_INPUT_DIGEST}
    if kv_params.get("do_remote_decode") is True and (digest := prompt_input_digest(kind, req)) is not None:
        kv_params[PROMPT_INPUT_DIGEST] = digest
    return kv_params


def ids_from_params(kind: str, req, kv_token: str, vocab_size: int) -> Optional[list[int]]:
    """D: the prompt's token ids as P signed them, when they are for this very prompt input; else None."""
    params = req.kv_transfer_params
    if not isinstance(params, dict) or not params.get("do_remote_prefill") or PROMPT_TOKEN_IDS not in params or \
            not kv_token:
        return None
    digest = prompt_input_digest(kind, req)
    if digest is None or params.get(PROMPT_INPUT_DIGEST) != digest:  # before the proof: a mismatch costs nothing
        logger.debug("kv_transfer_params: P's prompt ids are for another prompt input: tokenized here")
        return None
    signed = verified_params(params, kv_token)
    if signed is None or signed.get(PROMPT_INPUT_DIGEST) != digest:  # the engine refuses what does not verify
        return None
    ids = unpack_token_ids(signed.get(PROMPT_TOKEN_IDS))
    if not ids or max(ids) >= vocab_size:  # P signed them, but a P of another model is no reason for a 500
        return None
    return ids
