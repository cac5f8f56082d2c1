"""`pdserve sim` and `pdserve sim calibrate`: flags, checks by name, and the files a run writes.

A run writes what `bench pd` writes for a real sweep, in the same shapes: one `<arm>_rate<rate>.json` per rate
(bench serve's --save-result dict plus a `sim` section), `summary.json` (the table's rows), `table.txt` and the
plot `bench_pd.png`.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

from dataclasses import fields

from pdserve.kv_transfer_config import KVTransferConfig
from pdserve.bench.metrics import BenchmarkMetrics, format_metrics
from pdserve.bench.pd import _row
from pdserve.bench.report import format_table, plot
from pdserve.bench.serve import json_safe
from pdserve.bench.server_metrics import format_share, format_ttft_split
from pdserve.config import CacheConfig, CompilationConfig, EngineConfig, SchedulerConfig, add_dataclass_args

DEFAULT_BANDWIDTH_GB_S = 12.5  # 100 Gb/s Ethernet
DEFAULT_LATENCY_MS = 1.0


def add_sim_args(p: argparse.ArgumentParser) -> None:
    add_workload_args(p, rates="Random: comma-separated request rates in req/s, one run each (inf: all at once; "
                               "default: 1).")
    d = add_fleet_args(p)
    d.add_argument("--deployment", default="collocated",
                   help="collocated, or XpYd (1p1d, 2p4d, ...) behind pdserve's router policy (default: "
                        "collocated).")
    d.add_argument("--nodes", type=int, default=1, help="Collocated: how many nodes (default: 1).")
    d.add_argument("--speculative-config", default=None, metavar="JSON",
                   help="Speculative decoding as `pdserve serve --speculative-config` (n-gram drafting; the "
                        "scheduler's own draft bookkeeping, acceptance from --spec-acceptance).")
    for cls in (CacheConfig, SchedulerConfig, CompilationConfig):
        add_dataclass_args(p, cls)
    p.add_argument("--result-dir", default="sim-results", help="Where results go (default: sim-results).")
    p.add_argument("--quiet", action="store_true", help="No metrics table per run.")


def add_workload_args(p: argparse.ArgumentParser, rates: str, num_prompts: int = 64) -> None:
    """The trace, or bench serve's random generator (shared by sim and plan; `rates` is --request-rate's help,
    `num_prompts` the default the command sets when --num-prompts is left out)."""
    g = p.add_argument_group("workload (a trace, or bench serve's random generator)")
    g.add_argument("--trace", default=None, metavar="FILE.jsonl",
                   help="JSONL, one request a line: {\"arrival_time\": s, \"prompt_len\": n, \"output_len\": m} with "
                        "optional prefix_group, prefix_len, request_id (docs/sim.md). Without it, the random "
                        "generator below.")
    g.add_argument("--num-prompts", type=int, default=None,
                   help=f"Random: requests per rate (default: {num_prompts}).")
    g.add_argument("--random-input-len", type=int, default=None, help="Random: mean prompt tokens (default: 256).")
    g.add_argument("--random-output-len", type=int, default=None, help="Random: output tokens (default: 64).")
    g.add_argument("--random-range-ratio", type=float, default=None,
                   help="Random: lengths drawn in [mean x (1 - r), mean x (1 + r)], as bench serve (default: 0).")
    g.add_argument("--random-prefix-len", type=int, default=None,
                   help="Random: tokens every prompt starts with, added to the input length (default: 0).")
    g.add_argument("--request-rate", default=None, metavar="RATES", help=rates)
    g.add_argument("--burstiness", type=float, default=None,
                   help="Random: gamma shape of the arrival gaps, 1 = Poisson (default: 1).")
    g.add_argument("--seed", type=int, default=0, help="Seed for lengths, arrivals, token ids (default: 0).")


def add_fleet_args(p: argparse.ArgumentParser):
    """The profile, the router, the KV fabric, the stand-in model: what every node of any deployment shares."""
    d = p.add_argument_group("deployment and models")
    d.add_argument("--profile", default=None, metavar="FILE.json|NAME",
                   help="Step-time profile (required): a file (`pdserve sim calibrate` writes a linear one; a roofline "
                        "one describes a GPU, docs/sim.md) or a shipped profile's name (qwen3-0.6b-b200, "
                        "llama-3-8b-b200: the seed's setups, fitted to its published TPOT).")
    d.add_argument("--router-policy", choices=("round-robin", "least-loaded"), default="round-robin",
                   help="The router's pick among nodes, its own code (default: round-robin).")
    d.add_argument("--kv-bandwidth-gb-s", type=float, default=DEFAULT_BANDWIDTH_GB_S,
                   help=f"XpYd: KV transfer bandwidth P -> D in GB/s (default: {DEFAULT_BANDWIDTH_GB_S}).")
    d.add_argument("--kv-latency-ms", type=float, default=DEFAULT_LATENCY_MS,
                   help=f"XpYd: fixed latency of one KV transfer in ms (default: {DEFAULT_LATENCY_MS}).")
    d.add_argument("--kv-lease-seconds", type=float, default=30.0,
                   help="XpYd: how long P holds a prefill's KV for D (kv_lease_seconds, default: 30). A request "
                        "that waits on D past it is prefilled on D instead.")
    d.add_argument("--kv-load-failure-rate", type=float, default=0.0,
                   help="XpYd: the chance that a KV load fails (seeded by --seed); D then prefills the prompt itself "
                        "(kv_load_failure_policy recompute) (default: 0).")
    d.add_argument("--router-latency-ms", type=float, default=0.0,
                   help="What the router adds each time it sends a request on (XpYd: to P, then to D; a collocated "
                        "pool of --nodes > 1: to its node; a lone collocated node has no router): its own HTTP in "
                        "and out, e.g. `benchmarks/pd_hops.py`'s TTFT through the router less P's own (default: 0).")
    d.add_argument("--kv-load-wait-ms", type=float, default=KVTransferConfig.kv_load_wait_ms,
                   help="XpYd: how long D's step waits for the KV loads it started before scheduling, so a short "
                        "pull joins this step rather than the next (the engine's kv_load_wait_ms; a cuda profile's "
                        "engine schedules asynchronously and never waits) (default: "
                        f"{KVTransferConfig.kv_load_wait_ms:g}).")
    d.add_argument("--spec-acceptance", type=float, default=0.5,
                   help="With --speculative-config: the chance that each draft token is accepted (drafts taken in "
                        "order until the first rejection), and that the stand-in model's next token repeats its "
                        "context, which is what n-gram drafts are found in (default: 0.5).")
    d.add_argument("--max-model-len", type=int, default=None,
                   help="Context length (default: the profile's model.max_model_len, else 4096).")
    d.add_argument("--pd-first-token", choices=("replay", "prefill"), default="replay",
                   help="XpYd: the router's --pd-first-token (docs/pd.md). replay: vLLM's, P prefills with "
                        "max_tokens 1, D imports n - 1 tokens and replays the last; prefill: P samples the first "
                        "token, which reaches the client at P's step end (TTFT holds no transfer), D imports n and "
                        "decodes it as a plain row (default: replay).")
    d.add_argument("--pd-early-decode", action=argparse.BooleanOptionalAction, default=True,
                   help="With --pd-first-token prefill: the router's --pd-early-decode (its default): D takes the "
                        "request when P is asked and holds its blocks while P prefills; P's KV comes to it from P's "
                        "step end (the direct hand-off), so D's own request latency is off the first gap. "
                        "--no-pd-early-decode: D is asked after P answered, with P's params (results then name the "
                        "arm first-token-late, as bench pd does).")
    d.add_argument("--step-by-step", action="store_true",
                   help="Run every step of every node through the scheduler. By default a node whose batch is a "
                        "steady decode run (every row one plain decode token, nothing to admit, no transfer due) "
                        "advances to the next thing that can change its batch (a row's last token, blocks running "
                        "short, a request routed to it, a load ending) in one leap, with the same steps, times and "
                        "counts (docs/sim.md, Scale); this flag is the check, and the slower way.")
    d.add_argument("--shared-host", action="store_true",
                   help="Every node on one machine's cores, as bench pd runs a deployment: a step takes (1 + the "
                        "profile's served.neighbour_scale x k) times as long when k other nodes are mid-step as it "
                        "starts (`sim calibrate --served --served-neighbours 1` fits it). Steps then go one by one "
                        "(no leaps). Default: each node on a machine of its own.")
    return d


ENGINE_SECTIONS = (CacheConfig, SchedulerConfig, CompilationConfig)


def _engine_kwargs(args, sections=ENGINE_SECTIONS) -> dict:
    """The engine flags of `sections` as EngineConfig keyword arguments."""
    import dataclasses
    # engine flags with nothing to act on in a simulation: refused, so a run never reads as if they had applied
    if args.gpu_memory_utilization is not None:
        raise ValueError("--gpu-memory-utilization: a simulated node's KV cache is --num-gpu-blocks-override "
                         "blocks, or --kv-cache-memory-gb over the profile's model.kv_bytes_per_token")
    if args.cudagraph_metrics:
        raise ValueError("--cudagraph-metrics: a simulated run's graph counts are in its result JSON (graph, and "
                         "per node under sim.nodes)")
    if SchedulerConfig in sections and args.async_scheduling is not None:  # plan takes no scheduler flags
        raise ValueError("--async-scheduling / --no-async-scheduling: a simulated node steps one step after another; "
                         "an overlap shows only in the step times the profile was measured with")
    names = {f.name for cls in sections for f in dataclasses.fields(cls) if f.metadata.get("cli", True)}
    kw = {k: v for k, v in vars(args).items() if k in names}
    kw["max_model_len"] = args.max_model_len
    return kw


def _engine_config(args) -> EngineConfig:
    kw = _engine_kwargs(args)
    if args.speculative_config is not None:
        from pdserve.spec_decode.config import SpeculativeConfig
        kw["speculative_config"] = SpeculativeConfig.from_flag(args.speculative_config)
    return EngineConfig.from_kwargs("sim", device="cpu", **kw)


RANDOM_DEFAULTS = {"num_prompts": 64, "random_input_len": 256, "random_output_len": 64, "random_range_ratio": 0.0,
                   "random_prefix_len": 0, "request_rate": "1", "burstiness": 1.0}


def _workload_flags(args, random_only: tuple = tuple(RANDOM_DEFAULTS)) -> None:
    """The random generator's flags mean nothing with a trace (it has its own lengths and times): refused by name,
    not ignored; without a trace, their defaults."""
    given = [k for k in random_only if getattr(args, k) is not None]
    if args.trace is not None and given:
        raise ValueError(f"--{given[0].replace('_', '-')} is for the random generator; --trace {args.trace} has its "
                         "own requests and arrival times")
    for k, v in RANDOM_DEFAULTS.items():
        if k in random_only and getattr(args, k) is None:
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
    transfer = TransferModel(args.kv_bandwidth_gb_s * 1e9, args.kv_latency_ms / 1000.0, args.kv_lease_seconds,
                             args.kv_load_failure_rate, args.kv_load_wait_ms / 1000.0, args.router_latency_ms / 1000.0)
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
    # the arm, as bench pd names it: collocated (collocated-xN for a pool of N), first-token, or the decode nodes'
    # rule ('default' when the flag was left alone)
    rule = config.compilation.full_graph_rule
    if args.pd_first_token == "prefill" and not dep.num_prefill:
        raise ValueError("--pd-first-token prefill is for XpYd deployments (P samples the first token for D)")
    arm = ("collocated" if dep.num_decode == 1 else f"collocated-x{dep.num_decode}") if not dep.num_prefill else \
        ("first-token" if args.pd_early_decode else "first-token-late") if args.pd_first_token == "prefill" else (
            "default" if rule == CompilationConfig().full_graph_rule else rule)
    rows = []
    for rate, trace in runs:
        result = simulate(trace, dep, config, profile, transfer=transfer, policy=args.router_policy,
                          spec_acceptance=args.spec_acceptance, seed=args.seed, pd_first_token=args.pd_first_token,
                          early_decode=args.pd_early_decode, step_by_step=args.step_by_step,
                          shared_host=args.shared_host)
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
            + (f"({r['sim']['kv_failed_loads']} KV loads failed, {r['sim']['kv_expired_leases']} leases expired) "
               if r["sim"].get("kv_failed_loads") or r["sim"].get("kv_expired_leases") else "")
            + f"(simulated in {r['sim']['wall_s']:.1f} s)")


def add_calibrate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="Local Hugging Face model directory to measure.")
    p.add_argument("--out", default="profile.json", help="Where the profile goes (default: profile.json).")
    p.add_argument("--name", default=None, help="The profile's name (default: the model directory's name).")
    p.add_argument("--rows", default="1,4,16", help="Comma-separated batch sizes to measure (default: 1,4,16).")
    p.add_argument("--context-lens", default="64,256",
                   help="Comma-separated prompt lengths to measure (default: 64,256).")
    p.add_argument("--decode-steps", type=int, default=16,
                   help="Output tokens per request, so decode steps per batch (default: 16).")
    p.add_argument("--served", action="store_true",
                   help="Also run the grid through a real `pdserve serve` (started and stopped here, with this "
                        "process's OMP_NUM_THREADS) and fit what serving adds: served decode steps as scale x the "
                        "bare step + overhead, each request's latency outside the steps, how late its chunks come, "
                        "and what a newcomer's arrival costs a running stream beyond its prefill step (the profile's "
                        "`served` section; needs 1 in --rows).")
    p.add_argument("--served-repeats", type=int, default=3, metavar="R",
                   help="With --served: run the served grid R times; each batch's decode run and each lone "
                        "request's first chunk are fitted as the median over them (default: 3).")
    p.add_argument("--served-neighbours", type=int, default=0, metavar="N",
                   help="With --served: start N more servers that decode batches back to back while the grid runs "
                        "again, fitting how much longer a step takes per busy neighbour on this machine's cores "
                        "(served.neighbour_scale, used by `pdserve sim --shared-host`) (default: 0, not measured).")


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
                  progress=lambda msg: print(f"[calibrate] {msg}", flush=True), served=args.served,
                  neighbours=args.served_neighbours, served_repeats=args.served_repeats)
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
    if "served" in d:
        s, sf = d["served"], f["served"]
        print(f"[calibrate] served: step = {s['step_scale']:.3f} x bare + {1e3 * s['step_overhead_s']:.3f} ms "
              f"({sf['decode_runs']} decode runs, median error {100 * sf['median_rel_error']:.1f}%), request "
              f"latency {1e3 * s['request_latency_s']:.2f} ms ({sf['first_chunks']} lone requests)")
        tails = [(f"{r} rows", q[-2]) for r, q in s["chunk_delay_by_rows"].items() if len(q) > 2]
        tails += [("pooled", s["chunk_delay_quantiles_s"][-2])] if len(s["chunk_delay_quantiles_s"]) > 2 else []
        print("[calibrate] chunk delays at p99: " + ", ".join(f"{1e3 * v:.1f} ms ({r})" for r, v in tails))
        if "neighbour_scale" in s:
            print(f"[calibrate] beside {sf['neighbours']} busy server(s): a step x (1 + {s['neighbour_scale']:.3f} per "
                  f"busy neighbour) ({sf['neighbour_runs']} decode runs, ratios {sf['neighbour_ratio_min']:.2f}-"
                  f"{sf['neighbour_ratio_max']:.2f})")
    print(f"[calibrate] profile written to {args.out}")
    return 0


# ---- pdserve plan ----------------------------------------------------------------------------------------------
PLAN_GRID = {"max_num_seqs": "64,256", "max_num_batched_tokens": "2048,8192", "long_prefill_token_threshold": "0",
             "num_speculative_tokens": "0"}
# n-gram drafting as the simulator's tests run it: the stand-in model's text repeats in short spans
PLAN_SPEC_BASE = {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 2}
# more than sim's 64: a short trace at a rate past a candidate's knee arrives as a burst that the queue absorbs
# within the TTFT SLO, and would score the burst's drain rate as goodput (the ranking marks such points)
PLAN_NUM_PROMPTS = 500


def add_plan_args(p: argparse.ArgumentParser) -> None:
    add_workload_args(p, rates="Comma-separated request rates in req/s for a whole deployment, every candidate run "
                               "at each (a trace's arrival times scaled to each). Default: a sweep per candidate, "
                               "doubling from --start-rate until its goodput falls past the knee, then the "
                               "bracket around its best halved (the midpoints on both sides, round after round) "
                               "while --max-rates lasts.", num_prompts=PLAN_NUM_PROMPTS)
    add_fleet_args(p)
    s = p.add_argument_group("search (each list flag: comma-separated values, every combination tried)")
    s.add_argument("--goodput", nargs="+", default=None, metavar="METRIC:MS",
                   help="The SLOs, as vLLM bench serve's --goodput (required): e.g. ttft:200 tpot:50 (metrics ttft, "
                        "tpot, e2el; milliseconds). A request is good when it meets every one; goodput is good "
                        "requests per second.")
    s.add_argument("--slo-attainment", type=float, default=0.0, metavar="PCT",
                   help="A rate counts only when at least PCT%% of its requests meet every SLO: e.g. 90 holds the "
                        "SLOs at the p90 (DistServe's per-GPU goodput); the sweep stops at the first rate short of it "
                        "(default: 0, vLLM's goodput: every good request counts, at any rate).")
    s.add_argument("--nodes", type=int, default=4,
                   help="Nodes of every candidate deployment: collocated x N and each XpYd with X + Y = N "
                        "(default: 4).")
    s.add_argument("--deployments", default=None, metavar="LIST",
                   help="Only these splits, e.g. collocated,1p3d (default: all of --nodes).")
    for name, default in PLAN_GRID.items():
        what = {"max_num_seqs": "the most requests in a step",
                "max_num_batched_tokens": "the step's token budget",
                "long_prefill_token_threshold": "the most tokens of one prompt's chunk in a step (0: the budget "
                                                "only)",
                "num_speculative_tokens": "speculative decoding's K (0: none; K > 0: n-gram drafting with "
                                          "--speculative-config's other fields)"}[name]
        s.add_argument("--" + name.replace("_", "-"), default=default, metavar="LIST",
                       help=f"The {name} values to try: {what} (default: {default}).")
    s.add_argument("--speculative-config", default=None, metavar="JSON",
                   help="The n-gram drafter for K > 0, K itself from --num-speculative-tokens (default: "
                        f"{json.dumps(PLAN_SPEC_BASE)}).")
    s.add_argument("--start-rate", type=float, default=None,
                   help="The sweep's first rate, per node in req/s (default: a quarter of what the candidate serves "
                        "by a rough estimate from the profile: its prefill nodes' mean prompts back to back, its "
                        "decode nodes' steps full at max_num_seqs rows).")
    s.add_argument("--max-rates", type=int, default=8, help="Most rates a candidate's sweep runs (default: 8).")
    for cls in (CacheConfig, CompilationConfig):
        add_dataclass_args(p, cls)
    o = p.add_argument_group("output")
    o.add_argument("--result-dir", default="plan-results",
                   help="Where plan.json (every candidate's rates), ranking.txt and plan.png go (default: "
                        "plan-results).")
    o.add_argument("--top", type=int, default=10, help="Ranking rows printed (default: 10; ranking.txt has all).")
    o.add_argument("--plot-top", type=int, default=3,
                   help="Candidates in plan.png, goodput against rate (default: 3).")
    o.add_argument("--quiet", action="store_true", help="No progress bar.")


def _int_list(flag: str, text: str, lo: int) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        vals = []
    if not vals or min(vals) < lo:
        raise ValueError(f"{flag}: {text!r} is not a comma-separated list of integers >= {lo}")
    return sorted(set(vals))


def run_plan(args) -> int:
    from pdserve.bench.metrics import parse_goodput
    from pdserve.sim.connector import TransferModel
    from pdserve.sim.plan import (candidates, engine_config, format_ranking, plan_search, plot_goodput, splits,
                                  to_json)
    from pdserve.sim.profile import load_profile
    from pdserve.sim.run import parse_deployment
    from pdserve.sim.trace import load_trace, random_trace
    slos = parse_goodput(args.goodput)
    if not slos:
        raise ValueError("--goodput is required: the SLOs a good request meets, e.g. --goodput ttft:200 tpot:50")
    if not all(math.isfinite(v) for v in slos.values()):
        raise ValueError("--goodput: every SLO must be a finite number of milliseconds")
    if not 0 <= args.slo_attainment <= 100:
        raise ValueError("--slo-attainment: a percentage in [0, 100]")
    if args.profile is None:
        raise ValueError("--profile is required (pdserve sim calibrate --model DIR writes one)")
    if args.trace is None and args.num_prompts is None:
        args.num_prompts = PLAN_NUM_PROMPTS
    _workload_flags(args, tuple(k for k in RANDOM_DEFAULTS if k != "request_rate"))
    rates = _rates(args.request_rate) if args.request_rate is not None else None
    if args.nodes < 1:
        raise ValueError("--nodes must be >= 1")
    if args.max_rates < 1:
        raise ValueError("--max-rates must be >= 1")
    if args.start_rate is not None and not (args.start_rate > 0 and math.isfinite(args.start_rate)):
        raise ValueError("--start-rate must be a number of req/s > 0")
    if args.top < 1 or args.plot_top < 0:
        raise ValueError("--top must be >= 1 and --plot-top >= 0")
    if not 0 <= args.spec_acceptance <= 1:
        raise ValueError("--spec-acceptance must be in [0, 1]")
    if args.deployments is None:
        deps = splits(args.nodes)
    else:
        deps = []
        for spec in [x.strip() for x in args.deployments.split(",") if x.strip()] or [""]:
            try:
                deps.append(parse_deployment(spec, args.nodes if spec == "collocated" else 1))
            except ValueError as e:
                raise ValueError(f"--deployments: {str(e).removeprefix('--deployment ')}") from None
    ks = _int_list("--num-speculative-tokens", args.num_speculative_tokens, 0)
    cands = candidates(deps, _int_list("--max-num-seqs", args.max_num_seqs, 1),
                       _int_list("--max-num-batched-tokens", args.max_num_batched_tokens, 1),
                       _int_list("--long-prefill-token-threshold", args.long_prefill_token_threshold, 0), ks)
    spec_base = dict(PLAN_SPEC_BASE)
    if args.speculative_config is not None:
        from pdserve.spec_decode.config import SpeculativeConfig
        try:
            d = json.loads(args.speculative_config)
            if not isinstance(d, dict):
                raise ValueError(f"a JSON object, got {type(d).__name__}")
            SpeculativeConfig.from_json(json.dumps({**d, "num_speculative_tokens": 1}))  # K is checked per value
        except ValueError as e:
            raise ValueError(f"--speculative-config: {e}") from None
        spec_base = {k: v for k, v in d.items() if k != "num_speculative_tokens"}
    profile = load_profile(args.profile)
    transfer = TransferModel(args.kv_bandwidth_gb_s * 1e9, args.kv_latency_ms / 1000.0, args.kv_lease_seconds,
                             args.kv_load_failure_rate, args.kv_load_wait_ms / 1000.0, args.router_latency_ms / 1000.0)
    base = _engine_kwargs(args, (CacheConfig, CompilationConfig))
    for c in cands:  # every candidate's config checked before the first run, an error naming the candidate
        try:
            engine_config(base, c, spec_base)
        except (ValueError, TypeError) as e:
            raise ValueError(f"{c.label}: {e}") from None
    if args.trace is not None:
        trace = load_trace(args.trace)
    else:  # generated at 1 req/s, scaled to each rate: the same lengths and arrival gaps for every candidate
        trace = random_trace(args.num_prompts, args.random_input_len, args.random_output_len, 1.0,
                             args.random_range_ratio, args.burstiness, args.seed, args.random_prefix_len)
    mean_in = sum(r.prompt_len for r in trace) / len(trace)
    mean_out = sum(r.output_len for r in trace) / len(trace)
    out = Path(args.result_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--result-dir {out}: {e.strerror or e}") from None
    from tqdm import tqdm
    bar = tqdm(total=len(cands), desc="pdserve plan", unit="candidate", disable=args.quiet, file=sys.stderr)

    def progress(c) -> None:
        bar.set_postfix_str(c.label, refresh=False)
        bar.update(1)
    t0 = time.perf_counter()
    try:
        ranked = plan_search(cands, trace, profile, base, spec_base, slos, transfer=transfer,
                             policy=args.router_policy, spec_acceptance=args.spec_acceptance, seed=args.seed,
                             rates=rates, start_rate=args.start_rate, max_rates=args.max_rates, progress=progress,
                             pd_first_token=args.pd_first_token, early_decode=args.pd_early_decode,
                             attainment=args.slo_attainment / 100,
                             step_by_step=args.step_by_step, shared_host=args.shared_host)
    finally:
        bar.close()
    table = format_ranking(ranked, slos, attainment=args.slo_attainment / 100)
    print(format_ranking(ranked, slos, args.top, args.slo_attainment / 100))
    (out / "ranking.txt").write_text(table + "\n")
    (out / "plan.json").write_text(json.dumps(json_safe({
        "date": time.strftime("%Y-%m-%d %H:%M:%S"), "simulated": True, "profile": str(args.profile),
        "model": profile.raw.get("name", "sim"), "goodput_slos_ms": {k: 1000 * v for k, v in slos.items()},
        "slo_attainment_pct": args.slo_attainment,
        "workload": {"trace": args.trace, "requests": len(trace), "mean_input_len": mean_in,
                     "mean_output_len": mean_out},
        "rates": rates, "start_rate_per_node": args.start_rate, "max_rates": args.max_rates,
        "wall_s": time.perf_counter() - t0,
        "ranking": to_json(ranked)}), indent=1))
    png = plot_goodput(ranked, out / "plan.png", args.plot_top) if args.plot_top else None
    print(f"[plan] {len(cands)} candidates in {time.perf_counter() - t0:.1f} s; results in {out}/ (plan.json, "
          f"ranking.txt{', ' + png.name if png else ''})")
    return 0
