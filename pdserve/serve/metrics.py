"""Prometheus metrics of one server, in a per-app registry.

A series vLLM has is under vLLM's name and labels (`vllm:num_requests_running{model_name, engine="0"}`, ...), with its
buckets, so dashboards, autoscalers and load balancers built for vLLM read a pdserve node as they read a vLLM one.
What only pdserve has (the decode-graph steps and why a step fell off FULL, KV transfer counters, spec decode's
placeholders) is `pdserve_*`, with the same labels.

Request-level series (tokens, finish reasons, latency histograms) are observed as the engine's step outputs reach the
event loop; engine-level series (running/waiting requests, KV usage, preemptions, prefix cache, graph steps) come from
a custom collector over a snapshot the engine loop takes at scrape time, so the counts are exact. A scrape whose
snapshot the engine did not answer has no engine-level series (a frozen gauge would read as a live one).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

from prometheus_client import (GC_COLLECTOR, PLATFORM_COLLECTOR, PROCESS_COLLECTOR, CollectorRegistry, Counter, Gauge,
                               Histogram, generate_latest)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
FINISH_REASONS = ("stop", "length", "abort", "error")
PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")  # vLLM's PromptTokenStats
LABELS = ["model_name", "engine"]
ENGINE = "0"  # one engine per server (vLLM's engine index, without data parallelism)

# vLLM's (vllm/v1/metrics/buckets.py, 0.32)
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0)


def _1_2_5(top: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to `top` (vLLM's build_1_2_5_buckets, for token counts)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > top:
                return out
            out.append(float(m * scale))
        scale *= 10


_ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_PREEMPTION_BUCKETS = (1, 2, 3, 4, 5, 10, 20)
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                    480.0, 960.0, 1920.0, 7680.0)


class EngineCollector:
    """Reads the engine snapshot set by `update()` (the engine loop's `stats` query) at collection time."""

    def __init__(self, model_name: str):
        self.lab = [model_name, ENGINE]
        self.stats: Optional[dict] = None

    def update(self, stats: Optional[dict]) -> None:
        self.stats = stats

    def _one(self, cls, name: str, doc: str, value, extra: tuple = ()):
        m = cls(name, doc, labels=LABELS + [k for k, _ in extra])
        m.add_metric(self.lab + [v for _, v in extra], value)
        return m

    def collect(self):
        s = self.stats
        if s is None:
            return
        g, c = GaugeMetricFamily, CounterMetricFamily
        yield self._one(g, "vllm:num_requests_running", "Number of requests in model execution batches.", s["running"])
        yield self._one(g, "vllm:num_requests_waiting", "Number of requests waiting to be processed (a decode "
                        "node's included while their KV loads).",
                        s["waiting"])
        by = g("vllm:num_requests_waiting_by_reason", "Number of waiting requests by reason: 'capacity' = waiting "
               "for a seat or KV blocks; 'deferred' = waiting on a KV transfer. Sums to "
               "vllm:num_requests_waiting.", labels=LABELS + ["reason"])
        by.add_metric(self.lab + ["capacity"], s["waiting"] - s["waiting_deferred"])
        by.add_metric(self.lab + ["deferred"], s["waiting_deferred"])
        yield by
        yield self._one(g, "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", s["kv_usage"])
        yield self._one(c, "vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                        s["preemptions"])
        yield self._one(c, "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried "
                        "tokens.", s.get("prefix_cache_queries", 0))
        yield self._one(c, "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                        s.get("prefix_cache_hits", 0))
        ext = s.get("external_prefix_cache")
        if ext is not None:
            yield self._one(c, "vllm:external_prefix_cache_queries", "External prefix cache queries from KV "
                            "connector cross-instance cache sharing, in terms of number of queried tokens.", ext[0])
            yield self._one(c, "vllm:external_prefix_cache_hits", "External prefix cache hits from KV connector "
                            "cross-instance cache sharing, in terms of number of cached tokens.", ext[1])
        graph = s["graph"]
        steps = c("pdserve_cudagraph_steps", "Engine steps by graph runtime mode (FULL, PIECEWISE, NONE) and the "
                  "reason a step was not FULL (none for FULL).", labels=LABELS + ["mode", "reason"])
        for key, n in graph["steps"].items():
            steps.add_metric(self.lab + key.split("/", 1), n)
        yield steps
        yield self._one(c, "pdserve_cudagraph_padded_tokens", "Padding tokens added to reach a captured batch size.",
                        graph["padded_tokens"])
        yield self._one(g, "pdserve_cudagraph_info", "Graph device and whether real CUDA graphs were captured (on "
                        "CPU FULL steps run the same callable eagerly).", 1,
                        (("device", str(graph["device"])), ("captured", str(bool(graph["captured"])).lower())))
        yield from self._transfer(s.get("transfer"))
        yield from self._spec(s.get("spec"))

    def _spec(self, sd: Optional[dict]):
        """vLLM's speculative decoding series (SpecDecodingProm), plus placeholders, with --speculative-config."""
        if not sd:
            return
        for key, doc in (("num_drafts", "Number of spec decoding drafts."),
                         ("num_draft_tokens", "Number of draft tokens."),
                         ("num_accepted_tokens", "Number of accepted tokens.")):
            yield self._one(CounterMetricFamily, f"vllm:spec_decode_{key}", doc, sd[key])
        yield self._one(CounterMetricFamily, "pdserve_spec_decode_num_placeholder_tokens",
                        "Scheduled draft slots with no draft (always rejected).", sd["num_placeholder_tokens"])
        per = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft "
                                  "position.", labels=LABELS + ["position"])
        for pos, n in enumerate(sd["accepted_per_pos"]):
            per.add_metric(self.lab + [str(pos)], n)
        yield per

    def _transfer(self, t: Optional[dict]):
        """KV transfer series, on servers with a KV connector (P/D)."""
        if not t:
            return
        c = CounterMetricFamily
        for name, doc, key in (("pdserve_kv_transfer_sent_bytes", "Bytes of KV sent to decode nodes.", "bytes_sent"),
                               ("pdserve_kv_transfer_received_bytes", "Bytes of KV received from prefill nodes.",
                                "bytes_received"),
                               ("pdserve_kv_transfer_receive_seconds", "Seconds spent receiving KV.",
                                "seconds_receiving")):
            yield self._one(c, name, doc, t.get(key, 0))
        f = c("pdserve_kv_transfer_failures", "KV loads that failed, by reason (lease_gone: the prefill node no "
              "longer held the KV, so this node prefilled the request).", labels=LABELS + ["reason"])
        for reason, n in sorted((t.get("failures") or {}).items()):
            f.add_metric(self.lab + [str(reason)], n)
        yield f
        yield self._one(GaugeMetricFamily, "pdserve_kv_leased_blocks", "KV blocks held under a lease for decode "
                        "nodes to read.", t.get("leased_blocks", 0))
        yield self._one(GaugeMetricFamily, "pdserve_kv_orphaned_blocks", "KV blocks held with no live request "
                        "behind them, not freed yet: on a prefill node leases that ended or expired, on a decode "
                        "node blocks a KV load may still write for a request that no longer owns them. 0 at rest.",
                        t.get("orphaned_blocks", 0))
        h = t.get("reclaim_seconds")
        if h is not None:
            m = HistogramMetricFamily("pdserve_kv_reclaim_seconds", "Histogram of seconds from when KV blocks "
                                      "were held for no live request (a lease ended or expired, a load's request "
                                      "gone) to their free.", labels=LABELS)
            m.add_metric(self.lab, [(repr(float(le)), c) for le, c in h["buckets"]] + [("+Inf", h["count"])],
                         h["sum"])
            yield m
        yield from self._nixl(t.get("nixl"))

    _NIXL_DOCS = {"xfer_time_seconds": "Histogram of transfer duration for NIXL KV Cache transfers.",
                  "post_time_seconds": "Histogram of transfer post time for NIXL KV Cache transfers.",
                  "bytes_transferred": "Histogram of bytes transferred per NIXL KV Cache transfers.",
                  "num_descriptors": "Histogram of number of descriptors per NIXL KV Cache transfers.",
                  "num_failed_transfers": "Number of failed NIXL KV Cache transfers.",
                  "num_failed_notifications": "Number of failed NIXL KV Cache notifications.",
                  "num_kv_expired_reqs": "Number of requests whose KV blocks P freed at a deadline, never read."}

    def _nixl(self, n: Optional[dict]):
        """vLLM's NIXL series (NixlPromMetrics), on servers with a NixlConnector."""
        if not n:
            return
        for key, h in n["histograms"].items():
            m = HistogramMetricFamily(f"vllm:nixl_{key}", self._NIXL_DOCS[key], labels=LABELS)
            m.add_metric(self.lab, [(repr(float(le)), c) for le, c in h["buckets"]] + [("+Inf", h["count"])],
                         h["sum"])
            yield m
        for key, v in n["counters"].items():
            yield self._one(CounterMetricFamily, f"vllm:nixl_{key}", self._NIXL_DOCS[key], v)


class ServerMetrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        self.engine = EngineCollector(model_name)
        self.registry.register(self.engine)
        for c in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):  # process_*, python_*: as vLLM's registry
            self.registry.register(c)
        lab, r, self._lab = LABELS, self.registry, [model_name, ENGINE]

        def hist(name, doc, buckets):
            return Histogram(name, doc, lab, buckets=buckets, registry=r).labels(*self._lab)

        self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", lab,
                                     registry=r).labels(*self._lab)
        by_source = Counter("vllm:prompt_tokens_by_source", "Number of prompt tokens by source (local_compute + "
                            "local_cache_hit + external_kv_transfer = vllm:prompt_tokens).", lab + ["source"],
                            registry=r)
        self.prompt_by_source = {src: by_source.labels(*self._lab, src) for src in PROMPT_SOURCES}
        self.prompt_cached = Counter("vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + "
                                     "external).", lab, registry=r).labels(*self._lab)
        self.generation_tokens = Counter("vllm:generation_tokens", "Number of generation tokens processed.", lab,
                                         registry=r).labels(*self._lab)
        self._success_family = Counter("vllm:request_success", "Count of successfully processed requests.",
                                       lab + ["finished_reason"], registry=r)
        self.success = {reason: self._success_family.labels(*self._lab, reason) for reason in FINISH_REASONS}
        self.ttft = hist("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                         _TTFT_BUCKETS)
        self.itl = hist("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                        _ITL_BUCKETS)
        self.tpot = hist("vllm:request_time_per_output_token_seconds", "Histogram of time_per_output_token_seconds "
                         "per request.", _ITL_BUCKETS)
        self.e2e = hist("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                        _REQUEST_BUCKETS)
        self.queue = hist("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request "
                          "(a decode node's wait for the prompt KV included).", _REQUEST_BUCKETS)
        self.prefill = hist("vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for "
                            "request (on a decode node with imported KV, its one-token replay).", _REQUEST_BUCKETS)
        self.decode = hist("vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for "
                           "request.", _REQUEST_BUCKETS)
        self.req_prompt = self.req_generation = self.req_max_tokens = self.req_prefill_kv = None  # engine_ready()
        self.iteration = hist("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
                              _ITERATION_BUCKETS)
        self.req_preemptions = hist("vllm:request_num_preemptions", "Histogram of the number of times a request was "
                                    "preempted.", _PREEMPTION_BUCKETS)
        self._step_tokens = 0
        self.inference = hist("vllm:request_inference_time_seconds", "Histogram of time spent in RUNNING phase for "
                              "request.", _REQUEST_BUCKETS)

    def engine_ready(self, max_model_len: int, cache_config=None, num_gpu_blocks: int = 0) -> None:
        """The token-count histograms, whose buckets stop at max_model_len, and vLLM's cache_config_info: known once
        the engine has started (no request is admitted before)."""
        if self.req_prompt is not None:
            return
        if cache_config is not None:  # as vLLM's: the config's fields as labels, on a gauge set to 1, no model_name
            info = {k: str(v) for k, v in dataclasses.asdict(cache_config).items()}
            info.update(num_gpu_blocks=str(num_gpu_blocks), engine=ENGINE)
            Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", list(info),
                  registry=self.registry).labels(**info).set(1)

        def hist(name, doc):
            return Histogram(name, doc, LABELS, buckets=_1_2_5(max_model_len), registry=self.registry).labels(
                *self._lab)
        self.req_prompt = hist("vllm:request_prompt_tokens", "Number of prefill tokens processed.")
        self.req_generation = hist("vllm:request_generation_tokens", "Number of generation tokens processed.")
        self.req_max_tokens = hist("vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.")
        self.req_prefill_kv = hist("vllm:request_prefill_kv_computed_tokens", "Histogram of new KV tokens computed "
                                   "during prefill (excluding cached tokens, local or imported).")

    def end_step(self) -> None:
        """After one engine step's records: the tokens it computed (vLLM's iteration tokens: prompt tokens of the
        requests whose prefill it finished, not cached or imported, plus the tokens it generated)."""
        if self._step_tokens:
            self.iteration.observe(self._step_tokens)
            self._step_tokens = 0

    def on_tokens(self, state, rec, t: float) -> None:
        """Called for every engine record of a request, in order. `state` carries arrival/first/last times; its
        prefill_time and num_cached_tokens are set here."""
        n = len(rec.new_token_ids)
        self._step_tokens += n
        if n:
            if state.first_time is None:
                self.ttft.observe(max(t - state.arrival, 0.0))
            else:
                self.itl.observe(max(t - state.last_time, 0.0))
            self.generation_tokens.inc(n)
        # The prompt's sources and this node's queue and prefill, once: with the first token computed here (the
        # record with the timing), which for a request that came with tokens (P's first token on D) is a later
        # record than its first, or at its end when no step of its own computed a token.
        if not state.prompt_counted and (rec.timing or (rec.finished and (n or state.first_time is not None))):
            state.prompt_counted = True
            self._prompt(rec)
            state.num_cached_tokens = rec.num_cached_tokens + rec.num_external_tokens
            self._step_tokens += max(rec.num_prompt_tokens - state.num_cached_tokens, 0)
            if rec.timing:
                self.queue.observe(rec.timing["queue"] + rec.timing["kv_transfer"])
                self.prefill.observe(rec.timing["prefill"])
                state.prefill_time = rec.timing["prefill"]
        if rec.finished:
            reason = rec.finish_reason or "error"
            counter = self.success.get(reason) or self._success_family.labels(*self._lab, reason)
            counter.inc()
            self.e2e.observe(max(t - state.arrival, 0.0))
            total = state.num_tokens + n
            if reason != "abort" and self.req_prompt is not None:  # vLLM's client aborts leave these out too
                cached = state.num_cached_tokens if state.first_time is not None or n else \
                    rec.num_cached_tokens + rec.num_external_tokens  # ended before a first token
                self.req_preemptions.observe(rec.num_preemptions)
                self.req_prompt.observe(state.num_prompt_tokens)
                self.req_prefill_kv.observe(max(state.num_prompt_tokens - cached, 0))
                self.req_generation.observe(total)
                if state.max_tokens:
                    self.req_max_tokens.observe(state.max_tokens)
            if state.first_time is not None or n:  # a request with tokens: its decode ran from the first one
                decode = max(t - state.first_time, 0.0) if state.first_time is not None else 0.0
                self.decode.observe(decode)
                self.inference.observe(state.prefill_time + decode)
                if total > 1 and state.first_time is not None:
                    self.tpot.observe(decode / (total - 1))

    def _prompt(self, rec) -> None:
        """A request's prompt tokens by where their KV came from, once, at the first token computed here (as vLLM's
        first prefill output): the replay's last token is always computed here, so a local hit plus an import stay
        under the prompt."""
        local, external = rec.num_cached_tokens, rec.num_external_tokens
        self.prompt_tokens.inc(rec.num_prompt_tokens)
        self.prompt_by_source["local_compute"].inc(max(rec.num_prompt_tokens - local - external, 0))
        self.prompt_by_source["local_cache_hit"].inc(local)
        self.prompt_by_source["external_kv_transfer"].inc(external)
        self.prompt_cached.inc(local + external)

    def render(self, engine_stats: Optional[dict]) -> bytes:
        """`engine_stats` None (the engine did not answer): this scrape has no engine-level series."""
        self.engine.update(engine_stats)
        return generate_latest(self.registry)
