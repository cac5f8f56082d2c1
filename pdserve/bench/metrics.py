"""Serving metrics with vLLM's definitions, from per-request timestamps.

TTFT: send -> first chunk carrying a token (its text may be empty). TPOT: (E2EL - TTFT) / (output tokens - 1), per
request, for requests with more than one token. ITL: every gap between consecutive token chunks, pooled over requests
(a chunk of several tokens, e.g. with speculative decoding, is one gap). E2EL: send -> the last token chunk. A
request is good (goodput) when it meets every SLO given. Peaks, as vLLM's: time from the first send cut in one-second
buckets, the most token chunks in one, and the most requests in flight at some point of one. Input tokens are the
server's usage `prompt_tokens` where it gives them; when neither it nor a tokenizer gives a request's count, the
totals that need it are None ("n/a").
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Optional

import numpy as np

PERCENTILES = (90.0, 99.0)  # besides the median, always there
METRICS = ("ttft", "tpot", "itl", "e2el")
SLO_METRICS = ("ttft", "tpot", "e2el")


def pct_key(p: float) -> str:
    """vLLM's spelling: p99, p99.9."""
    return f"p{int(p)}" if p == int(p) else f"p{p}"


def parse_percentiles(metrics: str, percentiles: str) -> tuple[tuple[str, ...], tuple[float, ...]]:
    """`--percentile-metrics ttft,tpot,...` and `--metric-percentiles 90,99`, checked by name."""
    names = tuple(m.strip() for m in metrics.split(",") if m.strip())
    if not names or not set(names) <= set(METRICS):
        raise ValueError(f"--percentile-metrics {metrics!r}: a comma-separated list of {', '.join(METRICS)}")
    try:
        ps = tuple(float(p) for p in percentiles.split(","))
    except ValueError:
        ps = ()
    if not ps or not all(0 < p <= 100 for p in ps):
        raise ValueError(f"--metric-percentiles {percentiles!r}: comma-separated numbers in (0, 100], e.g. 90,99")
    return names, ps


@dataclass
class RequestResult:
    success: bool = False
    prompt_len: Optional[int] = 0
    output_tokens: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    error: str = ""
    generated_text: str = ""
    start: float = 0.0  # perf_counter at send: its lag behind the schedule says whether the client kept up

    @property
    def tpot(self) -> Optional[float]:
        if self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def parse_goodput(items: Optional[list[str]]) -> dict[str, float]:
    """`ttft:MS tpot:MS e2el:MS` -> SLOs in seconds."""
    slos = {}
    for item in items or []:
        name, _, value = item.partition(":")
        if name not in SLO_METRICS:
            raise ValueError(f"--goodput: unknown metric {name!r} (use {', '.join(SLO_METRICS)})")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"--goodput: {item!r} is not NAME:MILLISECONDS") from None
        if ms <= 0:
            raise ValueError(f"--goodput: {item!r}: the SLO must be > 0 ms")
        slos[name] = ms / 1000.0
    return slos


def summarize(values: list[float], percentiles: tuple[float, ...] = PERCENTILES) -> dict[str, float]:
    """mean, median, std and the percentiles (linear interpolation, numpy's default, as vLLM), in milliseconds."""
    keys = [pct_key(p) for p in percentiles]
    if not values:  # nothing measured: NaN, never a zero that reads as a latency
        return dict.fromkeys(("mean", "median", "std", *keys), float("nan"))
    a = np.asarray(values, dtype=float) * 1000.0
    out = {"mean": float(a.mean()), "median": float(np.median(a)), "std": float(a.std())}
    out.update({k: float(np.percentile(a, p)) for k, p in zip(keys, percentiles)})
    return out


def gap_medians(itls: list) -> dict:
    """Medians (ms) of each request's first inter-token gap and of its later ones, from per-request gaps in seconds:
    in a first-token P/D arm the first is the hand-off from P's token to D's first, and it sets the p99 ITL."""
    first = [1000 * g[0] for g in itls if g]
    rest = [1000 * x for g in itls for x in g[1:]]
    return {"first_gap_median_ms": float(np.median(first)) if first else None,
            "other_gaps_median_ms": float(np.median(rest)) if rest else None}


def itl_tail(start_times: Optional[list], ttfts: Optional[list], itls: Optional[list], before_s: float = 0.003) -> dict:
    """Where the ITL tail sits, from per-request send times, TTFTs and gaps (seconds, as a run's JSON keeps them). An
    arrival gap is a request's gap during which another request was sent (from `before_s` before the gap to its
    end: the newcomer's way in and its prefill). Gives the arrival gaps' share of all gaps and of the gaps at or
    above the p99 ITL, the first gaps' share of those, the arrival gaps' median and the p99 ITL without them (ms).
    None throughout where the run kept no send times or had no gap."""
    none = {"arrival_gap_share": None, "arrival_gaps_in_p99_tail": None, "first_gaps_in_p99_tail": None,
            "arrival_gap_median_ms": None, "p99_itl_without_arrival_gaps_ms": None}
    if not start_times or not ttfts or not itls:
        return none
    sends = np.sort(np.asarray(start_times, dtype=np.float64))
    gaps = []  # (gap, is an arrival gap, is a first gap)
    for s, t0, g in zip(start_times, ttfts, itls):
        t = s + (t0 or 0.0)
        for k, x in enumerate(g or []):
            lo, hi = np.searchsorted(sends, t - before_s, "left"), np.searchsorted(sends, t + x, "right")
            others = hi - lo - int(t - before_s <= s <= t + x)  # its own send never counts
            gaps.append((x, others > 0, k == 0))
            t += x
    if not gaps:
        return none
    x = np.array([g for g, _, _ in gaps])
    arrival = np.array([a for _, a, _ in gaps])
    first = np.array([f for _, _, f in gaps])
    tail = x >= np.percentile(x, 99)
    rest = x[~arrival]
    return {"arrival_gap_share": float(arrival.mean()), "arrival_gaps_in_p99_tail": float(arrival[tail].mean()),
            "first_gaps_in_p99_tail": float(first[tail].mean()),
            "arrival_gap_median_ms": float(1000 * np.median(x[arrival])) if arrival.any() else None,
            "p99_itl_without_arrival_gaps_ms": float(1000 * np.percentile(rest, 99)) if rest.size else None}


def is_good(r: RequestResult, slos: dict[str, float]) -> bool:
    tpot = r.tpot if r.tpot is not None else 0.0
    measured = {"ttft": r.ttft, "tpot": tpot, "e2el": r.latency}
    return r.success and all(measured[k] <= v for k, v in slos.items())


@dataclass
class BenchmarkMetrics:
    completed: int
    failed: int
    duration_s: float
    total_input_tokens: Optional[int]
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: Optional[float]
    request_goodput: Optional[float]
    max_output_tokens_per_s: float  # vLLM's names, flat in --save-result as in its file
    max_concurrent_requests: int
    ttft_ms: dict
    tpot_ms: dict
    itl_ms: dict
    e2el_ms: dict
    error_summary: list = field(default_factory=list)  # the distinct errors, first 10

    def to_dict(self) -> dict:
        return asdict(self)

    def vllm_keys(self, metrics: tuple[str, ...] = METRICS) -> dict:
        """The same figures under the flat keys of vLLM's saved result (`duration`, `mean_ttft_ms`,
        `p99_itl_ms`, ...; those of --percentile-metrics), so scripts written for `vllm bench serve` files read
        these too."""
        out = {"duration": self.duration_s}
        for name in metrics:
            out.update({f"{k}_{name}_ms": v for k, v in getattr(self, f"{name}_ms").items()})
        return out


def peaks(ok: list[RequestResult]) -> tuple[float, int]:
    """vLLM's peak output throughput and concurrency over the successful requests, in one-second buckets from the
    first send: a token chunk counts once in the bucket it arrived in (as one token, as vLLM's, even a chunk that
    carries several, e.g. with speculative decoding), a request once in every bucket from its send to its last
    token chunk. So two requests one after the other inside a second are both counted: concurrent within the
    second, not at one instant. (0.0, 0) without a success, as vLLM."""
    if not ok:
        return 0.0, 0
    t0 = min(r.start for r in ok)
    # arrival times summed as vLLM's (send + TTFT, then each gap), so a chunk on a bucket's edge lands where it does
    chunks = np.concatenate([np.cumsum([r.start + r.ttft, *r.itl]) - t0 for r in ok]).astype(int)
    active = np.concatenate([np.arange(int(r.start - t0), int(r.start + r.latency - t0) + 1) for r in ok])
    return float(np.bincount(chunks).max()), int(np.bincount(active).max())


def compute_metrics(results: list[RequestResult], duration_s: float, slos: Optional[dict[str, float]] = None,
                    percentiles: tuple[float, ...] = PERCENTILES) -> BenchmarkMetrics:
    ok = [r for r in results if r.success]
    n_out = sum(r.output_tokens for r in ok)
    n_in = None if any(r.prompt_len is None for r in ok) else sum(r.prompt_len for r in ok)
    dur = max(duration_s, 1e-9)
    errors = sorted({r.error for r in results if not r.success})
    peak_tokens, peak_requests = peaks(ok)
    return BenchmarkMetrics(
        completed=len(ok), failed=len(results) - len(ok), duration_s=duration_s,
        total_input_tokens=n_in, total_output_tokens=n_out,
        request_throughput=len(ok) / dur, output_throughput=n_out / dur,
        total_token_throughput=None if n_in is None else (n_in + n_out) / dur,
        request_goodput=sum(is_good(r, slos) for r in ok) / dur if slos else None,
        max_output_tokens_per_s=peak_tokens, max_concurrent_requests=peak_requests,
        ttft_ms=summarize([r.ttft for r in ok], percentiles),
        tpot_ms=summarize([r.tpot for r in ok if r.tpot is not None], percentiles),
        itl_ms=summarize([gap for r in ok for gap in r.itl], percentiles),
        e2el_ms=summarize([r.latency for r in ok], percentiles),
        error_summary=errors[:10])


def format_metrics(m: BenchmarkMetrics, title: str = "Serving Benchmark Result",
                   metrics: tuple[str, ...] = METRICS) -> str:
    rows = [("Successful requests:", m.completed), ("Failed requests:", m.failed),
            ("Benchmark duration (s):", f"{m.duration_s:.2f}"),
            ("Total input tokens:", "n/a" if m.total_input_tokens is None else m.total_input_tokens),
            ("Total generated tokens:", m.total_output_tokens),
            ("Request throughput (req/s):", f"{m.request_throughput:.2f}")]
    if m.request_goodput is not None:
        rows.append(("Request goodput (req/s):", f"{m.request_goodput:.2f}"))
    rows += [("Output token throughput (tok/s):", f"{m.output_throughput:.2f}"),
             ("Peak output token throughput (tok/s):", f"{m.max_output_tokens_per_s:.2f}"),
             ("Peak concurrent requests:", m.max_concurrent_requests),
             ("Total token throughput (tok/s):",
              "n/a" if m.total_token_throughput is None else f"{m.total_token_throughput:.2f}")]
    lines = [f"{f' {title} ':=^60}"] + [f"{k:<44}{v:>16}" for k, v in rows]
    labels = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
              "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}
    for key in metrics:
        name, stats = key.upper(), getattr(m, f"{key}_ms")
        lines.append(f"{labels[key]:-^60}")
        lines += [f"{f'{k[0].upper() + k[1:]} {name} (ms):':<44}{v:>16.2f}" for k, v in stats.items() if k != "std"]
    for e in m.error_summary:
        lines.append(f"error: {e}")
    lines.append("=" * 60)
    return "\n".join(lines)
