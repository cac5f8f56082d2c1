"""The engine's P/D face: checks of a decode request's kv_transfer_params, leases, probes, transfer counters.

`LLMEngine` takes these from `EnginePDMixin`; they read its `config`, `connector`, `scheduler`, `kv`, `hf_config`,
`dtype` and `max_model_len`, and hold no state of their own. Invariant: a client's params act on this node only
after P's proof over them verifies with this node's KV token (`verified_params`); nothing unverified reaches the
connector, so a client can never make D dial a host of its choosing or end a lease it was not given.
"""
from __future__ import annotations

import contextlib
import hashlib
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from pdserve.model.loader import model_dims
from pdserve.sampling_params import SamplingParams
from pdserve.transfer.channel.proof import NOT_VERIFIED, PROBE_LABEL, malformed, prompt_hash, sign_params, verified_params

if TYPE_CHECKING:
    from pdserve.core.engine import Prompt


class EnginePDMixin:
    def check_remote_request(self, prompt: Prompt, params: Optional[SamplingParams], kv_transfer_params) -> dict:
        """What add_request would refuse (ValueError), refused before D asks P anything; the params as checked."""
        token_ids = self.tokenize(prompt)
        self.validate_prompt(token_ids, params or self.default_sampling_params())
        return self._check_kv_params(kv_transfer_params, token_ids)

    def _check_kv_params(self, params: dict, token_ids: list[int]) -> dict:
        """`params` as this engine acts on them: a consumer keeps only the fields P's proof covers."""
        if self.connector is None:
            raise ValueError("kv_transfer_params given, but this server has no KV connector")
        if not isinstance(params, dict):
            raise ValueError("kv_transfer_params must be an object")
        if params.get("do_remote_decode") and self.config.kv_transfer.kv_role == "kv_consumer":
            raise ValueError("kv_transfer_params: do_remote_decode sent to a decode node (kv_role kv_consumer), "
                             "which keeps no KV for others; send prefill requests to a kv_producer")
        if not params.get("do_remote_prefill"):
            return params
        signed = verified_params(params, self.config.kv_transfer.auth_token())
        if signed is None:
            raise ValueError(self._why_not_verified(params))
        if (why := malformed(signed)) is not None:
            raise ValueError(why)
        if signed["num_prompt_tokens"] != len(token_ids) or signed["prompt_hash"] != prompt_hash(token_ids):
            raise ValueError(f"kv_transfer_params are for another prompt: the prompt hash the prefill node signed "
                             f"does not match this request's {len(token_ids)} prompt tokens (params replayed for "
                             "another prompt, or P and D tokenize it differently)")
        return signed

    def _why_not_verified(self, params: dict) -> str:
        """D's 400 for params whose proof fails: a client's invention, or P and D holding different KV tokens."""
        cfg = self.config.kv_transfer
        if not cfg.auth_token():
            return (f"{NOT_VERIFIED}: this decode node has no KV token (kv_auth_token or PDSERVE_KV_TOKEN); give P "
                    "and D the same one")
        peer = f"{params.get('remote_host')}:{params.get('remote_port')}"
        peers = [c.kv_peers for c in (cfg.connectors or (cfg,))]
        if any(peer in p for p in peers):
            return (f"{NOT_VERIFIED}: they name {peer}, one of this node's kv_peers, so the likely cause is a KV "
                    "token mismatch: P and D must share kv_auth_token (or PDSERVE_KV_TOKEN)")
        return (f"{NOT_VERIFIED} (made up, altered, or signed with another KV token); pass on the params a "
                "prefill node returned, unchanged")

    def compat_fields(self) -> dict:
        """What a KV peer must share with this engine for its blocks to mean the same here."""
        d = model_dims(self.hf_config, self.max_model_len)
        model_dir = Path(self.config.model.model)
        weights = hashlib.sha256((model_dir / "config.json").read_bytes())
        for f in sorted(model_dir.glob("*.safetensors")):
            with open(f, "rb") as fh:
                weights.update(fh.read(1 << 20))  # header (names, shapes, offsets) and the first tensors
        tok = model_dir / "tokenizer.json"
        return {"architecture": self.hf_config["architectures"][0], "num_layers": d.num_layers,
                "num_kv_heads": d.num_kv_heads, "head_dim": d.head_dim,
                "dtype": str(self.dtype).removeprefix("torch."), "block_size": self.config.cache.block_size,
                "weights": weights.hexdigest()[:16],
                "tokenizer": hashlib.sha256(tok.read_bytes()).hexdigest()[:16] if tok.is_file() else ""}

    def transfer_stats(self) -> Optional[dict]:
        """KV transfer counters for /metrics, summed over a MultiConnector's children (None without a connector)."""
        kids = [c for c in getattr(self.connector, "children", [self.connector]) if getattr(c, "stats", None)]
        if not kids:
            return None
        out = {"bytes_sent": 0, "bytes_received": 0, "seconds_receiving": 0.0, "failures": {}, "nixl": {}}
        for c in kids:
            # under the connector's lock: a loader thread adding a failure cause mid-copy would break the iteration
            with getattr(c, "_lock", None) or contextlib.nullcontext():
                st = c.stats
                out["bytes_sent"] += st.bytes_sent
                out["bytes_received"] += st.bytes_received
                out["seconds_receiving"] += st.seconds_receiving
                for cause, n in dict(st.failures).items():
                    out["failures"][cause] = out["failures"].get(cause, 0) + n
            out["nixl"] = out["nixl"] or getattr(c, "nixl_stats", dict)()  # vLLM's NIXL series (NixlConnector)
        return {**out, "leased_blocks": self.num_leased_blocks()}

    def num_leased_blocks(self) -> int:
        return sum(len(self.kv.blocks_of(r)) for r in self.scheduler.leased)

    # ---- P/D: leases of requests no decode node took -------------------------------------------------------------
    def _connector_calls(self, name: str) -> list:
        """The connector's method `name`, or its children's (MultiConnector); [] without one."""
        if self.connector is None:
            return []
        return [f for c in getattr(self.connector, "children", [self.connector]) if (f := getattr(c, name, None))]

    def release_remote_kv(self, params, request_id: str) -> bool:
        """D: remote-prefill `params` of a request this engine refused, or never started loading: tell P to end its
        lease now (a bare `done`). Only for params whose proof holds, so a client can never make D dial a host of
        its choosing, and only to a peer in kv_peers. True if a `done` is on its way."""
        if not isinstance(params, dict) or not params.get("do_remote_prefill") or self.connector is None:
            return False
        signed = verified_params(params, self.config.kv_transfer.auth_token())
        return signed is not None and malformed(signed) is None and \
            any(f(signed, request_id) for f in self._connector_calls("release_remote"))

    def remote_lease_left(self, params: dict) -> float:
        """D: seconds P still holds the KV that checked `params` name (0.0: released, expired, or never made there),
        asked over the KV session; raises when P cannot be asked. A consumer without the call trusts the params."""
        calls = self._connector_calls("check_remote")
        return max(f(params) for f in calls) if calls else float(params.get("lease_seconds", 0.0))

    def release_lease(self, params) -> str:
        """P: end the lease that `params` (as P returned them, with P's proof) name: what the router asks when no
        decode node took the request. "released"; "unknown" (no such open lease: never made here, already released
        or expired); "forbidden" (no valid proof); "unsupported" (this engine keeps no leases)."""
        calls = self._connector_calls("release_lease")
        if not calls or self.config.kv_transfer.kv_role == "kv_consumer":
            return "unsupported"
        signed = verified_params(params, self.config.kv_transfer.auth_token())
        if signed is None:
            return "forbidden"
        tid, rid = str(signed.get("transfer_id", "")), str(signed.get("remote_request_id", ""))
        return "released" if any(f(tid, rid) for f in calls) else "unknown"

    # ---- P/D: the router's probe that P's proofs verify here ------------------------------------------------------
    def kv_probe(self) -> Optional[dict]:
        """P: a probe signed with this node's KV token (None: no KV server here)."""
        cfg = self.config.kv_transfer
        if self.connector is None or cfg.kv_role == "kv_consumer" or not cfg.auth_token():
            return None
        return sign_params({"probe": True, "remote_engine_id": cfg.engine_id}, cfg.auth_token(), PROBE_LABEL)

    def check_kv_probe(self, probe) -> Optional[str]:
        """D: None when a P's probe verifies with this node's KV token, else why not."""
        cfg = self.config.kv_transfer
        if self.connector is None or cfg.kv_role == "kv_producer":
            return "this node is not a P/D decode node (no kv_consumer connector)"
        if not cfg.auth_token():
            return "this decode node has no KV token (kv_auth_token or PDSERVE_KV_TOKEN)"
        if verified_params(probe, cfg.auth_token(), PROBE_LABEL) is None:
            return "the prefill node's probe does not verify here: P and D hold different KV tokens"
        return None
