"""`pdserve plan`: which deployment of N nodes serves a workload with the most goodput per node.

Goodput is vLLM bench serve's `--goodput`: requests per second that meet every SLO given (`ttft:MS`, `tpot:MS`,
`e2el:MS`, each request on its own). A candidate is a split (collocated x N, or every XpYd with X + Y = N) and
the engine knobs that decide its batches (max_num_seqs, max_num_batched_tokens, long_prefill_token_threshold,
speculative decoding's K), applied to every node; each is simulated (run.simulate: the engine's own scheduler over
a step-time profile) over the same workload at a sweep of request rates, and scored by the best goodput over its
rates divided by its node count. A rate past a candidate's knee drops its goodput (queues grow, TTFTs miss), so
the sweep doubles the rate from a start until goodput falls below `KNEE` of its best so far, then halves the
bracket around the best (the midpoints on both sides, round after round) while its runs last (a doubling grid is
coarse just where the best lies).

Every candidate sees the same requests: one seed for lengths and arrival gaps, the gaps scaled to each rate (a
trace's arrival times scaled the same way), so two candidates differ by their configuration only.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Callable, Optional

from pdserve.config import EngineConfig
from pdserve.sim.connector import TransferModel
from pdserve.sim.profile import Profile, StepShape
from pdserve.sim.run import Deployment, simulate
from pdserve.sim.trace import TraceRequest

KNEE = 0.8  # a rate whose goodput is below this share of the best so far is past the knee: the sweep stops
# a point whose requests all arrive within this many latency SLOs may be a burst the queue absorbs, not a rate the
# deployment sustains: the ranking marks it (a longer trace settles it)
SHORT_SPANS = 10
START_SHARE = 1 / 4  # the sweep's default first rate, of capacity()'s estimate: two doublings reach it
REFINE = 0.05  # the sweep stops halving the bracket around the best rate once it is this narrow (a share of the rate)


@dataclass(frozen=True)
class Candidate:
    deployment: Deployment
    max_num_seqs: int
    max_num_batched_tokens: int
    long_prefill_token_threshold: int
    num_speculative_tokens: int  # K; 0: no speculative decoding

    @property
    def num_nodes(self) -> int:
        return self.deployment.num_prefill + self.deployment.num_decode

    @property
    def split(self) -> str:
        d = self.deployment
        return "collocated" if not d.num_prefill else f"{d.num_prefill}P{d.num_decode}D"

    @property
    def label(self) -> str:
        return (f"{self.split} seqs={self.max_num_seqs} tokens={self.max_num_batched_tokens} "
                f"lp={self.long_prefill_token_threshold} K={self.num_speculative_tokens}")

    def knobs(self) -> dict:
        return {"deployment": self.split, "nodes": self.num_nodes, "max_num_seqs": self.max_num_seqs,
                "max_num_batched_tokens": self.max_num_batched_tokens,
                "long_prefill_token_threshold": self.long_prefill_token_threshold,
                "num_speculative_tokens": self.num_speculative_tokens}


@dataclass
class RatePoint:
    rate: float
    goodput: float  # req/s meeting every SLO, the whole deployment
    throughput: float  # req/s completed
    good_share: float  # of the requests sent
    failed: int
    ttft_ms: dict  # bench serve's summaries (mean, median, p90, p99, ...)
    tpot_ms: dict
    span_s: float  # from the first arrival to the last

    def short(self, slos: dict[str, float]) -> bool:
        latency = max(slos.get("ttft", 0.0), slos.get("e2el", 0.0))
        return latency > 0 and self.span_s < SHORT_SPANS * latency


@dataclass
class Evaluation:
    candidate: Candidate
    attainment: float = 0.0  # the share of a rate's requests that must be good for the rate to count
    points: list[RatePoint] = field(default_factory=list)

    def counts(self, p: RatePoint) -> bool:
        return p.good_share > 0 and p.good_share >= self.attainment - 1e-9  # goodput x duration / n: float noise

    @property
    def best(self) -> Optional[RatePoint]:
        """The rate with the most goodput among those that count (ties: the lower rate)."""
        return max((p for p in self.points if self.counts(p)), key=lambda p: (p.goodput, -p.rate), default=None)

    @property
    def goodput_per_node(self) -> float:
        b = self.best
        return b.goodput / self.candidate.num_nodes if b is not None else 0.0


def splits(nodes: int) -> list[Deployment]:
    """collocated x nodes, then every XpYd with X + Y = nodes (1P(N-1)D first)."""
    if nodes < 1:
        raise ValueError("--nodes must be >= 1")
    return [Deployment(0, nodes)] + [Deployment(x, nodes - x) for x in range(1, nodes)]


def candidates(deployments: list[Deployment], seqs: list[int], tokens: list[int], thresholds: list[int],
               ks: list[int]) -> list[Candidate]:
    """The grid, less combinations the engine refuses: a token budget below max_num_seqs is allowed (chunked
    prefill), one below 1 + K is not (a drafting decode row would not fit)."""
    out = [Candidate(d, s, t, lp, k) for d in deployments for s in seqs for t in tokens for lp in thresholds
           for k in ks if t >= 1 + k]
    if not out:
        raise ValueError("--max-num-batched-tokens: every value is below 1 + --num-speculative-tokens; no "
                         "candidate is left")
    return out


def engine_config(base: dict, c: Candidate, spec_base: dict) -> EngineConfig:
    """The engine config of `c`'s nodes: `base` (the engine flags given once) with the candidate's knobs."""
    kw = dict(base, max_num_seqs=c.max_num_seqs, max_num_batched_tokens=c.max_num_batched_tokens,
              long_prefill_token_threshold=c.long_prefill_token_threshold)
    if c.num_speculative_tokens:
        from pdserve.spec_decode.config import SpeculativeConfig
        kw["speculative_config"] = SpeculativeConfig(**{**spec_base,
                                                        "num_speculative_tokens": c.num_speculative_tokens})
    return EngineConfig.from_kwargs("sim", device="cpu", **kw)


def scale_trace(trace: list[TraceRequest], rate: float) -> list[TraceRequest]:
    """`trace` with its arrival times scaled so it arrives at `rate` requests per second on average (n over the
    last arrival); `inf`: all at once."""
    last = trace[-1].arrival_time
    if math.isinf(rate):
        return [replace(r, arrival_time=0.0) for r in trace]
    if last <= 0:
        raise ValueError("the workload's requests all arrive at 0 s: no rate to scale to --request-rate (a --trace "
                         "needs arrival times, the random generator --num-prompts >= 2)")
    f = len(trace) / last / rate
    return [replace(r, arrival_time=r.arrival_time * f) for r in trace]


def evaluate(c: Candidate, trace: list[TraceRequest], rates: Optional[list[float]], start_rate: float,
             max_rates: int, run: Callable[[Candidate, list[TraceRequest]], dict], attainment: float = 0.0
             ) -> Evaluation:
    """`c` at the given `rates`, or (None) the doubling sweep from `start_rate`, then the bracket around the best
    halved, at most `max_rates` runs; `run` simulates one trace (plan_search's closure over the flags). With
    `attainment`, a rate counts only when that share of its requests is good (the SLOs then hold at that
    percentile), and the doubling stops at the first rate that falls short."""
    ev = Evaluation(c, attainment)
    n = len(trace)

    def at(rate: float) -> RatePoint:
        tr = scale_trace(trace, rate)
        r = run(c, tr)
        p = RatePoint(rate, r["request_goodput"], r["request_throughput"], r["request_goodput"] * r["duration"] / n,
                      r["failed"], r["ttft_ms"], r["tpot_ms"], tr[-1].arrival_time - tr[0].arrival_time)
        ev.points.append(p)
        return p
    if rates is not None:
        for rate in rates:
            at(rate)
        return ev
    rate, best = start_rate, 0.0
    while len(ev.points) < max_rates:
        p = at(rate)
        if p.goodput < KNEE * best or not ev.counts(p):
            break
        best = max(best, p.goodput)
        rate *= 2
    rate = start_rate / 2
    while len(ev.points) < max_rates and ev.best is None:  # the start was past the knee already: halve down
        at(rate)
        rate /= 2
    # halve the bracket around the best while runs are left: each round the midpoints between the best rate and
    # its neighbours (the upper first: goodput climbs to just below the knee), until within REFINE of it
    while len(ev.points) < max_rates and (b := ev.best) is not None:
        seen = sorted(p.rate for p in ev.points)
        i = seen.index(b.rate)
        mids = [(lo + hi) / 2 for lo, hi in ((b.rate, seen[i + 1] if i + 1 < len(seen) else None),
                                             (seen[i - 1] if i else None, b.rate))
                if lo is not None and hi is not None and hi - lo > REFINE * b.rate]
        if not mids:
            break
        for m in mids[:max_rates - len(ev.points)]:
            at(m)
    ev.points.sort(key=lambda p: p.rate)
    return ev


def capacity(profile: Profile, c: Candidate, mean_in: float, mean_out: float) -> float:
    """Requests per second `c` serves by a rough estimate from the profile: each prefill node's mean prompts back to
    back in chunks of the token budget, each decode node's steps full (max_num_seqs rows at the mean context), KV
    blocks and queues ignored; a collocated node does both in turn (its mixed steps may do better). The sweep
    starts at START_SHARE of it, well below the knee."""
    n, m = max(1, round(mean_in)), max(1, round(mean_out))
    t_pre, done = 0.0, 0
    while done < n:  # the prompt's chunks, each over the KV of those before it
        q = min(n - done, c.max_num_batched_tokens)
        t_pre += profile.step_time(StepShape("PIECEWISE", q, q, 1, done + q, q * done + q * (q + 1) // 2))
        done += q
    b, ctx = c.max_num_seqs, n + m // 2
    t_dec = (m - 1) * profile.step_time(StepShape("FULL", b, b, b, b * ctx, b * ctx)) / b  # a request's share
    d = c.deployment
    if not d.num_prefill:
        return d.num_decode / (t_pre + t_dec)
    return min(d.num_prefill / t_pre, d.num_decode / t_dec if t_dec > 0 else math.inf)


def rank(evals: list[Evaluation]) -> list[Evaluation]:
    """Most goodput per node first; ties: fewer nodes idle on the way (higher throughput), then the label."""
    return sorted(evals, key=lambda e: (-e.goodput_per_node, -(e.best.throughput if e.best else 0),
                                        e.candidate.label))


def plan_search(cands: list[Candidate], trace: list[TraceRequest], profile: Profile, base: dict, spec_base: dict,
                slos: dict[str, float], *, transfer: TransferModel, policy: str, spec_acceptance: float, seed: int,
                rates: Optional[list[float]], start_rate: Optional[float], max_rates: int,
                progress: Optional[Callable[[Candidate], None]] = None, pd_first_token: str = "replay",
                attainment: float = 0.0, step_by_step: bool = False, shared_host: bool = False,
                early_decode: bool = True) -> list[Evaluation]:
    """Every candidate evaluated (progress called after each), ranked; the sweep starts at `start_rate` per node,
    or (None) at START_SHARE of the candidate's capacity(); `pd_first_token` applies to the XpYd candidates (the
    router's flag: collocated ones have no router hand-off), with `early_decode` (the router's --pd-early-decode);
    the runs leap over steady decode runs unless
    `step_by_step`; `shared_host`: every candidate's nodes on one machine's cores (both simulate's)."""
    if not slos:
        raise ValueError("--goodput: give at least one SLO (e.g. --goodput ttft:200 tpot:50)")

    def run(c: Candidate, tr: list[TraceRequest]) -> dict:
        return simulate(tr, c.deployment, engine_config(base, c, spec_base), profile, transfer=transfer,
                        policy=policy, spec_acceptance=spec_acceptance, seed=seed, slos=slos,
                        pd_first_token=pd_first_token if c.deployment.num_prefill else "replay",
                        early_decode=early_decode, step_by_step=step_by_step, shared_host=shared_host)
    evals = []
    for c in cands:
        start = start_rate * c.num_nodes if start_rate is not None else START_SHARE * capacity(
            profile, c, sum(r.prompt_len for r in trace) / len(trace), sum(r.output_len for r in trace) / len(trace))
        evals.append(evaluate(c, trace, rates, start, max_rates, run, attainment))
        if progress is not None:
            progress(c)
    return rank(evals)


def format_ranking(ranked: list[Evaluation], slos: dict[str, float], top: Optional[int] = None,
                   attainment: float = 0.0) -> str:
    head = ["#", "deployment", "max_num_seqs", "max_num_batched_tokens", "long_prefill", "K", "goodput/node",
            "goodput", "at rate", "good %", "p90 TTFT ms", "p90 TPOT ms"]
    body = []
    for i, e in enumerate(ranked[:top] if top else ranked, 1):
        c, b = e.candidate, e.best
        body.append([str(i), c.split, str(c.max_num_seqs),
                     str(c.max_num_batched_tokens), str(c.long_prefill_token_threshold),
                     str(c.num_speculative_tokens), f"{e.goodput_per_node:.2f}",
                     *([f"{b.goodput:.2f}", f"{b.rate:.3g}" + ("*" if b.short(slos) else ""),
                        f"{100 * b.good_share:.0f}",
                        f"{b.ttft_ms.get('p90', math.nan):.1f}", f"{b.tpot_ms.get('p90', math.nan):.1f}"]
                       if b else ["-"] * 5)])
    widths = [max(len(x) for x in col) for col in zip(head, *body)]

    def line(cells):
        return "  ".join(c.ljust(w) if j == 1 else c.rjust(w) for j, (c, w) in enumerate(zip(cells, widths)))
    slo_text = " ".join(f"{k}:{1000 * v:g}" for k, v in slos.items())
    notes = []
    if any(e.best and e.best.short(slos) for e in ranked):
        notes.append(f"*: the requests arrive within {SHORT_SPANS}x the latency SLO at this rate, a burst the queue "
                     "may absorb rather than a rate sustained; a longer trace (--num-prompts) tells them apart")
    where = f", at rates where {100 * attainment:g}% or more of the requests meet them" if attainment else ""
    return "\n".join([f"pdserve plan: goodput (req/s meeting {slo_text} ms{where}) per node, best rate of each",
                      line(head), "-" * len(line(head)), *(line(b) for b in body), *notes])


def plot_goodput(ranked: list[Evaluation], path, top: int):
    """Goodput per node against offered rate per node, one line per candidate of the best `top`."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for e in ranked[:top]:
        n = e.candidate.num_nodes
        ax.plot([p.rate / n for p in e.points], [p.goodput / n for p in e.points], marker="o",
                label=e.candidate.label)
    ax.set(xlabel="offered rate per node (req/s)", ylabel="goodput per node (req/s)",
           title=f"pdserve plan: the best {min(top, len(ranked))}")
    ax.set_ylim(bottom=0)
    ax.set_xlim(left=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def to_json(ranked: list[Evaluation]) -> list[dict]:
    return [{**e.candidate.knobs(), "label": e.candidate.label, "goodput_per_node": e.goodput_per_node,
             "best_rate": e.best.rate if e.best else None,
             "points": [{"rate": p.rate, "goodput": p.goodput, "throughput": p.throughput,
                         "good_share": p.good_share, "failed": p.failed, "ttft_ms": p.ttft_ms, "tpot_ms": p.tpot_ms,
                         "span_s": p.span_s}
                        for p in e.points]} for e in ranked]
