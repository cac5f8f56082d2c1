"""How `pdserve sim` scales: wall time of 10k, 30k and 100k requests over 32 nodes (issue 36: 100k requests over 32
nodes in under 10 minutes on this machine).

    .venv/bin/python benchmarks/sim_scale.py                      # writes benchmarks/results/sim_scale.json
    .venv/bin/python benchmarks/sim_scale.py --sizes 2000 --out /tmp/probe.json
    .venv/bin/python benchmarks/sim_scale.py --deployment 16p16d --sizes 10000

The workload: bench serve's random generator (prompts 1024 +- 50%, outputs 128 +- 50%, Poisson arrivals) at a rate
per node that keeps every node busy (the result has each run's busy share and rows per step) without queues that
grow without bound (the median TTFT of the last tenth of the requests is reported beside the first tenth's), on a
roofline profile of an 8B-class model (bf16, GQA 8 KV heads) on an H100's datasheet. The rate scales with the node count
and the trace with the size, so the simulated duration grows linearly with the request count and so should the wall
time; the table gives simulated requests per wall second at each size. Every size is one run, timed whole (trace
generation, node construction, the event loop, the metrics); the machine should be quiet (two cores shared).
"""
from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# Llama-3-8B-like (32 layers, 8 KV heads of 128, bf16: 128 KiB of KV a token; 16 GB of weights) on an H100 SXM's
# datasheet (3.35 TB/s, 989 dense bf16 TFLOPs); per-mode overheads as a captured FULL graph vs. launches vary
PROFILE = {"type": "roofline", "name": "llama3-8b-like", "device": "cuda",
           "gpu": {"name": "H100-SXM", "memory_bandwidth_gb_s": 3350, "peak_tflops": 989},
           "model": {"kv_bytes_per_token": 131072, "weight_bytes": 16.0e9, "flops_per_token": 16.0e9,
                     "attention_flops_per_pair": 524288, "max_model_len": 4096},
           "step_overhead_s": {"FULL": 2e-5, "PIECEWISE": 4e-4, "NONE": 1.5e-3}}


def run_one(num: int, args) -> dict:
    from pdserve.config import EngineConfig
    from pdserve.sim.connector import TransferModel
    from pdserve.sim.profile import profile_from_dict
    from pdserve.sim.run import parse_deployment, simulate
    from pdserve.sim.trace import random_trace
    t0 = time.perf_counter()
    dep = parse_deployment(args.deployment, args.nodes if args.deployment == "collocated" else 1)
    nodes = dep.num_prefill + dep.num_decode
    rate = args.rate_per_node * nodes
    trace = random_trace(num, args.input_len, args.output_len, rate, range_ratio=0.5, seed=args.seed)
    config = EngineConfig.from_kwargs("sim", max_num_seqs=args.max_num_seqs, kv_cache_memory_gb=args.kv_cache_gb,
                                      max_model_len=4096)
    seen = {"rows": 0, "busy": 0.0}

    def on_step(node, rec):  # how full and how busy the nodes were: the workload is meant to keep them working
        seen["rows"] += len(rec.rows)
        seen["busy"] += rec.end - rec.start
    r = simulate(trace, dep, config, profile_from_dict(PROFILE), transfer=TransferModel(50e9, 0.5e-3),
                 policy=args.router_policy, seed=args.seed, on_step=on_step)
    wall = time.perf_counter() - t0
    tenth = max(1, num // 10)
    steps = sum(n["steps"] for n in r["sim"]["nodes"])
    return {"requests": num, "deployment": dep.name, "request_rate": rate, "wall_s": round(wall, 2),
            "loop_wall_s": round(r["sim"]["wall_s"], 2), "requests_per_wall_s": round(num / wall, 1),
            "simulated_s": round(r["duration"], 2), "completed": r["completed"], "failed": r["failed"],
            "node_steps": steps, "node_steps_per_wall_s": round(steps / wall),
            "mean_rows_per_step": round(seen["rows"] / max(steps, 1), 1),
            "node_busy_share": round(seen["busy"] / (nodes * r["duration"]), 3),
            "median_ttft_ms_first_tenth": round(1e3 * statistics.median(r["ttfts"][:tenth]), 1),
            "median_ttft_ms_last_tenth": round(1e3 * statistics.median(r["ttfts"][-tenth:]), 1),
            "mean_tpot_ms": round(r["tpot_ms"]["mean"], 2), "output_throughput": round(r["output_throughput"]),
            # the process's peak so far: sizes run smallest first, so it is the largest run's own
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="10000,30000,100000", help="Comma-separated request counts, one run each.")
    p.add_argument("--deployment", default="collocated", help="collocated (with --nodes) or XpYd (default: "
                                                               "collocated).")
    p.add_argument("--nodes", type=int, default=32, help="Collocated: node count (default: 32).")
    p.add_argument("--rate-per-node", type=float, default=20.0,
                   help="Request rate per node in req/s (default: 20: on this profile nodes are busy most of the "
                        "time at a steady TTFT; the result has each run's busy share and rows per step).")
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--kv-cache-gb", type=float, default=40.0, help="KV cache per node in GiB (default: 40).")
    p.add_argument("--router-policy", default="least-loaded", choices=("round-robin", "least-loaded"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cprofile", action="store_true",
                   help="Run under cProfile and keep each run's 15 functions with the most own time (slower: "
                        "compare the shares, not the wall times).")
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/sim_scale.json"))
    args = p.parse_args()
    runs = []
    for num in sorted(int(x) for x in args.sizes.split(",")):
        if args.cprofile:  # where a simulated step's time goes: the engine's own code, or the simulator's
            import cProfile
            import pstats
            prof = cProfile.Profile()
            r = prof.runcall(run_one, num, args)
            st = pstats.Stats(prof)
            total = sum(v[2] for v in st.stats.values())
            top = sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:15]
            by = {}
            for (f, _, _), v in st.stats.items():  # own time by where the code lives
                key = str(Path(f).relative_to(ROOT).parent) if f.startswith(str(ROOT)) else \
                    "builtins" if f == "~" else "other (numpy, stdlib)"
                by[key] = by.get(key, 0.0) + v[2]
            r["cprofile_own_time_by_package"] = {k: round(v / total, 3) for k, v in
                                                 sorted(by.items(), key=lambda kv: -kv[1])}
            r["cprofile_own_time"] = [{"function": f"{Path(f).relative_to(ROOT) if f.startswith(str(ROOT)) else f}"
                                                   f":{line}({name})", "s": round(v[2], 3),
                                       "share": round(v[2] / total, 3)} for (f, line, name), v in top]
        else:
            r = run_one(num, args)
        runs.append(r)
        print(json.dumps(r), flush=True)
    base = runs[0]
    for r in runs:
        r["wall_vs_first"] = round(r["wall_s"] / base["wall_s"], 2)
        r["size_vs_first"] = round(r["requests"] / base["requests"], 2)
    out = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "host": platform.node(), "python": platform.python_version(),
           "profile": PROFILE, "args": vars(args), "runs": runs}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"{'requests':>9} {'wall s':>8} {'req/wall s':>10} {'sim s':>8} {'steps/wall s':>12} {'TTFT p50 ms':>18}")
    for r in runs:
        print(f"{r['requests']:>9} {r['wall_s']:>8.1f} {r['requests_per_wall_s']:>10.1f} {r['simulated_s']:>8.1f} "
              f"{r['node_steps_per_wall_s']:>12} {r['median_ttft_ms_first_tenth']:>8} -> "
              f"{r['median_ttft_ms_last_tenth']:<8}")
    print(f"[sim_scale] written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
