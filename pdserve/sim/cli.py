"""`pdserve sim` and `pdserve sim calibrate`: flags, checks by name, and the files a run writes.

A run writes what `bench pd` writes for a real sweep, in the same shapes: one `<arm>_rate<rate>.json` per rate
(bench serve's --save-result dict plus a `sim` section), `summary.json` (the table's rows), `table.txt` and the
plot `bench_pd.png`.
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

from dataclasses import fields

from pdserve.bench.metrics import BenchmarkMetrics, format_metrics
from pdserve.bench.pd import _row
from pdserve.bench.report import format_table, plot
from pdserve.bench.serve import json_safe
from pdserve.bench.server_metrics import format_share, format_ttft_split
from pdserve.config import CacheConfig, CompilationConfig, EngineConfig, SchedulerConfig, add_dataclass_args

DEFAULT_BANDWIDTH_GB_S = 12.5  # 100 Gb/s Ethernet
DEFAULT_LATENCY_MS = 1.0


def add_sim_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload (a trace, or bench serve's random generator)")
    g.add_argument("--trace", default=None, metavar="FILE.jsonl",
                   help="JSONL, one request a line: {\"arrival_time\": s, \"prompt_len\": n, \"output_len\": m} with "
                        "optional prefix_group, prefix_len, request_id (docs/sim.md). Without it, the random "
                        "generator below.")
    g.add_argument("--num-prompts", type=int, default=None, help="Random: requests per rate (default: 64).")
    g.add_argument("--random-input-len", type=int, default=None, help="Random: mean prompt tokens (default: 256).")
    g.add_argument("--random-output-len", type=int, default=None, help="Random: output tokens (default: 64).")
    g.add_argument("--random-range-ratio", type=float, default=None,
                   help="Random: lengths drawn in [mean x (1 - r), mean x (1 + r)], as bench serve (default: 0).")
    g.add_argument("--random-prefix-len", type=int, default=None,
                   help="Random: tokens every prompt starts with, added to the input length (default: 0).")
    g.add_argument("--request-rate", default=None, metavar="RATES",
                   help="Random: comma-separated request rates in req/s, one run each (inf: all at once; default: "
                        "1).")
    g.add_argument("--burstiness", type=float, default=None,
                   help="Random: gamma shape of the arrival gaps, 1 = Poisson (default: 1).")
    g.add_argument("--seed", type=int, default=0, help="Seed for lengths, arrivals, token ids (default: 0).")
    d = p.add_argument_group("deployment and models")
    d.add_argument("--profile", default=None, metavar="FILE.json",
                   help="Step-time profile (required): `pdserve sim calibrate` writes a linear one; a roofline one "
                        "describes a GPU (docs/sim.md).")
    d.add_argument("--deployment", default="collocated",
                   help="collocated, or XpYd (1p1d, 2p4d, ...) behind pdserve's router policy (default: "
                        "collocated).")
    d.add_argument("--nodes", type=int, default=1, help="Collocated: how many nodes (default: 1).")
    d.add_argument("--router-policy", choices=("round-robin", "least-loaded"), default="round-robin",
                   help="The router's pick among nodes, its own code (default: round-robin).")
    d.add_argument("--kv-bandwidth-gb-s", type=float, default=DEFAULT_BANDWIDTH_GB_S,
                   help=f"XpYd: KV transfer bandwidth P -> D in GB/s (default: {DEFAULT_BANDWIDTH_GB_S}).")
    d.add_argument("--kv-latency-ms", type=float, default=DEFAULT_LATENCY_MS,
                   help=f"XpYd: fixed latency of one KV transfer in ms (default: {DEFAULT_LATENCY_MS}).")
    d.add_argument("--spec-acceptance", type=float, default=0.5,
                   help="With --speculative-config: the chance that each draft token is accepted (drafts taken in "
                        "order until the first rejection), and that the stand-in model's next token repeats its "
                        "context, which is what n-gram drafts are found in (default: 0.5).")
    d.add_argument("--max-model-len", type=int, default=None,
                   help="Context length (default: the profile's model.max_model_len, else 4096).")
    d.add_argument("--speculative-config", default=None, metavar="JSON",
                   help="Speculative decoding as `pdserve serve --speculative-config` (n-gram drafting; the "
                        "scheduler's own draft bookkeeping, acceptance from --spec-acceptance).")
    for cls in (CacheConfig, SchedulerConfig, CompilationConfig):
        add_dataclass_args(p, cls)
    p.add_argument("--result-dir", default="sim-results", help="Where results go (default: sim-results).")
    p.add_argument("--quiet", action="store_true", help="No metrics table per run.")


ENGINE_SECTIONS = (CacheConfig, SchedulerConfig, CompilationConfig)


def _engine_config(args) -> EngineConfig:
    import dataclasses
    # engine flags with nothing to act on in a simulation: refused, so a run never reads as if they had applied
    if args.gpu_memory_utilization is not None:
        raise ValueError("--gpu-memory-utilization: a simulated node's KV cache is --num-gpu-blocks-override "
                         "blocks, or --kv-cache-memory-gb over the profile's model.kv_bytes_per_token")
    if args.cudagraph_metrics:
        raise ValueError("--cudagraph-metrics: a simulated run's graph counts are in its result JSON (graph, and "
                         "per node under sim.nodes)")
    names = {f.name for cls in ENGINE_SECTIONS for f in dataclasses.fields(cls) if f.metadata.get("cli", True)}
    kw = {k: v for k, v in vars(args).items() if k in names}
    if args.speculative_config is not None:
        from pdserve.spec_decode.config import SpeculativeConfig
        try:
            kw["speculative_config"] = SpeculativeConfig.from_json(args.speculative_config)
        except ValueError as e:
            raise ValueError(f"--speculative-config: {e}") from None
    return EngineConfig.from_kwargs("sim", max_model_len=args.max_model_len, device="cpu", **kw)


RANDOM_DEFAULTS = {"num_prompts": 64, "random_input_len": 256, "random_output_len": 64, "random_range_ratio": 0.0,
                   "random_prefix_len": 0, "request_rate": "1", "burstiness": 1.0}


def _workload_flags(args) -> None:
    """The random generator's flags mean nothing with a trace (it has its own lengths and times): refused by name,
    not ignored; without a trace, their defaults."""
    given = [k for k in RANDOM_DEFAULTS if getattr(args, k) is not None]
    if args.trace is not None and given:
        raise ValueError(f"--{given[0].replace('_', '-')} is for the random generator; --trace {args.trace} has its "
                         "own requests and arrival times")
    for k, v in RANDOM_DEFAULTS.items():
        if getattr(args, k) is None:
            setattr(args, k, v)


def _rates(text: str) -> list[float]:
    try:
        rates = [float(r) for r in text.split(",") if r.strip()]
    except ValueError:
        raise ValueError(f"--request-rate: {text!r} is not a comma-separated list of numbers") from None
    if not rates or any(not r > 0 for r in rates):
        raise ValueError("--request-rate: every rate must be > 0 (inf allowed)")
    return rates


def run_sim(args) -> int:
    from pdserve.sim.connector import TransferModel
    from pdserve.sim.profile import load_profile
    from pdserve.sim.run import parse_deployment, simulate
    from pdserve.sim.trace import load_trace, random_trace
    if args.profile is None:
        raise ValueError("--profile is required (pdserve sim calibrate --model DIR writes one)")
    _workload_flags(args)
    profile = load_profile(args.profile)
    dep = parse_deployment(args.deployment, args.nodes)
    if not 0 <= args.spec_acceptance <= 1:
        raise ValueError("--spec-acceptance must be in [0, 1]")
    transfer = TransferModel(args.kv_bandwidth_gb_s * 1e9, args.kv_latency_ms / 1000.0)
    config = _engine_config(args)
    if args.trace is not None:
        trace = load_trace(args.trace)
        last = trace[-1].arrival_time
        runs = [(len(trace) / last if last > 0 else math.inf, trace)]
    else:
        runs = [(rate, random_trace(args.num_prompts, args.random_input_len, args.random_output_len, rate,
                                    args.random_range_ratio, args.burstiness, args.seed + 1000 * i,
                                    args.random_prefix_len))
                for i, rate in enumerate(_rates(args.request_rate))]
    out = Path(args.result_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--result-dir {out}: {e.strerror or e}") from None
    # the arm, as bench pd names it: collocated, or the decode nodes' rule ('default' when the flag was left alone)
    rule = config.compilation.full_graph_rule
    arm = "collocated" if not dep.num_prefill else ("default" if rule == CompilationConfig().full_graph_rule
                                                    else rule)
    rows = []
    for rate, trace in runs:
        result = simulate(trace, dep, config, profile, transfer=transfer, policy=args.router_policy,
                          spec_acceptance=args.spec_acceptance, seed=args.seed)
        result.update(dataset="trace" if args.trace else "random", request_rate=rate, burstiness=args.burstiness,
                      random_input_len=round(sum(r.prompt_len for r in trace) / len(trace)),
                      random_output_len=round(sum(r.output_len for r in trace) / len(trace)),
                      random_range_ratio=args.random_range_ratio, random_prefix_len=args.random_prefix_len)
        if args.trace:
            result["trace"] = str(args.trace)
        (out / f"{arm}_rate{rate:g}.json").write_text(json.dumps(json_safe(result), indent=1))
        rows.append(_row(arm, rate, result))
        if not args.quiet:  # bench serve's own tables over the simulated records
            print(format_metrics(BenchmarkMetrics(**{f.name: result[f.name] for f in fields(BenchmarkMetrics)}),
                                 title=f"Simulated: {dep.name} @ {rate:g} req/s"))
            print(format_share(result["graph"]))
            if result["router_ttft_split_ms"]:
                print(format_ttft_split(result["router_ttft_split_ms"]))
        print(_summary_line(dep.name, rate, result))
    table = format_table(rows)
    print(table)
    (out / "table.txt").write_text(table + "\n")
    (out / "summary.json").write_text(json.dumps(json_safe({
        "date": time.strftime("%Y-%m-%d %H:%M:%S"), "simulated": True, "deployment": dep.name,
        "profile": str(args.profile), "model": profile.raw.get("name", "sim"), "arms": [arm],
        "rates": [r for r, _ in runs], "rows": rows}), indent=1))
    png = plot(rows, out / "bench_pd.png")
    print(f"[sim] results in {out}/ (summary.json, table.txt{', ' + png.name if png else ''})")
    return 0 if all(r["failed"] == 0 for r in rows) else 1


def _summary_line(dep: str, rate: float, r: dict) -> str:
    g = r["graph"]
    return (f"[sim] {dep} @ {rate:g} req/s: {r['completed']} ok, {r['failed']} failed, median TTFT "
            f"{r['ttft_ms']['median']:.1f} ms, mean TPOT {r['tpot_ms']['mean']:.2f} ms, p99 ITL "
            f"{r['itl_ms']['p99']:.2f} ms, non-FULL {100 * g['non_full_share']:.1f}% "
            f"(simulated in {r['sim']['wall_s']:.1f} s)")


def add_calibrate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="Local Hugging Face model directory to measure.")
    p.add_argument("--out", default="profile.json", help="Where the profile goes (default: profile.json).")
    p.add_argument("--name", default=None, help="The profile's name (default: the model directory's name).")
    p.add_argument("--rows", default="1,4,16", help="Comma-separated batch sizes to measure (default: 1,4,16).")
    p.add_argument("--context-lens", default="64,256",
                   help="Comma-separated prompt lengths to measure (default: 64,256).")
    p.add_argument("--decode-steps", type=int, default=16,
                   help="Output tokens per request, so decode steps per batch (default: 16).")


def _ints(flag: str, text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        vals = []
    if not vals or min(vals) < 1:
        raise ValueError(f"{flag}: {text!r} is not a comma-separated list of positive integers")
    return vals


def run_calibrate(args) -> int:
    from pdserve.sim.calibrate import calibrate
    if not (Path(args.model) / "config.json").is_file():
        raise ValueError(f"--model {args.model}: not a Hugging Face model directory (no config.json)")
    rows, contexts = _ints("--rows", args.rows), _ints("--context-lens", args.context_lens)
    d = calibrate(args.model, rows, contexts, args.decode_steps, args.name,
                  progress=lambda msg: print(f"[calibrate] {msg}", flush=True))
    try:
        Path(args.out).write_text(json.dumps(d, indent=1) + "\n")
    except OSError as e:
        raise ValueError(f"--out {args.out}: {e.strerror or e}") from None
    f, c = d["fit"], d["coefficients"]
    print(f"[calibrate] {f['samples']} steps: median error "
          f"{100 * f['median_rel_error']:.1f}%, p90 {100 * f['p90_rel_error']:.1f}%; base ms "
          + ", ".join(f"{m} {1e3 * v:.3f}" for m, v in c["base_s"].items())
          + f"; us per token {1e6 * c['per_token_s']:.2f}, per row {1e6 * c['per_row_s']:.2f}, per context token "
            f"{1e6 * c['per_context_token_s']:.4f}")
    print(f"[calibrate] profile written to {args.out}")
    return 0
