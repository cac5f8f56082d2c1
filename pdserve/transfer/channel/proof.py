"""P's proof on the kv_transfer_params it hands out: an HMAC, made with the shared KV token under a domain label of its
own (the KV handshake uses the token under other labels), over the fields P wrote: its engine, the transfer id, the
KV endpoint, the prompt's length and hash, and the lease's expiry as seconds left when P answered (never an absolute
time: hosts' clocks are not compared). D checks it before it uses any field, so any router that relays P's params
verbatim works (pdserve's, vllm-router, a user's proxy), while params a client invents, alters, or moves to another
prompt are refused and D dials nothing for them. The proof names the fields it covers: fields a router adds beside
them are dropped, never trusted. A probe (the router's health check) is signed under a third label, so a probe can
never pass for params."""
from __future__ import annotations

import hashlib
import hmac
import json
import logging
import math
from typing import Optional

logger = logging.getLogger("pdserve.transfer")

PROOF_FIELD = "kv_proof"
PARAMS_LABEL = "pdserve kv_transfer_params v1"
PROBE_LABEL = "pdserve kv probe v1"
# What D acts on: a proof that leaves any of these out does not verify.
REQUIRED = ("do_remote_prefill", "transfer_id", "remote_engine_id", "remote_host", "remote_port", "num_prompt_tokens",
            "prompt_hash", "lease_seconds")
# D's refusal starts with this; pdserve's router reads it as a deployment error (it relayed P's params unaltered).
NOT_VERIFIED = "kv_transfer_params: the prefill node's proof does not verify"


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# The types D acts on the signed fields with (fields it only compares or passes on are left alone). P signs what it
# wrote, so a wrong type is a P of another version (or a bug), or someone holding the KV token: refused at admission,
# before the scheduler or a KV thread reads a field.
_TYPED = {
    "transfer_id": (lambda v: isinstance(v, str) and v != "", "a non-empty string"),
    "remote_host": (lambda v: isinstance(v, str) and v != "", "a non-empty string"),
    "remote_port": (lambda v: _int(v) and 0 < v < 65536, "a port number (an integer in 1..65535)"),
    "num_prompt_tokens": (lambda v: _int(v) and v > 0, "a positive integer"),
    "lease_seconds": (lambda v: (_int(v) or isinstance(v, float)) and math.isfinite(v), "a number of seconds"),
    "kv_connector": (lambda v: isinstance(v, str), "a connector name"),
}


def malformed(fields: dict) -> Optional[str]:
    """Why verified params cannot be acted on (a field of the wrong type), or None."""
    for name, (ok, what) in _TYPED.items():
        if name in fields and not ok(fields[name]):
            return (f"kv_transfer_params: the prefill node signed a malformed {name} ({json.dumps(fields[name])[:60]}"
                    f"; it must be {what}): is P running another version of pdserve?")
    return None


def prompt_hash(token_ids: list[int]) -> str:
    return hashlib.sha256(json.dumps(list(token_ids)).encode()).hexdigest()


def _mac(fields: dict, token: str, label: str) -> str:
    body = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return hmac.new(token.encode(), f"{label}\0{body}".encode(), hashlib.sha256).hexdigest()


def sign_params(params: dict, token: str, label: str = PARAMS_LABEL) -> dict:
    fields = {k: v for k, v in params.items() if k != PROOF_FIELD}
    return {**fields, PROOF_FIELD: f"{','.join(sorted(fields))}:{_mac(fields, token, label)}"}


def verified_params(params, token: str, label: str = PARAMS_LABEL) -> Optional[dict]:
    """The signed fields of `params` (with the proof) when its proof holds under `token`, else None."""
    proof = params.get(PROOF_FIELD) if isinstance(params, dict) else None
    if not token or not isinstance(proof, str) or ":" not in proof:
        return None
    names, mac = proof.rsplit(":", 1)
    keys = names.split(",") if names else []
    if any(k not in params for k in keys) or (label == PARAMS_LABEL and any(k not in keys for k in REQUIRED)):
        return None
    fields = {k: params[k] for k in keys}
    if not hmac.compare_digest(mac, _mac(fields, token, label)):
        return None
    extra = sorted(set(params) - set(keys) - {PROOF_FIELD})
    if extra:
        logger.debug("kv_transfer_params: ignoring unsigned field(s) %s", ", ".join(extra))
    return {**fields, PROOF_FIELD: proof}
