"""What the model sees of a request: its prompt token ids (a completions prompt or batch, a chat rendered with the
tokenizer's template, truncated as asked), each check a 400 naming the field."""
from __future__ import annotations

import dataclasses
import json
from typing import Any, Optional

from pdserve.serve.errors import bad_request


@dataclasses.dataclass
class ModelInfo:
    """What request translation needs to know about the served model."""
    names: tuple[str, ...]
    tokenizer: Any
    vocab_size: int
    max_model_len: int
    generation_config: dict
    has_kv_connector: bool = False
    # the limits checked before any tokenization or rendering (see ServerState.on_engine_ready)
    max_prompt_chars: int = 2**62
    max_prompts: int = 2**62  # prompts in one batch: --max-waiting, more could never be queued together
    max_num_seqs: int = 2**62  # bounds `n`
    # D: checks P's proof on the prompt ids P hands over (prompt_handoff.py); "" takes none
    kv_token: str = dataclasses.field(default="", repr=False)
    trust_request_chat_template: bool = False  # --trust-request-chat-template: a request's own template is rendered


CHARS_PER_TOKEN = 32  # the default --max-prompt-chars is this many per token of max_model_len


def too_long(n_tokens: int, where: str, info: ModelInfo):
    return bad_request(f"the {where} has {n_tokens} tokens but the context length (max_model_len) is "
                       f"{info.max_model_len}", "prompt")


def check_chars(n_chars: int, info: ModelInfo, where: str, param: str, unit: str = "characters") -> None:
    """Refuses text too long to tokenize: checked before the tokenizer (or a chat template) sees it, since its work
    grows with the text while the context stays max_model_len tokens."""
    if n_chars > info.max_prompt_chars:
        raise bad_request(f"{where}: {n_chars} {unit} is more than this server tokenizes for one prompt "
                          f"({info.max_prompt_chars}, --max-prompt-chars; the context is {info.max_model_len} "
                          "tokens)", param)


def check_token_ids(ids: list, info: ModelInfo, param: str) -> list[int]:
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int):
            raise bad_request(f"{param}: token ids must be integers, got {json.dumps(t)[:40]}", param)
        if not 0 <= t < info.vocab_size:
            raise bad_request(f"{param}: token id {t} is outside the vocabulary [0, {info.vocab_size})", param)
    return list(ids)


def completion_prompts(prompt: Any, info: ModelInfo, special: bool, keep: Optional[int] = None,
                       side: Optional[str] = None) -> list[tuple[list[int], Optional[str]]]:
    """(ids, text) per prompt: a string, a list of token ids, or a batch (a list of several of those), as vLLM's.
    `keep`, `side`: truncate_prompt_tokens and truncation_side, applied here to lists of ids (before their ids are
    checked one by one), by truncated() to text once tokenized."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) > info.max_prompts:
            raise bad_request(f"prompt: a batch of {len(prompt)} prompts is more than this server ever queues "
                              f"(--max-waiting {info.max_prompts})", "prompt")
        checked = [_checked_size(p, info, f"prompt[{j}]", keep, side) for j, p in enumerate(prompt)]
        return [_one_prompt(p, info, f"prompt[{j}]", special) for j, p in enumerate(checked)]
    return [_one_prompt(_checked_size(prompt, info, "prompt", keep, side), info, "prompt", special)]


def _checked_size(prompt: Any, info: ModelInfo, where: str, keep: Optional[int], side: Optional[str]) -> Any:
    """The prompt, a list of ids cut to `keep`, once its size could fit: every prompt of a batch is sized before
    the first is tokenized."""
    if isinstance(prompt, str):
        check_chars(len(prompt), info, where, "prompt")
    elif isinstance(prompt, list):
        keep = info.max_model_len if keep == -1 else keep
        if keep and len(prompt) > keep:
            prompt = prompt[:keep] if side == "right" else prompt[-keep:]
        if len(prompt) >= info.max_model_len:  # cannot fit, whatever its ids: refused before they are walked
            raise too_long(len(prompt), where, info)
    return prompt


def _one_prompt(prompt: Any, info: ModelInfo, where: str, special: bool) -> tuple[list[int], Optional[str]]:
    if isinstance(prompt, str):
        return info.tokenizer(prompt, add_special_tokens=special).input_ids, prompt
    if isinstance(prompt, list):
        return check_token_ids(prompt, info, where), None
    if prompt is None:
        raise bad_request("prompt: field required", "prompt")
    raise bad_request(f"{where}: must be a string or a list of token ids, got {type(prompt).__name__}", "prompt")


def chat_prompt(req, info: ModelInfo, add_special_tokens: bool = False) -> tuple[list[int], str, list[dict]]:
    """`req`: a ChatRequest, or /tokenize's chat form (which has the same rendering fields), so both count alike."""
    conv = chat_conversation(req, info)
    kwargs = dict(req.chat_template_kwargs or {})
    if (own := request_chat_template(req)) is not None:  # trusted (chat_conversation refuses it otherwise)
        kwargs["chat_template"] = own
    try:
        text = info.tokenizer.apply_chat_template(
            conv, tokenize=False, add_generation_prompt=req.add_generation_prompt and not req.continue_final_message,
            continue_final_message=bool(req.continue_final_message), **kwargs)
    except Exception as e:  # a template error is the request's fault (roles, kwargs), never a 500
        raise bad_request(f"messages: the chat template failed: {e}", "messages") from None
    return info.tokenizer(text, add_special_tokens=add_special_tokens).input_ids, text, conv


def chat_conversation(req, info: ModelInfo) -> list[dict]:
    """The messages checked (each a 400 naming it, the size limits included) as the template gets them: what a
    chat needs besides its token ids (the answer's role, echo), so a D given P's ids runs this and no template."""
    msgs = req.messages
    if not isinstance(msgs, list) or not msgs:
        raise bad_request("messages: must be a non-empty list of {role, content} objects", "messages")
    # sized before one message is looked at: the template renders them all, and their text is then tokenized
    check_chars(len(msgs), info, "messages", "messages", "messages (each counts one)")
    conv, chars = [], 0
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad_request(f"{where}: must be an object with a string 'role'", where)
        content = m.get("content")
        if content is None:  # OpenAI: only an assistant message with tool calls may omit it (replayed history)
            if m.get("role") != "assistant" or not (m.get("tool_calls") or m.get("function_call")):
                raise bad_request(f"{where}.content: field required", f"{where}.content")
            content = ""
        if isinstance(content, list):
            parts = []
            for j, p in enumerate(content):
                if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                    raise bad_request(f"{where}.content[{j}]: only text parts ({{type: text, text}}) are "
                                      "supported", f"{where}.content")
                parts.append(p["text"])
            content = "".join(parts)
        elif not isinstance(content, str):
            raise bad_request(f"{where}.content: must be a string or a list of text parts", f"{where}.content")
        chars += len(content) + 1
        check_chars(chars, info, "messages", "messages")
        conv.append({**m, "content": content})
    if request_chat_template(req) is not None and not info.trust_request_chat_template:
        # a template is code the server would run (a nested loop can run for ever): only a trusted client's
        param = "chat_template" if _top_level_template(req) is not None else "chat_template_kwargs"
        raise bad_request(f"{param}: a request's own chat template is not rendered unless the server runs with "
                          "--trust-request-chat-template (the model's is used without the field)", param)
    return conv


def request_chat_template(req) -> Optional[str]:
    """A chat request's own template (the top-level field, else chat_template_kwargs'), or None."""
    own = _top_level_template(req)
    if own is None:
        own = (req.chat_template_kwargs or {}).get("chat_template")
    if own is not None and not isinstance(own, str):
        raise bad_request("chat_template: must be a string (a Jinja template)", "chat_template")
    return own


def _top_level_template(req):
    """The top-level `chat_template` (a declared field of /tokenize's chat form, an extra one of a chat request)."""
    own = getattr(req, "chat_template", None)
    return own if own is not None else (getattr(req, "model_extra", None) or {}).get("chat_template")


def truncated(prompts: list, k: Optional[int], side: Optional[str], info: ModelInfo) -> list:
    """vLLM's truncate_prompt_tokens: at most k tokens of each prompt, the last k unless `side` is right; a cut
    prompt's text is its ids' (what echo shows)."""
    if k is None:
        return prompts
    k = info.max_model_len if k == -1 else k
    if k == 0:
        raise bad_request("truncate_prompt_tokens: must be -1 or at least 1, got 0", "truncate_prompt_tokens")
    return [(ids, text) if len(ids) <= k else (ids[:k] if side == "right" else ids[-k:], None)
            for ids, text in prompts]
