"""How `pdserve sim` scales: wall time of 10k, 30k and 100k requests over 32 nodes (issue 36: 100k requests over 32
nodes in under 10 minutes on this machine), event-leaping (the default) against --step-by-step on the same trace.

    .venv/bin/python benchmarks/sim_scale.py                      # writes benchmarks/results/sim_scale.json
    .venv/bin/python benchmarks/sim_scale.py --sizes 2000 --out /tmp/probe.json
    .venv/bin/python benchmarks/sim_scale.py --deployment 16p16d --sizes 10000
    .venv/bin/python benchmarks/sim_scale.py --modes leap --sizes 3000 --cprofile   # where the time goes

The workload: bench serve's random generator (prompts 1024 +- 50%, outputs 128 +- 50%, Poisson arrivals) at a rate
per node that keeps every node busy (the result has each run's busy share and rows per step) without queues that
grow without bound (the median TTFT of the last tenth of the requests is reported beside the first tenth's), on a
roofline profile of an 8B-class model (bf16, GQA 8 KV heads) on an H100's datasheet. The rate scales with the node count
and the trace with the size, so the simulated duration grows linearly with the request count and so should the wall
time; the table gives simulated requests per wall second at each size. Every run is one process of its own (a
clean peak RSS), timed whole (trace generation, node construction, the event loop, the metrics), the modes one after
the other on the same trace (`--repeats` pairs, alternating which goes first), and the two are checked to give the
same results. The machine should be quiet (two cores shared): each run records the load average around it and its
CPU seconds beside the wall seconds, and the ratio of the modes run back to back is the figure to read.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
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


def run_one(num: int, args, step_by_step: bool) -> dict:
    import hashlib

    from pdserve.config import EngineConfig
    from pdserve.core.scheduler import Scheduler
    from pdserve.sim.connector import TransferModel
    from pdserve.sim.profile import profile_from_dict
    from pdserve.sim.run import parse_deployment, simulate
    from pdserve.sim.trace import random_trace
    schedules = [0]
    schedule = Scheduler.schedule

    def counted(self):  # steps that went through the scheduler (all of them step by step)
        schedules[0] += 1
        return schedule(self)
    Scheduler.schedule = counted
    load = os.getloadavg()[0]
    t0, c0 = time.perf_counter(), time.process_time()
    dep = parse_deployment(args.deployment, args.nodes if args.deployment == "collocated" else 1)
    nodes = dep.num_prefill + dep.num_decode
    rate = args.rate_per_node * nodes
    trace = random_trace(num, args.input_len, args.output_len, rate, range_ratio=0.5, seed=args.seed)
    config = EngineConfig.from_kwargs("sim", max_num_seqs=args.max_num_seqs, kv_cache_memory_gb=args.kv_cache_gb,
                                      max_model_len=4096)
    r = simulate(trace, dep, config, profile_from_dict(PROFILE), transfer=TransferModel(50e9, 0.5e-3),
                 policy=args.router_policy, seed=args.seed, step_by_step=step_by_step)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    tenth = max(1, num // 10)
    ns = r["sim"]["nodes"]
    steps = sum(n["steps"] for n in ns)
    # what both modes must agree on (tests/sim/test_leap.py holds them to it on small traces)
    same = json.dumps([r["ttfts"], r["itls"], r["latencies"], r["graph"],
                       [{k: v for k, v in n.items() if k != "busy_s"} for n in ns]]).encode()
    return {"requests": num, "mode": "step-by-step" if step_by_step else "leap", "deployment": dep.name,
            "request_rate": rate, "wall_s": round(wall, 2), "cpu_s": round(cpu, 2),
            "loop_wall_s": round(r["sim"]["wall_s"], 2), "load_avg_1m_before": round(load, 2),
            "load_avg_1m_after": round(os.getloadavg()[0], 2), "requests_per_wall_s": round(num / wall, 1),
            "simulated_s": round(r["duration"], 2), "completed": r["completed"], "failed": r["failed"],
            "node_steps": steps, "scheduled_steps": schedules[0], "node_steps_per_wall_s": round(steps / wall),
            "mean_rows_per_step": round(sum(n["rows"] for n in ns) / max(steps, 1), 1),
            "node_busy_share": round(sum(n["busy_s"] for n in ns) / (nodes * r["duration"]), 3),
            "median_ttft_ms_first_tenth": round(1e3 * statistics.median(r["ttfts"][:tenth]), 1),
            "median_ttft_ms_last_tenth": round(1e3 * statistics.median(r["ttfts"][-tenth:]), 1),
            "mean_tpot_ms": round(r["tpot_ms"]["mean"], 2), "output_throughput": round(r["output_throughput"]),
            "results_sha1": hashlib.sha1(same).hexdigest(),
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)}


def cprofiled(num: int, args, step_by_step: bool) -> dict:
    """run_one under cProfile, with the 15 functions of most own time and the own time by package."""
    import cProfile
    import pstats
    prof = cProfile.Profile()
    r = prof.runcall(run_one, num, args, step_by_step)
    st = pstats.Stats(prof)
    total = sum(v[2] for v in st.stats.values())
    top = sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:15]
    by = {}
    for (f, _, _), v in st.stats.items():  # own time by where the code lives
        key = str(Path(f).relative_to(ROOT).parent) if f.startswith(str(ROOT)) else \
            "builtins" if f == "~" else "other (numpy, stdlib)"
        by[key] = by.get(key, 0.0) + v[2]
    r["cprofile_own_time_by_package"] = {k: round(v / total, 3) for k, v in sorted(by.items(), key=lambda kv: -kv[1])}
    r["cprofile_own_time"] = [{"function": f"{Path(f).relative_to(ROOT) if f.startswith(str(ROOT)) else f}"
                                           f":{line}({name})", "s": round(v[2], 3), "share": round(v[2] / total, 3)}
                              for (f, line, name), v in top]
    return r


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="10000,30000,100000", help="Comma-separated request counts, one run each.")
    p.add_argument("--modes", default="step-by-step,leap",
                   help="Comma-separated: leap (event-leaping, the default of pdserve sim) and/or step-by-step; "
                        "each size runs each mode on the same trace (default: both).")
    p.add_argument("--repeats", type=int, default=1,
                   help="Runs of each mode per size, alternating which mode goes first (default: 1).")
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
    p.add_argument("--child", nargs=2, metavar=("SIZE", "MODE"), help=argparse.SUPPRESS)  # one run, JSON out
    args = p.parse_args()
    if args.child:
        fn = cprofiled if args.cprofile else run_one
        print(json.dumps(fn(int(args.child[0]), args, args.child[1] == "step-by-step")), flush=True)
        return 0
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or set(modes) - {"leap", "step-by-step"}:
        p.error("--modes: leap and/or step-by-step")
    runs = []
    for num in sorted(int(x) for x in args.sizes.split(",")):
        for rep in range(args.repeats):
            for mode in modes if rep % 2 == 0 else modes[::-1]:
                out = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--child", str(num), mode],
                                     capture_output=True, text=True)
                if out.returncode:
                    sys.stderr.write(out.stderr)
                    return out.returncode
                r = json.loads(out.stdout.strip().splitlines()[-1])
                runs.append(r)
                print(json.dumps({k: v for k, v in r.items() if not k.startswith("cprofile")}), flush=True)
    summary = []
    for num in sorted({r["requests"] for r in runs}):
        by = {m: [r for r in runs if r["requests"] == num and r["mode"] == m] for m in modes}
        row = {"requests": num, **{f"{m}_wall_s": round(statistics.median(r["wall_s"] for r in rs), 2)
                                   for m, rs in by.items()}}
        if len(modes) == 2:
            rs = by["step-by-step"] + by["leap"]
            row["same_results"] = len({r["results_sha1"] for r in rs}) == 1
            row["speedup_wall"] = round(row["step-by-step_wall_s"] / row["leap_wall_s"], 2)
            row["speedup_cpu"] = round(statistics.median(r["cpu_s"] for r in by["step-by-step"]) /
                                       statistics.median(r["cpu_s"] for r in by["leap"]), 2)
            row["scheduled_share_leap"] = round(by["leap"][0]["scheduled_steps"] / by["leap"][0]["node_steps"], 3)
        summary.append(row)
    out = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "host": platform.node(), "python": platform.python_version(),
           "profile": PROFILE, "args": vars(args), "summary": summary, "runs": runs}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"{'requests':>9} {'mode':>12} {'wall s':>8} {'cpu s':>7} {'load':>5} {'req/wall s':>10} {'sim s':>7} "
          f"{'steps/wall s':>12} {'scheduled':>9} {'TTFT p50 ms':>18}")
    for r in runs:
        print(f"{r['requests']:>9} {r['mode']:>12} {r['wall_s']:>8.1f} {r['cpu_s']:>7.1f} "
              f"{r['load_avg_1m_before']:>5.1f} {r['requests_per_wall_s']:>10.1f} {r['simulated_s']:>7.1f} "
              f"{r['node_steps_per_wall_s']:>12} {r['scheduled_steps'] / r['node_steps']:>9.1%} "
              f"{r['median_ttft_ms_first_tenth']:>8} -> {r['median_ttft_ms_last_tenth']:<8}")
    for row in summary:
        print(json.dumps(row))
    print(f"[sim_scale] written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
