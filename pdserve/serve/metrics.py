"""Prometheus metrics of one server, in a per-app registry. Names are vLLM's with `vllm:` replaced by `pdserve_`.

Request-level series (tokens, finish reasons, latency histograms) are observed as the engine's step outputs reach the
event loop; engine-level series (running/waiting requests, KV usage, preemptions, graph steps) come from a custom
collector over a snapshot the engine loop takes at scrape time, so the counts are exact.
"""
from __future__ import annotations

from typing import Optional

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
FINISH_REASONS = ("stop", "length", "abort", "error")

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0, 160.0, 640.0)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                480.0, 960.0, 1920.0, 7680.0)


class EngineCollector:
    """Reads the engine snapshot set by `update()` (the engine loop's `stats` query) at collection time."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.stats: Optional[dict] = None

    def update(self, stats: dict) -> None:
        self.stats = stats

    def collect(self):
        s = self.stats
        if s is None:
            return
        lab = ["model_name"]
        for name, doc, value in (
                ("pdserve_num_requests_running", "Number of requests in the model's running batch.", s["running"]),
                ("pdserve_num_requests_waiting", "Number of requests waiting to be scheduled.", s["waiting"]),
                ("pdserve_kv_cache_usage_perc", "KV cache usage: fraction of blocks in use (1 = full).",
                 s["kv_usage"])):
            g = GaugeMetricFamily(name, doc, labels=lab)
            g.add_metric([self.model_name], value)
            yield g
        c = CounterMetricFamily("pdserve_num_preemptions", "Cumulative number of preemptions.", labels=lab)
        c.add_metric([self.model_name], s["preemptions"])
        yield c
        graph = s["graph"]
        steps = CounterMetricFamily("pdserve_cudagraph_steps", "Engine steps by graph runtime mode (FULL, PIECEWISE, "
                                    "NONE) and the reason a step was not FULL (none for FULL).",
                                    labels=["mode", "reason"])
        for key, n in graph["steps"].items():
            mode, reason = key.split("/", 1)
            steps.add_metric([mode, reason], n)
        yield steps
        pad = CounterMetricFamily("pdserve_cudagraph_padded_tokens", "Padding tokens added to reach a captured "
                                  "batch size.")
        pad.add_metric([], graph["padded_tokens"])
        yield pad
        info = GaugeMetricFamily("pdserve_cudagraph_info", "Graph device and whether real CUDA graphs were captured "
                                 "(on CPU FULL steps run the same callable eagerly).", labels=["device", "captured"])
        info.add_metric([str(graph["device"]), str(bool(graph["captured"])).lower()], 1)
        yield info
        yield from self._transfer(s.get("transfer"))
        yield from self._spec(s.get("spec"))

    def _spec(self, sd: Optional[dict]):
        """vLLM's speculative decoding series (SpecDecodingProm), plus placeholders, with --speculative-config."""
        if not sd:
            return
        lab = ["model_name"]
        for key, doc in (("num_drafts", "Number of spec decoding drafts."),
                         ("num_draft_tokens", "Number of spec decoding draft tokens (placeholders excluded)."),
                         ("num_accepted_tokens", "Number of spec decoding accepted tokens."),
                         ("num_placeholder_tokens", "Scheduled draft slots with no draft (always rejected).")):
            c = CounterMetricFamily(f"pdserve_spec_decode_{key}", doc, labels=lab)
            c.add_metric([self.model_name], sd[key])
            yield c
        per = CounterMetricFamily("pdserve_spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft "
                                  "position.", labels=["model_name", "position"])
        for pos, n in enumerate(sd["accepted_per_pos"]):
            per.add_metric([self.model_name, str(pos)], n)
        yield per

    def _transfer(self, t: Optional[dict]):
        """KV transfer series, on servers with a KV connector (P/D)."""
        if not t:
            return
        for name, doc, key in (("pdserve_kv_transfer_sent_bytes", "Bytes of KV sent to decode nodes.", "bytes_sent"),
                               ("pdserve_kv_transfer_received_bytes", "Bytes of KV received from prefill nodes.",
                                "bytes_received"),
                               ("pdserve_kv_transfer_receive_seconds", "Seconds spent receiving KV.",
                                "seconds_receiving")):
            c = CounterMetricFamily(name, doc)
            c.add_metric([], t.get(key, 0))
            yield c
        f = CounterMetricFamily("pdserve_kv_transfer_failures", "KV loads that failed, by reason.", labels=["reason"])
        for reason, n in sorted((t.get("failures") or {}).items()):
            f.add_metric([str(reason)], n)
        yield f
        g = GaugeMetricFamily("pdserve_kv_leased_blocks", "KV blocks held under a lease for decode nodes to read.")
        g.add_metric([], t.get("leased_blocks", 0))
        yield g
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
            m = HistogramMetricFamily(f"pdserve_nixl_{key}", self._NIXL_DOCS[key])
            m.add_metric([], [(repr(float(le)), c) for le, c in h["buckets"]] + [("+Inf", h["count"])], h["sum"])
            yield m
        for key, v in n["counters"].items():
            c = CounterMetricFamily(f"pdserve_nixl_{key}", self._NIXL_DOCS[key])
            c.add_metric([], v)
            yield c


class ServerMetrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        self.engine = EngineCollector(model_name)
        self.registry.register(self.engine)
        lab, r = ["model_name"], self.registry
        self.prompt_tokens = Counter("pdserve_prompt_tokens", "Number of prefill tokens processed.", lab,
                                     registry=r).labels(model_name)
        self.generation_tokens = Counter("pdserve_generation_tokens", "Number of generation tokens processed.", lab,
                                         registry=r).labels(model_name)
        success = Counter("pdserve_request_success", "Count of finished requests by finish reason.",
                          lab + ["finished_reason"], registry=r)
        self.success = {reason: success.labels(model_name, reason) for reason in FINISH_REASONS}
        self._success_family = success
        self._model = model_name
        self.ttft = Histogram("pdserve_time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              lab, buckets=_TTFT_BUCKETS, registry=r).labels(model_name)
        self.itl = Histogram("pdserve_inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             lab, buckets=_ITL_BUCKETS, registry=r).labels(model_name)
        self.tpot = Histogram("pdserve_request_time_per_output_token_seconds", "Histogram of time per output token "
                              "in seconds (decode time / (output tokens - 1)).", lab, buckets=_ITL_BUCKETS,
                              registry=r).labels(model_name)
        self.e2e = Histogram("pdserve_e2e_request_latency_seconds", "Histogram of end-to-end request latency in "
                             "seconds.", lab, buckets=_E2E_BUCKETS, registry=r).labels(model_name)

    def on_tokens(self, state, rec, t: float) -> None:
        """Called for every engine record of a request, in order. `state` carries arrival/first/last times."""
        n = len(rec.new_token_ids)
        if n:
            if state.first_time is None:
                self.ttft.observe(max(t - state.arrival, 0.0))
                self.prompt_tokens.inc(rec.num_prompt_tokens)
            else:
                self.itl.observe(max(t - state.last_time, 0.0))
            self.generation_tokens.inc(n)
        if rec.finished:
            reason = rec.finish_reason or "error"
            counter = self.success.get(reason) or self._success_family.labels(self._model, reason)
            counter.inc()
            self.e2e.observe(max(t - state.arrival, 0.0))
            total = state.num_tokens + n
            if total > 1 and state.first_time is not None:
                self.tpot.observe(max((t - state.first_time) / (total - 1), 0.0))

    def render(self, engine_stats: Optional[dict]) -> bytes:
        if engine_stats is not None:
            self.engine.update(engine_stats)
        return generate_latest(self.registry)
