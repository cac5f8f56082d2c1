"""The router's proof on kv_transfer_params: D accepts remote-prefill params only if they carry an HMAC, made with
the shared KV token, over everything else in them. A client cannot point D at a KV endpoint of its choosing."""
from __future__ import annotations

import hashlib
import hmac
import json

PROOF_FIELD = "router_proof"


def _digest(params: dict, token: str) -> str:
    body = json.dumps({k: v for k, v in params.items() if k != PROOF_FIELD}, sort_keys=True, separators=(",", ":"))
    return hmac.new(token.encode(), body.encode(), hashlib.sha256).hexdigest()


def sign_params(params: dict, token: str) -> dict:
    return {**params, PROOF_FIELD: _digest(params, token)}


def verify_params(params: dict, token: str) -> bool:
    proof = params.get(PROOF_FIELD)
    return bool(token) and isinstance(proof, str) and hmac.compare_digest(proof, _digest(params, token))
