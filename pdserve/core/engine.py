"""LLMEngine: tokenization, validation, and the schedule -> run -> update step (step_pipeline.py: synchronous, or with
the model's forward overlapping the host work around it, async scheduling).

Its outputs are built in output_processor.py; its P/D face (kv_transfer_params checks and proofs, leases, probes) is
the `KVGateway` (kv_gateway.py), and the scheduler's P/D half (loads, leases, held blocks) is `KVTransfers`
(kv_transfers.py): both own their state, and the connector sees neither, only a `ConnectorContext`.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional, Union

import torch

from pdserve.config import EngineConfig
from pdserve.core.kv_gateway import KVGateway, compat_fields
from pdserve.core.kv_cache_manager import KVCacheManager
from pdserve.core.output_processor import OutputProcessor
from pdserve.core.kv_transfers import KVTransfers
from pdserve.core.scheduler import Scheduler
from pdserve.core.step_pipeline import EngineStep, StepPipeline
from pdserve.core.tokenizer import load_tokenizer
from pdserve.model.hf_config import check_model_dir, model_dims, read_json_file
from pdserve.model.loader import resolve_dtype
from pdserve.model.sampler import Logprob
from pdserve.outputs import RequestOutput
from pdserve.request import Request, RequestStatus
from pdserve.sampling_params import SamplingParams
from pdserve.sched_output import cdiv
from pdserve.transfer.base import ConnectorContext
from pdserve.transfer.channel.handoffs import AWAIT_KV, HANDOFF_KEY, valid_key
from pdserve.transfer.channel.leases import sends_first_token
from pdserve.transfer.factory import make_connector
from pdserve.worker import memory
from pdserve.worker.model_runner import ModelRunner, kv_bytes_per_block
from pdserve.worker.openmp import release_thread_pool

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
        self.hf_config = check_model_dir(mc.model)
        self.device = resolve_device(mc.device)
        self.dtype = resolve_dtype(mc.dtype, self.hf_config, self.device)
        max_pos = self.hf_config.get("max_position_embeddings", 4096)
        self.max_model_len = mc.max_model_len or min(max_pos, 4096)
        if self.max_model_len > max_pos:
            raise ValueError(f"max_model_len {self.max_model_len} exceeds the model's max_position_embeddings "
                             f"{max_pos}")
        from_memory = config.cache.gpu_memory_utilization is not None and config.cache.num_gpu_blocks_override is None
        if from_memory and self.device.type != "cuda":
            raise ValueError("--gpu-memory-utilization sizes the KV cache on a CUDA device; on CPU use "
                             "--kv-cache-memory-gb")
        self.num_blocks = 2 if from_memory else self._num_blocks()  # a probe cache, resized once measured
        try:
            self.runner = ModelRunner(config, self.device, self.dtype, self.max_model_len, self.num_blocks)
        except (MemoryError, RuntimeError) as e:
            if not memory.out_of_memory(e):
                raise
            why = (str(e).splitlines() or [type(e).__name__])[0][:200]
            raise ValueError(f"the engine does not fit in the {self.device.type} device's free memory ({why}): the "
                             f"weights, a KV cache of {self.num_blocks} blocks (kv_cache_memory_gb or "
                             f"num_gpu_blocks_override) and buffers for max_num_seqs "
                             f"{config.scheduler.max_num_seqs} and max_model_len {self.max_model_len}; lower one of "
                             f"these") from None
        if from_memory:
            self.num_blocks = self._num_blocks(memory.profile(self.runner))
            self.runner.resize_kv(self.num_blocks)
        self.kv = KVCacheManager(self.num_blocks, config.cache.block_size, config.cache.enable_prefix_caching)
        self.runner.capture_graphs()
        if from_memory:
            memory.check_after_capture(config.cache.gpu_memory_utilization)
        self.tokenizer = load_tokenizer(mc.model)
        self.connector = make_connector(config.kv_transfer, self._connector_context)
        if self.connector is not None:
            self.connector.register_kv_caches(self.runner.kv_caches)
        policy = config.kv_transfer.kv_load_failure_policy if config.kv_transfer else "recompute"
        self.gateway = KVGateway(config.kv_transfer, self.connector)
        self.kv_load_wait = config.kv_transfer.kv_load_wait_ms / 1000 if config.kv_transfer else 0.0
        transfers = KVTransfers(self.kv, self.connector, policy, sign=self.gateway.sign)
        self.scheduler = Scheduler(config.scheduler, self.kv, self.max_model_len, config.speculative_config, transfers)
        self.generation_config = _read_json(Path(mc.model) / "generation_config.json")
        self.eos_token_ids = self._eos_ids()
        self.vocab_size = self.hf_config["vocab_size"]
        self._counter = 0
        self.output_processor = OutputProcessor(self.tokenizer, self.scheduler.finish_request, self._seal_params)
        self._admitted: list[RequestOutput] = []  # D: outputs of P's first tokens, out with the next step's
        wanted = config.scheduler.use_async_scheduling(self.device.type)
        on = wanted and config.speculative_config is None
        if wanted and not on:
            logger.info("async scheduling is off with speculative decoding (the next step's drafts are looked up in "
                        "the tokens this step makes): steps run one after another")
        self.steps = StepPipeline(self) if on else EngineStep(self)
        self._pipelines = {on: self.steps}  # each made once: the async one keeps its thread
        self._want_async: Optional[bool] = None  # want_async_scheduling(): applied at the next step()
        self._num_threads = torch.get_num_threads()  # the count the thread running the model must have

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
        have = memory.device_memory_bytes(self.device)
        if n * per_block > have:  # refused here: allocating it would fail with the allocator's traceback
            flag = "num_gpu_blocks_override" if cc.num_gpu_blocks_override is not None else "kv_cache_memory_gb"
            raise ValueError(f"{flag}: a KV cache of {n} blocks needs {n * per_block / 2**30:.1f} GiB, more than "
                             f"the {self.device.type} device's {have / 2**30:.1f} GiB")
        if n - 1 < per_seq:
            raise ValueError(f"the KV cache ({n - 1} blocks of {cc.block_size} tokens) cannot hold one max_model_len "
                             f"({self.max_model_len}) sequence; raise kv_cache_memory_gb or lower max_model_len")
        return n

    def _connector_context(self) -> ConnectorContext:
        """What a connector may know of this node (the weights are hashed: made only when a connector is)."""
        bs = self.config.cache.block_size
        return ConnectorContext(bs, compat_fields(self.config.model.model, self.hf_config, self.max_model_len,
                                                  self.dtype, bs))

    def _eos_ids(self) -> frozenset[int]:
        gc = self.generation_config  # not .get(key, default): the tokenizer's attribute would load transformers
        eos = gc["eos_token_id"] if "eos_token_id" in gc else self.tokenizer.eos_token_id
        eos = eos if isinstance(eos, list) else [eos]
        return frozenset(e for e in eos if e is not None)

    def default_sampling_params(self, **overrides) -> SamplingParams:
        return SamplingParams.from_generation_config(self.generation_config, **overrides)

    def tokenize(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer(prompt, add_special_tokens=True).input_ids
        return list(prompt)

    def add_request(self, prompt: Prompt, params: Optional[SamplingParams] = None, request_id: Optional[str] = None,
                    arrival_time: Optional[float] = None, kv_transfer_params: Optional[dict] = None,
                    cache_salt: Optional[str] = None) -> Request:
        """`cache_salt` (vLLM's): prefix-cache blocks are shared only among requests with the same salt."""
        req = self.make_request(prompt, params, request_id, arrival_time, kv_transfer_params, cache_salt)
        return self.add(req, prompt if isinstance(prompt, str) else None)

    def make_request(self, prompt: Prompt, params: Optional[SamplingParams] = None, request_id: Optional[str] = None,
                     arrival_time: Optional[float] = None, kv_transfer_params: Optional[dict] = None,
                     cache_salt: Optional[str] = None) -> Request:
        """The request checked (tokenized, validated, its kv_transfer_params verified: ValueError, the client's
        fault) and built, not yet added (the engine loop `add`s it)."""
        params = params or self.default_sampling_params()
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise ValueError(f"cache_salt: must be a non-empty string, got {cache_salt!r}"[:120])
        if params.n != 1:  # one request is one sequence; LLM.generate and the server fan n out (params.child)
            raise ValueError(f"n = {params.n}: the engine takes n = 1 requests; submit params.child(i) for i < n")
        token_ids = self.tokenize(prompt)
        self.validate_prompt(token_ids, params)
        awaits = isinstance(kv_transfer_params, dict) and AWAIT_KV in kv_transfer_params
        if params.prompt_logprobs is not None and (awaits or (kv_transfer_params or {}).get("do_remote_prefill")):
            raise ValueError(_NO_IMPORTED_PROMPT_LOGPROBS)
        kv_transfer_params, resumed = self._resumed_tokens(kv_transfer_params, len(token_ids), params)
        if awaits:  # P's params come with its KV, and are checked then (take_awaited)
            kv_transfer_params = self.gateway.check_await(kv_transfer_params)
        elif kv_transfer_params is not None:
            kv_transfer_params = self.gateway.check(kv_transfer_params, token_ids)
        if request_id is None:
            request_id = f"req-{self._counter}"
            self._counter += 1
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - len(token_ids)
        req = Request(request_id, token_ids, params, self.eos_token_ids, arrival_time, max_tokens=max_tokens,
                      kv_transfer_params=kv_transfer_params, cache_salt=cache_salt)
        req.bad_words_token_ids = params.bad_words_token_ids(self.tokenizer)  # tokenized by validate_prompt
        first = (kv_transfer_params or {}).get("first_token") if (kv_transfer_params or {}).get(
            "do_remote_prefill") else None
        if first is not None:
            self._take_first_token(req, first)
        for tok in resumed:
            req.append_output_token(tok)
        return req

    def _resumed_tokens(self, kv_transfer_params: Optional[dict], num_prompt: int,
                        params: SamplingParams) -> tuple[Optional[dict], list[int]]:
        """A stream resumed here after its node failed (the router's migration): `resume_token_ids` in the params
        are the tokens the client already has. They become the request's first outputs, as if sampled here: the
        prompt and they are prefilled locally, penalties, min_tokens, max_tokens and stop strings count them, and
        a seeded stream skips their draws. (params without the field, the ids) -- ValueError: the client's fault."""
        if not isinstance(kv_transfer_params, dict) or "resume_token_ids" not in kv_transfer_params:
            return kv_transfer_params, []
        rest = {k: v for k, v in kv_transfer_params.items() if k != "resume_token_ids"}
        ids = kv_transfer_params["resume_token_ids"]
        where = "kv_transfer_params.resume_token_ids"
        if not isinstance(ids, list) or any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t <
                                            self.vocab_size for t in ids):
            raise ValueError(f"{where}: must be a list of token ids in [0, {self.vocab_size})")
        if rest.get("do_remote_prefill") or rest.get("do_remote_decode"):
            raise ValueError(f"{where}: a resumed request is prefilled here, not served P/D")
        cap = params.max_tokens if params.max_tokens is not None else self.max_model_len - num_prompt
        if len(ids) >= cap or num_prompt + len(ids) >= self.max_model_len:
            raise ValueError(f"{where}: {len(ids)} tokens leave no room for another (max_tokens {cap}, prompt "
                             f"{num_prompt} of max_model_len {self.max_model_len})")
        return rest or None, ids

    def _take_first_token(self, req: Request, first) -> None:
        """D: the first token P sampled (in params P signed) becomes the request's first output, as if sampled here:
        P imports all n prompt tokens' KV and D's first step is a plain decode of it. Only when P drew it with the
        params that decide it here (`SamplingParams.first_token_key`); otherwise D replays the last prompt token
        (vLLM's way) and imports n - 1."""
        ok = isinstance(first, dict) and first.get("key") == req.sampling_params.first_token_key() and \
            isinstance(tok := first.get("id"), int) and not isinstance(tok, bool) and 0 <= tok < self.vocab_size
        if not ok:
            logger.debug("request %s: P's first token was drawn with other params: replayed here", req.request_id)
            req.kv_transfer_params = {k: v for k, v in req.kv_transfer_params.items() if k != "first_token"}
            return
        req.append_output_token(tok)

    def add(self, req: Request, prompt_text: Optional[str] = None) -> Request:
        """Add a request `make_request` built (and checked); `prompt_text`: the prompt as the client wrote it."""
        if self._id_in_use(req.request_id):
            raise ValueError(f"request id {req.request_id!r} is still in use (running, or its KV still leased to a "
                             "decode node or being released)")
        self.output_processor.add_request(req, prompt_text)
        try:
            self.scheduler.add_request(req)  # last: a request the scheduler holds is whole
        except BaseException:
            if self.scheduler.requests.get(req.request_id) is not req:  # not taken: it will make no output
                self.output_processor.drop(req.request_id)
            raise
        if req.num_output_tokens:  # P's first token (D) or a resumed stream's tokens go out now
            self._admitted += self._first_output(req)
        return req

    def take_awaited(self, fin) -> list[Request]:
        """D: the params awaited loads came with (`fin.params`, channel/handoffs.py), checked and made the requests'
        own before the loads are applied; a load whose params fail the check becomes `gone` (its KV is dropped
        unpublished and the prompt prefilled here: P's answer was authenticated, so nobody's fault that a client
        could cause). Returns the requests that now hold P's first token: their outputs go out once applied."""
        firsts = []
        for rid, (params, at) in fin.params.items():
            req = self.scheduler.requests.get(rid)
            if req is None or rid not in fin.done_recving:  # ended while it awaited: its blocks are freed as usual
                continue
            try:
                checked = self.gateway.check(params, req.prompt_token_ids)
            except ValueError as e:
                logger.warning("request %s: the prefill node's awaited params do not check: %s: prefilling it here",
                               rid, e)
                fin.done_recving.discard(rid)
                fin.gone.add(rid)
                continue
            req.kv_transfer_params = checked
            metrics = self.output_processor.states[rid].metrics
            metrics.arrival_time = metrics.kv_load_start_time = at  # D's part begins with P's params, as via HTTP
            if checked.get("first_token") is not None:
                self._take_first_token(req, checked["first_token"])
                if req.num_output_tokens:
                    firsts.append(req)
        return firsts

    def first_outputs(self, reqs: list[Request]) -> list[RequestOutput]:
        """D: the outputs of P's first tokens that awaited loads brought (`take_awaited`), once the loads applied."""
        return [out for req in reqs if not req.is_finished for out in self._first_output(req)]

    def _first_output(self, req: Request) -> list[RequestOutput]:
        """The output of the tokens a request arrives with (P's first token, a resumed stream's), through the same
        stops (EOS, stop ids, length, stop strings) and output state as tokens sampled here; tokens that end the
        request end it before any load (P's lease is released). Resumed tokens carry no logprobs: the client has
        them from the node that sampled them."""
        first = self._first_token_logprobs(req)
        req.num_new_tokens = req.num_output_tokens
        status = self.scheduler.check_stop(req, req.output_token_ids[-1])
        if status is not None:
            self.scheduler.finish_request(req.request_id, status)
        return self.output_processor.process([req], {req.request_id: first} if first is not None else {})

    @staticmethod
    def _first_token_logprobs(req: Request) -> Optional[dict]:
        if req.sampling_params.logprobs is None or "first_token" not in (req.kv_transfer_params or {}):
            return None
        entries = req.kv_transfer_params["first_token"].get("logprobs") or []
        return {int(t): Logprob(float(v), int(r)) for t, v, r in entries}

    def _seal_params(self, req: Request, first_logprobs: Optional[dict]) -> Optional[dict]:
        """P: the params of a finished do_remote_decode request as they leave: with its first token (id, logprobs,
        the key of the params that drew it) and signed again when it goes to D; None when that token ended the
        request (EOS, a stop, its real length cap: D has nothing to do, and the lease ends now) or when it kept no
        KV for D. With the router's handoff key, posted for the D that awaits them (channel/handoffs.py)."""
        sealed = self._sealed(req, first_logprobs) if req.kv_transfer_params_out is not None else None
        key = (req.kv_transfer_params or {}).get(HANDOFF_KEY)
        if valid_key(key) and self.connector is not None:
            why = "" if sealed is not None else req.error or (
                "its first token ended the request" if req.num_output_tokens and req.status !=
                RequestStatus.FINISHED_ABORTED else f"it ended {req.status.name.lower()} with no KV kept")
            self.connector.handoff(key, sealed, why)
        return sealed

    def _sealed(self, req: Request, first_logprobs: Optional[dict]) -> Optional[dict]:
        params = req.kv_transfer_params_out
        if req.hands_off_first_token and not req.handed_off:
            self.gateway.release_lease(params)
            return None
        if not req.output_token_ids or not sends_first_token(self.config.kv_transfer, req):
            return params
        lps = None if first_logprobs is None else [[t, lp.logprob, lp.rank] for t, lp in first_logprobs.items()]
        first = {"id": req.output_token_ids[0], "key": req.sampling_params.first_token_key(), "logprobs": lps}
        return self.gateway.sign({**params, "first_token": first})

    def _id_in_use(self, request_id: str) -> bool:
        """An id whose blocks are still held: reusing it would hand the new request the old one's KV (a P's lease
        that D may be reading, or blocks a D's loader is still writing)."""
        return request_id in self.scheduler.requests or self.scheduler.transfers.holds(request_id) or \
            request_id in self.kv.req_blocks

    def add_prefilled_request(self, prompt: Prompt, params: Optional[SamplingParams] = None,
                              request_id: Optional[str] = None, cache_salt: Optional[str] = None) -> Request:
        """D-side arrival driver without P (as vLLM's DecodeBenchConnector): the first n - 1 prompt tokens get real
        KV from a separate local prefill pass (after any prefix-cache hit), then the request waits to be scheduled
        as the one-token replay of its last prompt token, exactly as a request whose KV came from a prefill node."""
        if params is not None and params.prompt_logprobs is not None:
            raise ValueError(_NO_IMPORTED_PROMPT_LOGPROBS)
        req = self.add_request(prompt, params, request_id, cache_salt=cache_salt)
        n = req.num_prompt_tokens
        if n < 2:
            return req  # nothing to import: it is a fresh one-token prompt
        hits, num_hit = self.kv.get_computed_blocks(req)
        # the replay's slot (and its drafts' lookahead slots) too, as a remote load
        if not self.kv.allocate_slots(req, n - num_hit + self.scheduler.num_lookahead(req), hits):
            self._fail(req.request_id, "no free KV blocks")  # drops its per-request state
            raise RuntimeError(f"no free KV blocks to import {n - 1} tokens for {req.request_id}")
        req.num_computed_tokens = num_hit
        try:  # where the steps run, after the step in flight (its model and input buffers)
            self.steps.call(self.runner.prefill_kv, req, num_hit, n - 1, self.kv.block_table)
        except Exception as e:  # nothing of it may stay behind: not its blocks, not its per-request state
            self._fail(req.request_id, f"prefill for the import failed: {e}")
            raise
        req.num_computed_tokens = n - 1
        req.num_cached_tokens = num_hit
        req.num_external_tokens = n - 1 - num_hit
        self.kv.cache_blocks(req)
        self.scheduler.mark_imported(req)
        return req

    def set_num_threads(self, n: int) -> None:
        """CPU intra-op threads of the thread that runs the model: torch's OpenMP count is per thread, so with async
        scheduling it is set on the worker thread (after the step in flight), where a count set here would not go."""
        self._num_threads = n
        self.steps.call(torch.set_num_threads, n)

    @property
    def async_scheduling(self) -> bool:
        """Whether the steps in force overlap (StepPipeline): as configured, or as the governor last switched them."""
        return isinstance(self.steps, StepPipeline)

    def want_async_scheduling(self, on: bool) -> None:
        """Overlap on or off from the next step() on (the server's CPU governor, while other processes crowd the
        cores: worker/cpu_threads.py). A no-op with speculative decoding, which runs its steps one after another."""
        if self.config.speculative_config is None:
            self._want_async = on

    def _switch_steps(self, on: bool) -> list[RequestOutput]:
        """At a step boundary: the step in flight landed (its outputs returned), then the other pipeline, its model
        thread given the count in force. The tokens are the same either way (tests/core/test_async_scheduling.py)."""
        outputs = self.steps.drain()
        if self.device.type == "cpu":  # one OpenMP pool at a time (worker/openmp.py): the thread that hands the
            self.steps.call(release_thread_pool)  # model over frees its own, else regions wake threads via the kernel
        if on not in self._pipelines:
            self._pipelines[on] = StepPipeline(self) if on else EngineStep(self)
        self.steps = self._pipelines[on]
        self.steps.call(torch.set_num_threads, self._num_threads)
        logger.info("async scheduling %s", "on" if on else "off")
        return outputs

    def shutdown(self) -> None:
        for steps in self._pipelines.values():
            steps.shutdown()
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
        # these index the logits (bad words: a tokenizer larger than the model would ban past them)
        words = [t for w in params.bad_words_token_ids(self.tokenizer) or () for t in w]
        for name, ids in (("logit_bias", params.logit_bias or ()),
                          ("allowed_token_ids", params.allowed_token_ids or ()), ("bad_words", words)):
            bad = next((t for t in ids if t >= self.vocab_size), None)
            if bad is not None:
                raise ValueError(f"{name}: token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        n = len(token_ids)
        if n >= self.max_model_len:
            raise ValueError(f"prompt has {n} tokens but max_model_len is {self.max_model_len}")
        if params.max_tokens is not None and n + params.max_tokens > self.max_model_len:
            raise ValueError(f"prompt ({n} tokens) plus max_tokens ({params.max_tokens}) exceeds max_model_len "
                             f"({self.max_model_len})")

    def abort_request(self, request_id: str) -> Optional[RequestOutput]:
        # an output of P's first token not yet handed out must not follow the final one
        self._admitted = [o for o in self._admitted if o.request_id != request_id]
        req = self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED)
        return self.output_processor.make_output(req, []) if req is not None else None

    def has_unfinished_requests(self) -> bool:
        """Requests to run, outputs to hand out, a step in flight to land, or transfers (loads, leases) that still need
        the engine to poll."""
        return bool(self._admitted) or self.scheduler.has_unfinished() or self.steps.in_flight is not None or (
            self.connector is not None and self.connector.has_pending())

    def _fail(self, request_id: str, why: str) -> RequestOutput:
        return self.output_processor.make_output(
            self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ERROR, why), [])

    def fail_all(self, why: str) -> list[RequestOutput]:
        """The engine is dead (step_pipeline.EngineDeadError): every request ends with `why` as its error, its
        blocks freed (those a KV load or a reader may still use stay with KVTransfers until `shutdown`)."""
        self._admitted = []
        return [self._fail(rid, why) for rid in list(self.scheduler.requests)]

    def step(self) -> list[RequestOutput]:
        """Poll transfers, schedule, run, update, outputs (step_pipeline.py; with async scheduling the model's run
        overlaps the next step()'s host work, and the outputs come one step() later)."""
        if self._want_async is not None and self._want_async != self.async_scheduling:
            return self._switch_steps(self._want_async) + self.steps.step()
        return self.steps.step()

    def check_invariants(self) -> None:
        self.scheduler.check_invariants()
        self.steps.check_invariants()  # a step in flight is accounted for, not waited on
        # every request that left the scheduler made its final output, which dropped its output state
        leaked = set(self.output_processor.states) - set(self.scheduler.requests)
        assert not leaked, f"output state kept for requests no longer scheduled: {sorted(leaked)[:5]}"


_NO_IMPORTED_PROMPT_LOGPROBS = ("prompt_logprobs: not with imported KV (a P/D decode node's or the arrival driver's): "
                                "the prompt's logits are computed where its KV is")


def _read_json(path: Path) -> dict:
    return read_json_file(path) if path.is_file() else {}
