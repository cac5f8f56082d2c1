"""The seed's "Pre-PR vs Post-PR" tables (shared/seed, vLLM PR #58374) in simulation: 1P1D, Qwen3-0.6B and
Llama-3-8B-Instruct on B200, random 1024/256 at 8/16/32 req/s and 4096/1024 at 4/8/16 req/s, 60 s of arrivals a
point, each point under `--full-graph-rule strict` (the seed's "before") and the default rule ("after"), on the
shipped roofline profiles (pdserve/sim/profiles/, fitted by benchmarks/sim_seed_fit.py).

    .venv/bin/python benchmarks/sim_seed_table.py            # writes benchmarks/results/sim_seed_table.json
    .venv/bin/python benchmarks/sim_seed_table.py --models qwen3-0.6b --out /tmp/q.json

Prints, per row, the simulated figure beside the seed's: the non-FULL share of D's steps in both arms (and the
difference in percentage points), mean and p99 TPOT, p99 ITL, median TTFT; and what fell off FULL on D under the
default rule (the graph metrics' reasons, D's preemptions). Deterministic: fixed seeds (--seed), no wall clock in
the figures. The whole table takes about 1 min 40 s
on this repository's 2-core machine.

What the seed ran that is not in its text is taken as vLLM's defaults for a B200 (one GPU over 70 GiB, the OpenAI
server): max_num_seqs 1024, max_num_batched_tokens 8192, block size 16, prefix caching and chunked prefill on,
capture sizes up to min(2 x max_num_seqs, 512), gpu_memory_utilization 0.9 (the KV cache: `kv_cache_gib`).
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

DURATION_S = 60.0  # "60s per point": Poisson arrivals at the rate for 60 s, every request run to its end
WORKLOADS = [(1024, 256, 8), (1024, 256, 16), (1024, 256, 32), (4096, 1024, 4), (4096, 1024, 8), (4096, 1024, 16)]
ARMS = (("before", "strict"), ("after", "decode-shaped"))

# B200 (HGX, one GPU): 180 GB HBM3e at 8 TB/s, 2.25 PFLOPS dense BF16 (NVIDIA's datasheet); CUDA reports 178.35 GiB
# of device memory (pytorch/ao#4002's cudaGetDeviceProperties dump), what vLLM's 0.9 is a share of
B200 = {"name": "B200", "memory_bandwidth_gb_s": 8000, "peak_tflops": 2250}
B200_MEMORY_GIB = 178.35
GPU_MEMORY_UTILIZATION = 0.9
# what vLLM keeps off the KV cache beside the weights: the profiling forward's activations at 8192 tokens, the
# sampler's logits for max_num_seqs rows, CUDA graphs, cuBLAS/NCCL workspaces; an estimate, not a measurement
NON_KV_RESERVE_GIB = 3.0

# The seed's figures (shared/seed/000_8cdcdb96ebb6b31e.txt, "Pre-PR vs Post-PR"), transcribed: per (ISL, OSL, rate),
# before -> after of non-FULL share %, mean TPOT ms, p99 TPOT ms, p99 ITL ms, median TTFT ms.
SEED = {
    "qwen3-0.6b": {
        (1024, 256, 8): ((1.31, 0.00), (1.49, 1.47), (1.67, 1.63), (4.28, 3.23), (37.12, 35.16)),
        (1024, 256, 16): ((2.60, 0.00), (1.68, 1.60), (2.14, 1.97), (4.94, 4.86), (42.52, 39.78)),
        (1024, 256, 32): ((6.80, 0.00), (2.27, 1.99), (2.93, 2.51), (8.61, 7.61), (52.86, 47.08)),
        (4096, 1024, 4): ((0.94, 0.00), (2.66, 2.53), (3.65, 3.42), (14.33, 10.28), (98.01, 88.79)),
        (4096, 1024, 8): ((4.31, 0.00), (7.38, 6.31), (10.22, 8.59), (36.94, 31.29), (139.15, 122.73)),
        (4096, 1024, 16): ((12.35, 0.04), (26.03, 24.62), (30.90, 29.31), (81.62, 69.65), (15480.0, 13490.0)),
    },
    "llama-3-8b": {
        (1024, 256, 8): ((3.08, 0.00), (3.78, 3.78), (3.91, 3.88), (4.96, 4.76), (51.32, 51.11)),
        (1024, 256, 16): ((6.29, 0.00), (4.07, 4.06), (4.59, 4.52), (8.07, 8.05), (59.13, 60.07)),
        (1024, 256, 32): ((14.99, 0.00), (5.04, 4.86), (6.02, 5.75), (15.06, 13.94), (70.29, 68.56)),
        (4096, 1024, 4): ((2.40, 0.00), (6.92, 6.98), (8.22, 8.31), (38.06, 39.76), (157.81, 160.89)),
        (4096, 1024, 8): ((8.93, 0.00), (16.52, 16.91), (20.44, 21.04), (47.57, 48.61), (228.86, 232.82)),
        (4096, 1024, 16): ((16.00, 2.34), (29.49, 29.83), (40.19, 41.63), (134.19, 132.36), (18340.0, 18610.0)),
    },
}
# P holds a prefill's blocks for D until D reads them or VLLM_NIXL_ABORT_REQUEST_TIMEOUT (480 s) passes: the sim's
# lease (its default, 30 s, would end the longest waits of the overloaded points in a recompute on D)
NIXL_ABORT_REQUEST_TIMEOUT_S = 480.0
COLUMNS = ("non_full_pct", "mean_tpot_ms", "p99_tpot_ms", "p99_itl_ms", "median_ttft_ms")

# The real architectures (their Hugging Face config.json), bf16
ARCH = {
    "qwen3-0.6b": {"hf": "Qwen/Qwen3-0.6B", "layers": 28, "hidden": 1024, "heads": 16, "kv_heads": 8,
                   "head_dim": 128, "intermediate": 3072, "vocab": 151936, "tied_embeddings": True,
                   "max_position_embeddings": 40960},
    "llama-3-8b": {"hf": "meta-llama/Meta-Llama-3-8B-Instruct", "layers": 32, "hidden": 4096, "heads": 32,
                   "kv_heads": 8, "head_dim": 128, "intermediate": 14336, "vocab": 128256,
                   "tied_embeddings": False, "max_position_embeddings": 8192},
}
PROFILE_NAME = {"qwen3-0.6b": "qwen3-0.6b-b200", "llama-3-8b": "llama-3-8b-b200"}
DTYPE_BYTES = 2


def model_fields(a: dict) -> dict:
    """The roofline's model section from the architecture: parameters by matrix, bytes in bf16."""
    h, d = a["hidden"], a["head_dim"]
    attn = h * a["heads"] * d * 2 + h * a["kv_heads"] * d * 2  # q, o; k, v
    mlp = 3 * h * a["intermediate"]  # gate, up, down
    layer = attn + mlp + 2 * h + 2 * d  # the norms (Qwen3's q/k norms: 2 x head_dim; Llama has none, negligible)
    embed = a["vocab"] * h
    lm_head = embed  # tied or not, the logits read a vocab x hidden matrix every step
    total = a["layers"] * layer + embed + (0 if a["tied_embeddings"] else lm_head) + h
    # a step reads every layer's weights and the LM head; the embedding lookup reads only its rows
    read = a["layers"] * layer + lm_head + h
    return {"name": a["hf"], "parameters": total, "weight_bytes": read * DTYPE_BYTES,
            "flops_per_token": 2 * (a["layers"] * (attn + mlp) + lm_head),
            # QK^T and PV: 2 x 2 x head_dim FLOPs per (query, key) pair, per head, per layer
            "attention_flops_per_pair": 4 * d * a["heads"] * a["layers"],
            "kv_bytes_per_token": 2 * a["layers"] * a["kv_heads"] * d * DTYPE_BYTES,
            "max_model_len": a["max_position_embeddings"]}


def kv_cache_gib(key: str) -> float:
    """vLLM's KV cache on one B200 at gpu_memory_utilization 0.9: that share of the device less the weights (all of
    them, embedding included) and NON_KV_RESERVE_GIB."""
    m = model_fields(ARCH[key])
    # to 0.01 GiB, so that `pdserve sim --kv-cache-memory-gb` with the printed figure sizes the same cache
    return round(GPU_MEMORY_UTILIZATION * B200_MEMORY_GIB - m["parameters"] * DTYPE_BYTES / 2 ** 30
                 - NON_KV_RESERVE_GIB, 2)


# vLLM's default for a GPU of 70 GiB or more behind the OpenAI server; the seed does not say which it ran with
MAX_NUM_SEQS = 1024


def engine_config(key: str, rule: str, max_num_seqs: int = MAX_NUM_SEQS):
    from pdserve.config import EngineConfig
    return EngineConfig.from_kwargs("sim", max_num_seqs=max_num_seqs, max_num_batched_tokens=8192, block_size=16,
                                    kv_cache_memory_gb=kv_cache_gib(key), full_graph_rule=rule,
                                    max_model_len=ARCH[key]["max_position_embeddings"])


def transfer_model(profile):
    """The NIXL link as the profile's fit found it (fit.kv_transfer: latency, bandwidth; sim_seed_fit.py), else the
    sim's defaults (100 Gb/s, 1 ms)."""
    from pdserve.sim.connector import TransferModel
    kv = profile.raw.get("fit", {}).get("kv_transfer") or {"latency_ms": 1.0, "bandwidth_gb_s": 12.5}
    return TransferModel(kv["bandwidth_gb_s"] * 1e9, kv["latency_ms"] / 1e3, NIXL_ABORT_REQUEST_TIMEOUT_S)


def trace_for(isl: int, osl: int, rate: float, seed: int):
    from pdserve.sim.trace import random_trace
    # as many prompts as arrive in 60 s at the rate (bench serve is given --num-prompts = rate x 60)
    return random_trace(int(rate * DURATION_S), isl, osl, rate, 0.0, 1.0, seed)


def run_point(key: str, profile, isl: int, osl: int, rate: float, rule: str, seed: int = 0,
              max_num_seqs: int = MAX_NUM_SEQS) -> dict:
    """One simulated point: the figures the seed's table has, and what D did (graph reasons, preemptions)."""
    from pdserve.sim.run import parse_deployment, simulate
    d_steps = {"rows": 0, "steps": 0, "max_rows": 0, "tokens_over_512": 0}

    def on_step(node, rec):
        if node.name.startswith("decode") and rec.mode:
            d_steps["rows"] += len(rec.rows)
            d_steps["steps"] += 1
            d_steps["max_rows"] = max(d_steps["max_rows"], len(rec.rows))
    t0 = time.perf_counter()
    r = simulate(trace_for(isl, osl, rate, seed), parse_deployment("1p1d"), engine_config(key, rule, max_num_seqs),
                 profile, transfer=transfer_model(profile), seed=seed, on_step=on_step)
    wall = time.perf_counter() - t0
    g = r["graph"]
    tpots = r["tpot_ms"]
    d = [n for n in r["sim"]["nodes"] if n["role"] == "decode"][0]
    p = [n for n in r["sim"]["nodes"] if n["role"] == "prefill"][0]
    return {"non_full_pct": 100.0 * g["non_full_share"], "mean_tpot_ms": tpots["mean"],
            "p99_tpot_ms": tpots["p99"], "p99_itl_ms": r["itl_ms"]["p99"], "median_ttft_ms": r["ttft_ms"]["median"],
            "completed": r["completed"], "failed": r["failed"], "duration_s": r["duration"],
            "d_steps": d["graph"]["total_steps"], "d_non_full_steps": g["non_full_steps"],
            "d_non_full_by_reason": g["non_full_reasons"], "d_steps_by_mode": d["graph"]["steps"],
            "d_preemptions": d["preemptions"], "p_preemptions": p["preemptions"],
            "d_mean_rows_per_step": d_steps["rows"] / max(d_steps["steps"], 1), "d_max_rows": d_steps["max_rows"],
            "ttft_split_ms": r["router_ttft_split_ms"], "wall_s": wall}


def _fmt(v: float) -> str:
    return f"{v / 1000:.2f}s" if v >= 1000 else f"{v:.2f}"


def format_table(rows: list[dict]) -> str:
    """Two tables: the non-FULL share of D's steps in both arms (sim / seed, and the difference in percentage
    points), then the latency columns of each arm (sim / seed)."""
    head = (f"{'model':<11} {'ISL/OSL':>9} {'req/s':>5} | {'before: sim / seed (pp)':>25} | "
            f"{'after: sim / seed (pp)':>24}")
    lines = ["non-FULL share of D's steps, %", head, "-" * len(head)]
    for r in rows:
        cells = []
        for arm, _ in ARMS:
            sim, ref = r[arm]["non_full_pct"], r["seed"][arm]["non_full_pct"]
            cells.append(f"{sim:6.2f} / {ref:5.2f} ({sim - ref:+6.2f})")
        lines.append(f"{r['model']:<11} {r['isl']:>4}/{r['osl']:<4} {r['rate']:>5g} | {cells[0]:>25} | "
                     f"{cells[1]:>24}")
    head = (f"{'model':<11} {'ISL/OSL':>9} {'req/s':>5} {'arm':>6} | " +
            " | ".join(f"{c:>17}" for c in ("mean TPOT ms", "p99 TPOT ms", "p99 ITL ms", "median TTFT ms")))
    lines += ["", "latency, sim / seed", head, "-" * len(head)]
    for r in rows:
        for arm, _ in ARMS:
            lines.append(f"{r['model']:<11} {r['isl']:>4}/{r['osl']:<4} {r['rate']:>5g} {arm:>6} | " + " | ".join(
                f"{_fmt(r[arm][c]) + ' / ' + _fmt(r['seed'][arm][c]):>17}" for c in COLUMNS[1:]))
    return "\n".join(lines)


def seed_row(key: str, isl: int, osl: int, rate: float) -> dict:
    vals = SEED[key][(isl, osl, rate)]
    return {arm: {c: v[i] for c, v in zip(COLUMNS, vals)} for i, (arm, _) in enumerate(ARMS)}


def main() -> int:
    from pdserve.sim.profile import load_profile
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="qwen3-0.6b,llama-3-8b", help="Comma-separated: qwen3-0.6b, llama-3-8b.")
    p.add_argument("--seed", type=int, default=0, help="Seed of the arrivals and token ids (default: 0).")
    p.add_argument("--workloads", default=None, metavar="LIST",
                   help="Only these of the seed's workloads, ISL/OSL@rate comma-separated (e.g. 4096/1024@16; "
                        "default: all six).")
    p.add_argument("--max-num-seqs", type=int, default=MAX_NUM_SEQS,
                   help=f"D's and P's max_num_seqs (default: {MAX_NUM_SEQS}, vLLM's for a B200; the seed does not "
                        "say).")
    p.add_argument("--out", default=None,
                   help="Result JSON (default: benchmarks/results/sim_seed_table.json, with a non-default "
                        "--max-num-seqs sim_seed_table_seqs<N>.json).")
    args = p.parse_args()
    if args.out is None:
        tail = ("" if args.max_num_seqs == MAX_NUM_SEQS else f"_seqs{args.max_num_seqs}") + \
            (f"_seed{args.seed}" if args.seed else "")
        args.out = str(ROOT / f"benchmarks/results/sim_seed_table{tail}.json")
    workloads = WORKLOADS
    if args.workloads:
        names = {f"{i}/{o}@{r:g}": (i, o, r) for i, o, r in WORKLOADS}
        unknown = [w for w in args.workloads.split(",") if w not in names]
        if unknown:
            p.error(f"--workloads: {unknown[0]} is not one of {', '.join(names)}")
        workloads = [names[w] for w in args.workloads.split(",")]
    t0 = time.perf_counter()
    rows = []
    for key in args.models.split(","):
        profile = load_profile(PROFILE_NAME[key])
        for isl, osl, rate in workloads:
            row = {"model": key, "profile": PROFILE_NAME[key], "isl": isl, "osl": osl, "rate": rate,
                   "seed": seed_row(key, isl, osl, rate)}
            for arm, rule in ARMS:
                row[arm] = run_point(key, profile, isl, osl, rate, rule, args.seed, args.max_num_seqs)
            rows.append(row)
            print(f"{key} {isl}/{osl} @ {rate:g}: non-FULL % before {row['before']['non_full_pct']:.2f} (seed "
                  f"{row['seed']['before']['non_full_pct']:.2f}), after {row['after']['non_full_pct']:.2f} (seed "
                  f"{row['seed']['after']['non_full_pct']:.2f}) [{row['before']['wall_s'] + row['after']['wall_s']:.0f}"
                  " s]", flush=True)
    wall = time.perf_counter() - t0
    print()
    print(format_table(rows))
    print()
    for r in rows:
        a = r["after"]
        print(f"{r['model']} {r['isl']}/{r['osl']} @ {r['rate']:g}: D under the default rule: {a['d_steps']} steps, "
              f"non-FULL {a['d_non_full_steps']} by reason {a['d_non_full_by_reason']}, {a['d_preemptions']} "
              f"preemptions, {a['d_mean_rows_per_step']:.1f} rows a step (max {a['d_max_rows']}); before: "
              f"{r['before']['d_non_full_by_reason']}, {r['before']['d_preemptions']} preemptions")
    print(f"\n{len(rows)} rows x 2 arms simulated in {wall:.0f} s")
    from benchmarks.results_file import write_result
    write_result(args.out, args, wall_s=round(wall, 1), duration_s=DURATION_S,
                 kv_cache_gib={k: round(kv_cache_gib(k), 2) for k in args.models.split(",")},
                 profiles={k: load_profile(PROFILE_NAME[k]).raw for k in args.models.split(",")},
                 rows=_json_safe(rows), table=format_table(rows))
    return 0


def _json_safe(x):
    if isinstance(x, dict):
        return {str(k): _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


if __name__ == "__main__":
    sys.exit(main())
