"""LLMEngine: tokenization, validation, and the schedule -> run -> update step (outputs: output_processor.py)."""
from __future__ import annotations

import contextlib
import json
import logging
import time
from pathlib import Path
from typing import Optional, Union

import torch

from pdserve.config import EngineConfig
from pdserve.core.kv_cache_manager import KVCacheManager, cdiv
from pdserve.core.output_processor import OutputProcessor
from pdserve.core.scheduler import Scheduler
from pdserve.detokenizer import IncrementalDetokenizer
from pdserve.model.loader import model_dims, read_hf_config, resolve_dtype
from pdserve.outputs import RequestMetrics, RequestOutput
from pdserve.request import Request, RequestStatus
from pdserve.sampling_params import SamplingParams
from pdserve.transfer.base import make_connector
from pdserve.transfer.proof import NOT_VERIFIED, PROBE_LABEL, malformed, prompt_hash, sign_params, verified_params
from pdserve.worker import memory
from pdserve.worker.model_runner import ModelRunner, kv_bytes_per_block

logger = logging.getLogger("pdserve.engine")

Prompt = Union[str, list[int]]


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        mc = config.model
        self.hf_config = read_hf_config(mc.model)
        self.device = resolve_device(mc.device)
        self.dtype = resolve_dtype(mc.dtype, self.hf_config, self.device)
        max_pos = self.hf_config.get("max_position_embeddings", 4096)
        self.max_model_len = mc.max_model_len or min(max_pos, 4096)
        if self.max_model_len > max_pos:
            raise ValueError(f"max_model_len {self.max_model_len} exceeds the model's max_position_embeddings {max_pos}")
        from_memory = config.cache.gpu_memory_utilization is not None and config.cache.num_gpu_blocks_override is None
        if from_memory and self.device.type != "cuda":
            raise ValueError("--gpu-memory-utilization sizes the KV cache on a CUDA device; on CPU use "
                             "--kv-cache-memory-gb")
        self.num_blocks = 2 if from_memory else self._num_blocks()  # a probe cache, resized once measured
        self.runner = ModelRunner(config, self.device, self.dtype, self.max_model_len, self.num_blocks)
        if from_memory:
            self.num_blocks = self._num_blocks(memory.profile(self.runner))
            self.runner.resize_kv(self.num_blocks)
        self.kv = KVCacheManager(self.num_blocks, config.cache.block_size, config.cache.enable_prefix_caching)
        self.runner.capture_graphs()
        if from_memory:
            memory.check_after_capture(config.cache.gpu_memory_utilization)
        self.tokenizer = load_tokenizer(mc.model)
        self.connector = make_connector(config.kv_transfer, self)
        if self.connector is not None:
            self.connector.register_kv_caches(self.runner.kv_caches)
        policy = config.kv_transfer.kv_load_failure_policy if config.kv_transfer else "recompute"
        self.scheduler = Scheduler(config.scheduler, self.kv, self.max_model_len, self.connector, policy,
                                   config.speculative_config)
        self.generation_config = _read_json(Path(mc.model) / "generation_config.json")
        self.eos_token_ids = self._eos_ids()
        self.vocab_size = self.hf_config["vocab_size"]
        self._counter = 0
        self.output_processor = OutputProcessor(self.tokenizer, self.scheduler.finish_request)

    def _num_blocks(self, profile: Optional[memory.MemoryProfile] = None) -> int:
        """KV blocks, the null block included: the override, else what `profile` leaves under
        gpu_memory_utilization (CUDA), else kv_cache_memory_gb; capped at max_num_seqs full-length sequences."""
        cc = self.config.cache
        per_seq = cdiv(self.max_model_len, cc.block_size)
        per_block = kv_bytes_per_block(model_dims(self.hf_config, self.max_model_len), cc.block_size, self.dtype)
        cap = self.config.scheduler.max_num_seqs * per_seq
        if cc.num_gpu_blocks_override is not None:
            n = cc.num_gpu_blocks_override
        elif profile is not None:
            return memory.num_blocks_for(profile, cc.gpu_memory_utilization, per_block, cap, per_seq)
        else:
            n = min(int(cc.kv_cache_memory_gb * 2**30) // per_block, cap) + 1
        if n - 1 < per_seq:
            raise ValueError(f"the KV cache ({n - 1} blocks of {cc.block_size} tokens) cannot hold one max_model_len "
                             f"({self.max_model_len}) sequence; raise kv_cache_memory_gb or lower max_model_len")
        return n

    def _eos_ids(self) -> frozenset[int]:
        eos = self.generation_config.get("eos_token_id", self.tokenizer.eos_token_id)
        eos = eos if isinstance(eos, list) else [eos]
        return frozenset(e for e in eos if e is not None)

    def default_sampling_params(self, **overrides) -> SamplingParams:
        return SamplingParams.from_generation_config(self.generation_config, **overrides)

    def tokenize(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer(prompt, add_special_tokens=True).input_ids
        return list(prompt)

    def add_request(self, prompt: Prompt, params: Optional[SamplingParams] = None, request_id: Optional[str] = None,
                    arrival_time: Optional[float] = None, kv_transfer_params: Optional[dict] = None) -> Request:
        params = params or self.default_sampling_params()
        token_ids = self.tokenize(prompt)
        self.validate_prompt(token_ids, params)
        if kv_transfer_params is not None:
            kv_transfer_params = self._check_kv_params(kv_transfer_params, token_ids)
        if request_id is None:
            request_id = f"req-{self._counter}"
            self._counter += 1
        elif self._id_in_use(request_id):
            raise ValueError(f"request id {request_id!r} is still in use (running, or its KV still leased to a decode "
                             "node or being released)")
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - len(token_ids)
        req = Request(request_id, token_ids, params, self.eos_token_ids, arrival_time, max_tokens=max_tokens,
                      kv_transfer_params=kv_transfer_params)
        req.detok = IncrementalDetokenizer(
            self.tokenizer, stop=params.stop, include_stop_str_in_output=params.include_stop_str_in_output,
            skip_special_tokens=params.skip_special_tokens, prompt_token_ids=token_ids, min_tokens=params.min_tokens)
        req.metrics = RequestMetrics(req.arrival_time,
                                     kv_remote=bool((kv_transfer_params or {}).get("do_remote_prefill")))
        req.prompt_text = prompt if isinstance(prompt, str) else None
        self.scheduler.add_request(req)  # last: a request the scheduler holds is whole
        return req

    def _id_in_use(self, request_id: str) -> bool:
        """An id whose blocks are still held: reusing it would hand the new request the old one's KV (a P's lease
        that D may be reading, or blocks a D's loader is still writing)."""
        s = self.scheduler
        return any(request_id in d for d in (s.requests, s.leased, s.deferred_free, self.kv.req_blocks))

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

    def add_prefilled_request(self, prompt: Prompt, params: Optional[SamplingParams] = None,
                              request_id: Optional[str] = None) -> Request:
        """D-side arrival driver without P (as vLLM's DecodeBenchConnector): the first n - 1 prompt tokens get real
        KV from a separate local prefill pass (after any prefix-cache hit), then the request waits to be scheduled
        as the one-token replay of its last prompt token, exactly as a request whose KV came from a prefill node."""
        req = self.add_request(prompt, params, request_id)
        n = req.num_prompt_tokens
        if n < 2:
            return req  # nothing to import: it is a fresh one-token prompt
        hits, num_hit = self.kv.get_computed_blocks(req)
        # the replay's slot (and its drafts' lookahead slots) too, as a remote load
        if not self.kv.allocate_slots(req, n - num_hit + self.scheduler.num_lookahead(req), hits):
            self._fail(req.request_id, "no free KV blocks")  # drops its per-request state
            raise RuntimeError(f"no free KV blocks to import {n - 1} tokens for {req.request_id}")
        req.num_computed_tokens = num_hit
        try:
            self.runner.prefill_kv(req, num_hit, n - 1, self.kv.block_table)
        except Exception as e:  # nothing of it may stay behind: not its blocks, not its per-request state
            self._fail(req.request_id, f"prefill for the import failed: {e}")
            raise
        req.num_computed_tokens = n - 1
        req.num_cached_tokens = num_hit
        self.kv.cache_blocks(req)
        self.scheduler.mark_imported(req)
        return req

    def compat_fields(self) -> dict:
        """What a KV peer must share with this engine for its blocks to mean the same here."""
        import hashlib
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

    def shutdown(self) -> None:
        if self.connector is not None:
            self.connector.shutdown()

    def spec_decode_stats(self) -> Optional[dict]:
        """Speculative decoding counters since start (None without --speculative-config)."""
        return self.runner.spec_stats.snapshot() if self.config.speculative_config else None

    def graph_stats(self) -> dict:
        """Graph-mode step counts since start: FULL / non-FULL, by (mode, reason), padded tokens."""
        return self.runner.graph_stats.snapshot()

    def validate_prompt(self, token_ids: list[int], params: SamplingParams) -> None:
        if not token_ids:
            raise ValueError("prompt is empty")
        bad = next((t for t in token_ids if not isinstance(t, int) or not 0 <= t < self.hf_config["vocab_size"]), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad!r} is outside the vocabulary [0, {self.hf_config['vocab_size']})")
        bad = next((t for t in params.stop_token_ids if t >= self.vocab_size), None)
        if bad is not None:  # the min_tokens ban indexes the logits with them
            raise ValueError(f"stop_token_ids: token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        n = len(token_ids)
        if n >= self.max_model_len:
            raise ValueError(f"prompt has {n} tokens but max_model_len is {self.max_model_len}")
        if params.max_tokens is not None and n + params.max_tokens > self.max_model_len:
            raise ValueError(f"prompt ({n} tokens) plus max_tokens ({params.max_tokens}) exceeds max_model_len "
                             f"({self.max_model_len})")

    def abort_request(self, request_id: str) -> Optional[RequestOutput]:
        req = self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED)
        return self.output_processor.make_output(req, []) if req is not None else None

    def has_unfinished_requests(self) -> bool:
        """Requests to run, or transfers (loads, leases) that still need the engine to poll."""
        return self.scheduler.has_unfinished() or (self.connector is not None and self.connector.has_pending())

    def _poll_transfers(self) -> list[RequestOutput]:
        if self.connector is None:
            return []
        fin = self.connector.get_finished()
        now = time.monotonic()
        for rid in fin.done_recving | set(fin.failed):
            if (req := self.scheduler.requests.get(rid)) is not None:
                req.metrics.kv_load_end_time = now
                req.metrics.kv_loaded = rid in fin.done_recving
        failed = self.scheduler.process_transfers(fin)
        return [self.output_processor.make_output(r, []) for r in failed if r is not None]

    def _fail(self, request_id: str, why: str) -> RequestOutput:
        return self.output_processor.make_output(
            self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ERROR, why), [])

    def step(self) -> list[RequestOutput]:
        transfer_outputs = self._poll_transfers()
        out = self.scheduler.schedule()
        if self.connector is not None:
            meta = self.connector.build_connector_meta()
            now = time.monotonic()
            for job in meta.loads:
                if job.dst_blocks:  # not a bare `done` for a prompt D had cached: the request waits for this one
                    self.scheduler.requests[job.request_id].metrics.kv_load_start_time = now
            self.connector.start_load_kv(meta)
        if not out.rows:
            if self.has_unfinished_requests() and not transfer_outputs:
                time.sleep(0.001)  # only transfers in flight: poll, do not spin
            return transfer_outputs
        now = time.monotonic()
        for row in out.rows:
            m = row.request.metrics
            m.first_scheduled_time = m.first_scheduled_time or now
        try:
            result = self.runner.execute(out.rows, self.kv.block_table)
        except Exception as e:  # a failed step fails its requests, never the engine
            logger.exception("model step failed")
            return transfer_outputs + [self._fail(r.request.request_id, f"model step failed: {e}") for r in out.rows]
        updated = self.scheduler.update_from_output(out, result.sampled)
        lp_by_req = {row.request.request_id: lp for row, lp in zip(out.rows, result.logprobs) if lp is not None}
        return transfer_outputs + self.output_processor.process(updated, lp_by_req)

    def check_invariants(self) -> None:
        self.scheduler.check_invariants()

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


def load_tokenizer(model_dir: str):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(model_dir)


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}
