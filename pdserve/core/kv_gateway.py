"""The engine's P/D face, an object of its own: checks and signs kv_transfer_params, answers lease and probe calls,
and reads the connector's transfer counters. It holds the KV transfer config and the connector; nothing else of the
engine.

Invariant: a client's params act on this node only after P's proof over them verifies with this node's KV token
(`check`); nothing unverified reaches the connector, so a client can never make D dial a host of its choosing or end
a lease it was not given. The one exception is `await_kv` (D's own server's, for the router's early decode: P's KV
endpoint and a handoff key, `check_await`): the connector dials it only if it is one of its kv_peers (loopback
when none), authenticates with the KV token, and what P answers is verified by `check` before the request runs.
"""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Optional

from pdserve.model.hf_config import model_dims
from pdserve.transfer.channel.handoffs import AWAIT_KV, valid_key
from pdserve.transfer.channel.proof import NOT_VERIFIED, PROBE_LABEL, malformed, prompt_hash, sign_params, \
    verified_params


def compat_fields(model_dir: str, hf_config: dict, max_model_len: int, dtype, block_size: int) -> dict:
    """What a KV peer must share with this engine for its blocks to mean the same here."""
    d = model_dims(hf_config, max_model_len)
    model_dir = Path(model_dir)
    weights = hashlib.sha256((model_dir / "config.json").read_bytes())
    for f in sorted(model_dir.glob("*.safetensors")):
        with open(f, "rb") as fh:
            weights.update(fh.read(1 << 20))  # header (names, shapes, offsets) and the first tensors
    tok = model_dir / "tokenizer.json"
    return {"architecture": hf_config["architectures"][0], "num_layers": d.num_layers,
            "num_kv_heads": d.num_kv_heads, "head_dim": d.head_dim,
            "dtype": str(dtype).removeprefix("torch."), "block_size": block_size,
            "weights": weights.hexdigest()[:16],
            "tokenizer": hashlib.sha256(tok.read_bytes()).hexdigest()[:16] if tok.is_file() else ""}


class KVGateway:
    def __init__(self, kv_config, connector):
        self.cfg = kv_config  # KVTransferConfig, or None without P/D
        self.connector = connector

    @property
    def role(self) -> Optional[str]:
        return self.cfg.kv_role if self.cfg is not None else None

    def _token(self) -> str:
        return self.cfg.auth_token() if self.cfg is not None else ""

    def sign(self, params: dict) -> dict:
        """P vouches for the params it hands out: D checks this proof, whoever relays them."""
        return sign_params(params, self._token())

    # ---- a request's params -----------------------------------------------------------------------------------
    def check(self, params, token_ids: list[int]) -> dict:
        """`params` as this engine acts on them (ValueError: refused, the client's fault): a consumer keeps only the
        fields P's proof covers, and only for this very prompt."""
        if self.connector is None:
            raise ValueError("kv_transfer_params given, but this server has no KV connector")
        if not isinstance(params, dict):
            raise ValueError("kv_transfer_params must be an object")
        if params.get("do_remote_decode") and self.role == "kv_consumer":
            raise ValueError("kv_transfer_params: do_remote_decode sent to a decode node (kv_role kv_consumer), "
                             "which keeps no KV for others; send prefill requests to a kv_producer")
        if not params.get("do_remote_prefill"):
            return params
        signed = verified_params(params, self._token())
        if signed is None:
            raise ValueError(self._why_not_verified(params))
        if (why := malformed(signed)) is not None:
            raise ValueError(why)
        if signed["num_prompt_tokens"] != len(token_ids) or signed["prompt_hash"] != prompt_hash(token_ids):
            raise ValueError(f"kv_transfer_params are for another prompt: the prompt hash the prefill node signed "
                             f"does not match this request's {len(token_ids)} prompt tokens (params replayed for "
                             "another prompt, or P and D tokenize it differently)")
        return signed

    def check_await(self, params: dict) -> dict:
        """D: `{"await_kv": {"host", "port", "key"}}` (P's KV endpoint, the handoff key) as the request's params
        while P prefills (channel/handoffs.py); ValueError when malformed or when this node cannot await."""
        spec = params.get(AWAIT_KV)
        if set(params) != {AWAIT_KV} or not isinstance(spec, dict) or set(spec) != {"host", "port", "key"} or \
                not isinstance(spec["host"], str) or not isinstance(spec["port"], int) or \
                isinstance(spec["port"], bool) or not valid_key(spec["key"]):
            raise ValueError(f"kv_transfer_params.{AWAIT_KV}: {{\"host\", \"port\": the prefill node's KV endpoint, "
                             "\"key\": 32 hex digits}, alone")
        if self.connector is None or not self.connector.can_await:
            raise ValueError(f"kv_transfer_params.{AWAIT_KV}: this node's KV connector cannot await a prefill node")
        return {"do_remote_prefill": True, AWAIT_KV: dict(spec)}

    def _why_not_verified(self, params: dict) -> str:
        """D's 400 for params whose proof fails: a client's invention, or P and D holding different KV tokens."""
        if not self._token():
            return (f"{NOT_VERIFIED}: this decode node has no KV token (kv_auth_token or PDSERVE_KV_TOKEN); give P "
                    "and D the same one")
        peer = f"{params.get('remote_host')}:{params.get('remote_port')}"
        peers = [c.kv_peers for c in (self.cfg.connectors or (self.cfg,))]
        if any(peer in p for p in peers):
            return (f"{NOT_VERIFIED}: they name {peer}, one of this node's kv_peers, so the likely cause is a KV "
                    "token mismatch: P and D must share kv_auth_token (or PDSERVE_KV_TOKEN)")
        return (f"{NOT_VERIFIED} (made up, altered, or signed with another KV token); pass on the params a "
                "prefill node returned, unchanged")

    # ---- leases -----------------------------------------------------------------------------------------------
    def release_remote_kv(self, request_id: str, params) -> bool:
        """D: remote-prefill `params` of a request this engine refused, or never started loading: tell P to end its
        lease now (a bare `done`). Only for params whose proof holds, so a client can never make D dial a host of
        its choosing, and only to a peer in kv_peers. True if a `done` is on its way."""
        if not isinstance(params, dict) or not params.get("do_remote_prefill") or self.connector is None:
            return False
        signed = verified_params(params, self._token())
        return signed is not None and malformed(signed) is None and self.connector.release_remote(signed, request_id)

    def release_lease(self, params) -> str:
        """P: end the lease that `params` (as P returned them, with P's proof) name: what the router asks when no
        decode node took the request. "released"; "unknown" (no such open lease: never made here, already released
        or expired); "forbidden" (no valid proof); "unsupported" (this engine keeps no leases)."""
        if self.connector is None or self.role == "kv_consumer":
            return "unsupported"
        signed = verified_params(params, self._token())
        if signed is None:
            return "forbidden"
        tid, rid = str(signed.get("transfer_id", "")), str(signed.get("remote_request_id", ""))
        released = self.connector.release_lease(tid, rid)
        return "unsupported" if released is None else "released" if released else "unknown"

    # ---- the router's probe that P's proofs verify here -------------------------------------------------------
    def kv_probe(self) -> Optional[dict]:
        """P: a probe signed with this node's KV token (None: no KV server here)."""
        if self.connector is None or self.role == "kv_consumer" or not self._token():
            return None
        return sign_params({"probe": True, "remote_engine_id": self.cfg.engine_id}, self._token(), PROBE_LABEL)

    def check_kv_probe(self, probe) -> Optional[str]:
        """D: None when a P's probe verifies with this node's KV token, else why not."""
        if self.connector is None or self.role == "kv_producer":
            return "this node is not a P/D decode node (no kv_consumer connector)"
        if not self._token():
            return "this decode node has no KV token (kv_auth_token or PDSERVE_KV_TOKEN)"
        if verified_params(probe, self._token(), PROBE_LABEL) is None:
            return "the prefill node's probe does not verify here: P and D hold different KV tokens"
        return None

    # ---- counters ---------------------------------------------------------------------------------------------
    def transfer_stats(self, leased_blocks: int) -> Optional[dict]:
        """KV transfer counters for /metrics, summed over a MultiConnector's children, with the blocks this node
        holds for readers (`KVTransfers.num_leased_blocks`); None without a connector."""
        stats = self.connector.transfer_stats() if self.connector is not None else None
        return None if stats is None else {**stats, "leased_blocks": leased_blocks}
