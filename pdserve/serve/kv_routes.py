"""The P/D routes of a node, for routers (authenticated by P's proof, not the API key: a router holds no KV token):
- `POST /v1/kv/release` (P): end a lease no decode node took; the body is `{"kv_transfer_params": ...}` as P
  returned them, with P's proof. 200 released; 404 no such open lease here (unknown, already released or expired:
  a repeat is harmless); 403 no valid proof; 400 not a producer.
- `GET /v1/kv/probe` (P): `{"probe": ...}`, a probe signed with P's KV token (its own label: never valid params).
- `POST /v1/kv/probe` (D): `{"probe": ...}` from a P: 200 `{"ok": true}` when it verifies with D's KV token, 409
  with the reason when not (P and D hold different tokens: a deployment error, found before traffic is), 400 when
  this is not a decode node.
- `GET /v1/kv/handoff/{key}` (P): the params of P's request with that handoff key, for the D that took the request
  early (serve/handoff.py): `{"kv_transfer_params": ...}` once the request ended (null with a `reason` when nothing
  is handed over); 403 without `X-PD-Handoff-Proof` made with P's KV token; 400 a malformed key; 504 past the wait.
"""
from __future__ import annotations

import asyncio
import hmac
import logging

from fastapi import FastAPI, Request

from pdserve.serve.errors import APIError
from pdserve.serve.handoff import PROOF_HEADER, WAIT_SECONDS, handoff_proof, valid_key

logger = logging.getLogger("pdserve.serve")


def add_kv_routes(app: FastAPI, state, read_json) -> None:
    @app.post("/v1/kv/release")
    async def kv_release(request: Request):
        data = await read_json(request, state.cfg.max_body_bytes)
        params = data.get("kv_transfer_params")
        if not isinstance(params, dict) or not isinstance(params.get("transfer_id"), str):
            raise APIError(400, "kv_transfer_params: the object P returned (with its transfer_id and proof) is "
                                "required", "kv_transfer_params")
        tid = params["transfer_id"]
        result = await state.engine.call("release_lease", params)
        if result == "released":
            logger.info("KV lease of transfer %s released on request", tid)
            return {"status": "released", "transfer_id": tid}
        if result == "forbidden":
            raise APIError(403, "kv_transfer_params without a valid proof (the HMAC this prefill node made with its "
                                "KV token)", "kv_transfer_params")
        if result == "unsupported":
            raise APIError(400, "this server keeps no KV leases (not a P/D producer)", "kv_transfer_params")
        raise APIError(404, f"transfer {tid}: no open KV lease here (unknown, already released or expired)",
                       "kv_transfer_params")

    @app.get("/v1/kv/probe")
    async def kv_probe():
        probe = await state.engine.query("kv_probe", timeout=10.0)
        if probe is None:
            raise APIError(400, "this server signs no KV probes (not a P/D producer with a KV token)")
        return {"probe": probe}

    @app.post("/v1/kv/probe")
    async def kv_check_probe(request: Request):
        data = await read_json(request, state.cfg.max_body_bytes)
        why = await state.engine.call("check_kv_probe", data.get("probe"))
        if why is None:
            return {"ok": True}
        if why.startswith("this "):  # not a decode node, or no token here
            raise APIError(400 if "not a P/D decode node" in why else 409, why, "probe")
        raise APIError(409, why, "probe")

    @app.get("/v1/kv/handoff/{key}")
    async def kv_handoff(key: str, request: Request):
        if not valid_key(key):
            raise APIError(400, "handoff key: 32 lowercase hex digits", "key")
        proof = request.headers.get(PROOF_HEADER, "")
        if not state.kv_token or not hmac.compare_digest(proof.encode(), handoff_proof(state.kv_token, key).encode()):
            raise APIError(403, f"{PROOF_HEADER}: missing or not made with this node's KV token")
        try:
            params, why = await state.handoffs.take(key, WAIT_SECONDS)
        except LookupError as e:
            raise APIError(503, str(e))
        except (asyncio.TimeoutError, TimeoutError):
            raise APIError(504, f"no request with this handoff key ended here within {WAIT_SECONDS:.0f} s")
        return {"kv_transfer_params": params, "reason": why} if params is None else {"kv_transfer_params": params}
