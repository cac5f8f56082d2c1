"""Tokenize once: the prompt's token ids P hands D inside its signed kv_transfer_params, so D need not render a chat
template or run its tokenizer on a prompt P already tokenized.

P puts two fields in what it signs, and only for a P/D prefill whose server said what the prompt input was
(`PROMPT_INPUT_DIGEST` in the request's own params, set by P's serving layer, never the client's):
- `prompt_input_digest`: the digest of the request's prompt input as D will see it (serve/prompt_handoff.py says
  which fields: what changes the token ids, nothing else);
- `prompt_token_ids_packed`: the ids, packed ("u16le:" or "u32le:" then base64 of the little-endian array): 2.7
  characters a token up to 65536 ids, 5.3 above (a JSON list: about 5 and 7), and a string costs nothing to parse,
  sign and check on each hop (a 4096-id list took ~0.2 ms each to parse and to serialize for the proof).
D uses the ids only when P's proof covers both and its own body's digest matches; `prompt_hash` is still checked
against the ids it uses. Without them (a token-id prompt, a truncated one, an older P) D tokenizes as it always did.
"""
from __future__ import annotations

import array
import base64
import binascii
import sys
from typing import Optional

PROMPT_INPUT_DIGEST = "prompt_input_digest"
PROMPT_TOKEN_IDS = "prompt_token_ids_packed"
_FORMATS = {"u16le": "H", "u32le": "I"}  # array typecodes: 2 and 4 bytes on every platform CPython builds for


def pack_token_ids(ids: list[int]) -> str:
    name = "u16le" if max(ids, default=0) < 1 << 16 else "u32le"
    arr = array.array(_FORMATS[name], ids)
    if sys.byteorder == "big":
        arr.byteswap()
    return f"{name}:{base64.b64encode(arr.tobytes()).decode('ascii')}"


def unpack_token_ids(packed) -> Optional[list[int]]:
    """The ids `pack_token_ids` packed; None for anything else (never raises: the caller then tokenizes)."""
    if not isinstance(packed, str) or ":" not in packed:
        return None
    name, data = packed.split(":", 1)
    if name not in _FORMATS:
        return None
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        return None
    arr = array.array(_FORMATS[name])
    if len(raw) % arr.itemsize:
        return None
    arr.frombytes(raw)
    if sys.byteorder == "big":
        arr.byteswap()
    return arr.tolist()


def handoff_fields(req) -> dict:
    """P: the fields that hand `req`'s prompt ids to D (to be signed with the rest), or none when its server gave no
    digest of the prompt input (a token-id prompt, a truncated one, an engine driven without the server)."""
    digest = (req.kv_transfer_params or {}).get(PROMPT_INPUT_DIGEST)
    if not isinstance(digest, str) or not digest:
        return {}
    return {PROMPT_INPUT_DIGEST: digest, PROMPT_TOKEN_IDS: pack_token_ids(req.prompt_token_ids)}
