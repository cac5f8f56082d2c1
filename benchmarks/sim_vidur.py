"""vidur beside `pdserve sim` on the same trace (issue 36, "Peer"): a benchmark, not a test.

One seeded workload (bench serve's random lengths, 1024 +- 10% prompt and 256 +- 10% output tokens by default;
Poisson arrivals; the same lengths and gaps at every rate, the gaps scaled) is written twice: as a `pdserve sim
--trace` JSONL file and as vidur's trace-replay CSV (columns Date, Time, PromptTokenCount, CompletionTokenCount;
scale factors 1). Each rate then runs through vidur 0.0.26 (PyPI; its own venv, one process a run), once per vidur
replica scheduler in --vidur-schedulers, and through `pdserve sim --deployment collocated`; the table puts median
and p99 TTFT, median TPOT, mean E2E latency and output throughput side by side. Both sides are summarized by the
same code from per-request figures: vidur's request_metrics.csv columns prefill_e2e_time (TTFT), request_e2e_time
(E2E) and request_num_decode_tokens; TPOT is (E2E - TTFT) / (output tokens - 1), as bench serve's, for both
(vidur's own decode_time_execution_plus_preemption_normalized divides by the output tokens instead; its median is
in the JSON). A second table gives each model's time for single steps (decodes of 1 to 128 rows, one 1024-token
prompt): vidur's trained predictor asked directly, our profile's step time for the same shapes.

    .venv/bin/python benchmarks/sim_vidur.py                        # ~2 min on 2 cores when the machine is quiet
    .venv/bin/python benchmarks/sim_vidur.py --rates 2,4 --num-prompts 100 --out /tmp/probe.json

Writes benchmarks/results/sim_vidur.json (each run's files under --work-dir: traces, vidur's CSVs and logs,
pdserve's result JSON).

The two are different models, so the comparison validates neither:
- vidur: one replica, TP 1, device a100, batch cap 128 and --max-num-batched-tokens per batch, block size 16, KV
  blocks from its memory planner (80 GB less weights and a 10% margin); its vllm scheduler is vLLM v0's batching
  (whole prompts, a batch of prefills whenever one can be admitted, else a batch of decodes), its sarathi scheduler
  chunked prefill mixed with decodes (the nearer to pdserve's). Batch times come from operator times profiled on
  an A100 (its data/profiling CSVs) through its default predictor, random forests. No P/D: collocated only.
- ours: pdserve's own scheduler (chunked prefill, prefill and decode rows mixed in a step, max_num_seqs 128, the
  same block size and block count as vidur's), step times from a roofline: the shipped llama-3-8b-b200 profile with
  the GPU swapped for an A100-80GB SXM's datasheet (2039 GB/s, 312 dense bf16 TFLOPs), keeping the memory
  efficiency (0.6575) and per-step overheads fitted to the seed's B200 TPOT figures. That is an assumption: nothing
  here was fitted on an A100, and the roofline's compute side runs at the datasheet's peak.

vidur's profiling data is not in its wheel and its defaults fetch datasets from a hub this machine cannot reach, so
the script exports the CSVs from a git snapshot of github.com/microsoft/vidur (--vidur-repo, a bare repository read
with git) into --work-dir/data, or takes them from --vidur-data DIR (a vidur checkout's root, with data/ inside), and
points vidur's predictor at those files (its file lookup and its hub download of ready predictions are replaced in
the vidur process; nothing of vidur is changed on disk). Where the Llama-3-8B A100 attention table is missing (the
snapshot here lacks files of 4 MiB and more, every attention table among them), vidur's own older A100 attention
table stands in (data/profiling/a100/attention.csv at its commit e2d00e9: Llama-2-70B at TP 2, so 32 query heads
and 4 KV heads of 128 per GPU against Llama-3-8B's 32 and 8 at TP 1), relabelled for Llama-3-8B, with its decode
attention times doubled (decode attention reads the KV cache, twice the bytes with twice the KV heads; prefill
attention's work is per query head and kept). The result says which table was used. vidur's own random-forest grid
(27 settings x 10-fold cross-validation, 250 to 750 trees, per operator) is about 70x the fits of the default cap
here (one setting, 3 folds: ~20 s of training on 2 cores), so of the order of half an hour (an estimate, not run);
--rf-full-grid runs it. The trained forests are cached in --work-dir.

The machine may be shared with timed runs: before each vidur or pdserve run the script waits (polling every 20 s)
while a process matching --busy-pattern runs.
"""
from __future__ import annotations

import argparse
import csv
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_file import write_result  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
B200_PROFILE = REPO / "pdserve" / "sim" / "profiles" / "llama-3-8b-b200.json"
A100 = {"name": "A100-80GB-SXM", "memory_bandwidth_gb_s": 2039, "peak_tflops": 312}  # datasheet, dense bf16
MLP = "data/profiling/compute/a100/meta-llama/Meta-Llama-3-8B/mlp.csv"
ATTENTION = "data/profiling/compute/a100/meta-llama/Meta-Llama-3-8B/attention.csv"
ALL_REDUCE = "data/profiling/network/a100_dgx/all_reduce.csv"  # read only at TP > 1
SEND_RECV = "data/profiling/network/a100_dgx/send_recv.csv"  # read only with pipeline stages
STAND_IN = ("e2d00e9afba96cec9f0e7ea560bbfc4a539fae6a", "data/profiling/a100/attention.csv")  # Llama-2-70B, TP 2
STAND_IN_FROM = {"n_embd": "8192", "n_q_head": "64", "n_kv_head": "8", "num_tensor_parallel_workers": "2"}
STAND_IN_TO = {"n_embd": "4096", "n_q_head": "32", "n_kv_head": "8", "num_tensor_parallel_workers": "1"}
KV_HEADS_RATIO = 8 / 4  # Llama-3-8B's KV heads per GPU at TP 1 over the stand-in's (8 heads over TP 2)
RESULT_MARK = "SIM_VIDUR_CHILD "
PROBE_CONTEXT = 1152  # a decode row's context in the probes: the mean prompt and half the mean output
PROBE_DECODE_ROWS = (1, 8, 32, 64, 128)
PROBE_PREFILL = 1024  # one fresh prompt of this many tokens, alone in its step


def wait_quiet(pattern: str) -> None:
    """Block while another engineer's timed run (a process matching `pattern`) is on this machine."""
    said = False
    while subprocess.run(["pgrep", "-f", pattern], capture_output=True).returncode == 0:
        if not said:
            print(f"waiting: a process matching {pattern!r} runs (polling every 20 s)", flush=True)
            said = True
        time.sleep(20)


def git(repo: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True)


def export_vidur_data(args, data: Path) -> dict:
    """The CSVs vidur's predictor reads, under `data` (a vidur-style data/ tree); returns where each came from."""
    src = {}
    for rel in (MLP, ATTENTION, ALL_REDUCE, SEND_RECV):
        out = data.parent / rel
        out.parent.mkdir(parents=True, exist_ok=True)
        if args.vidur_data and (Path(args.vidur_data) / rel).is_file():
            out.write_bytes((Path(args.vidur_data) / rel).read_bytes())
            src[rel] = f"{args.vidur_data}/{rel}"
            continue
        repo = Path(args.vidur_repo)
        blob = git(repo, "rev-parse", f"HEAD:{rel}").stdout.decode().strip()
        if blob and git(repo, "cat-file", "-e", blob).returncode == 0:
            out.write_bytes(git(repo, "cat-file", "blob", blob).stdout)
            src[rel] = f"{repo} HEAD ({git(repo, 'rev-parse', '--short', 'HEAD').stdout.decode().strip()}):{rel}"
        elif rel == ATTENTION:
            src[rel] = stand_in_attention(repo, out)
        else:
            sys.exit(f"{rel}: not in {args.vidur_data or 'no --vidur-data'} nor readable in {repo}")
    return src


def stand_in_attention(repo: Path, out: Path) -> str:
    """vidur's older A100 attention table (Llama-2-70B at TP 2) relabelled for Llama-3-8B at TP 1, decode times
    scaled by the KV-head ratio (see the module docstring)."""
    commit, path = STAND_IN
    r = git(repo, "show", f"{commit}:{path}")
    if r.returncode:
        sys.exit(f"no Llama-3-8B A100 attention table, and the stand-in {commit[:7]}:{path} is not in {repo} either")
    rows = list(csv.DictReader(r.stdout.decode().splitlines()))
    decode_cols = [c for c in rows[0] if c.startswith("time_stats.attn_decode.")]
    kept = 0
    with out.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        for row in rows:
            if any(row[k] != v for k, v in STAND_IN_FROM.items()):
                continue
            row.update(STAND_IN_TO)
            if row["is_prefill"] == "False":
                for c in decode_cols:
                    row[c] = repr(float(row[c]) * KV_HEADS_RATIO)
            w.writerow(row)
            kept += 1
    return (f"STAND-IN: {repo} {commit[:7]}:{path} ({kept} rows; Llama-2-70B TP 2 relabelled as Llama-3-8B TP 1, "
            f"attn_decode x{KV_HEADS_RATIO:g}); the Llama-3-8B A100 attention table was not readable")


def a100_profile() -> dict:
    """The shipped B200 Llama-3-8B roofline with an A100's datasheet in place of the B200's (module docstring)."""
    b200 = json.loads(B200_PROFILE.read_text())
    return {**b200, "name": "llama-3-8b-a100-from-b200-fit",
            "gpu": {**A100, "memory_efficiency": b200["gpu"]["memory_efficiency"]},
            "fit": {"assumption": "A100-80GB SXM datasheet bandwidth and dense bf16 peak; memory_efficiency and "
                                  "step_overhead_s as fitted on the seed's B200 figures (llama-3-8b-b200), not on "
                                  "an A100", "b200_fit": b200["fit"]["method"]}}


def summarize(arrivals, ttfts, latencies, outs) -> dict:
    """bench serve's figures from per-request seconds (numpy's linear percentiles, as bench serve)."""
    import numpy as np
    tpots = [(lat - t) / (n - 1) for t, lat, n in zip(ttfts, latencies, outs) if n > 1]
    duration = max(a + lat for a, lat in zip(arrivals, latencies))  # from 0 to the last request's end
    return {"completed": len(latencies), "median_ttft_ms": 1e3 * float(np.median(ttfts)),
            "p99_ttft_ms": 1e3 * float(np.percentile(ttfts, 99)), "median_tpot_ms": 1e3 * float(np.median(tpots)),
            "mean_e2el_ms": 1e3 * float(np.mean(latencies)), "duration_s": duration,
            "output_throughput": sum(outs) / duration, "request_throughput": len(latencies) / duration}


def run_vidur(args, trace, rate: float, scheduler: str, work: Path, digest: str) -> dict:
    tag = f"{scheduler}_rate{rate:g}"
    csv_path = work / f"vidur_trace_rate{rate:g}.csv"
    with csv_path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["Date", "Time", "PromptTokenCount", "CompletionTokenCount"])
        for r in trace:
            w.writerow(["2024-01-01", repr(r.arrival_time), r.prompt_len, r.output_len])
    max_tokens = max(2048, -(-max(r.prompt_len + r.output_len for r in trace) // 1024) * 1024)
    rf = "--random_forrest_execution_time_predictor_config_"
    argv = ["--seed", str(args.seed), "--cluster_config_num_replicas", "1",
            "--replica_config_model_name", "meta-llama/Llama-3-8B", "--replica_config_device", "a100",
            "--replica_config_network_device", "a100_dgx", "--replica_config_tensor_parallel_size", "1",
            "--replica_config_num_pipeline_stages", "1", "--cache_config_block_size", "16",
            "--replica_scheduler_config_type", scheduler, f"--{scheduler}_scheduler_config_batch_size_cap",
            str(args.max_num_seqs),
            # the token budget of a batch: vllm's max_tokens_in_batch, sarathi's chunk_size
            f"--{scheduler}_scheduler_config_" + ("chunk_size" if scheduler == "sarathi" else "max_tokens_in_batch"),
            str(args.max_num_batched_tokens),
            "--request_generator_config_type", "trace_replay", "--trace_request_generator_config_trace_file",
            str(csv_path), "--trace_request_generator_config_date", "2024-01-01",
            "--trace_request_generator_config_prefill_scale_factor", "1",
            "--trace_request_generator_config_decode_scale_factor", "1",
            "--trace_request_generator_config_time_scale_factor", "1",
            "--trace_request_generator_config_max_tokens", str(max_tokens),
            "--execution_time_predictor_config_type", "random_forrest",
            rf + "cache_dir", str(work / "vidur_cache"),
            rf + "model_profiling_dataset", f"local-{digest}", rf + "network_profiling_dataset", "local-a100_dgx",
            rf + "prediction_max_tokens_per_request", str(max(4096, max_tokens)),
            rf + "num_training_job_threads", str(args.rf_threads)]
    if not args.rf_full_grid:  # vidur's defaults: 250,500,750 trees, depth 8,16,32, split 2,5,10, 10 folds
        argv += [rf + "num_estimators", *args.rf_estimators.split(","), rf + "max_depth", *args.rf_max_depth.split(","),
                 rf + "min_samples_split", *args.rf_min_samples_split.split(","),
                 rf + "k_fold_cv_splits", str(args.rf_cv_splits)]
    argv += ["--no-metrics_config_enable_chrome_trace", "--no-metrics_config_store_plots",
             "--metrics_config_output_dir", str(work / f"vidur_{tag}")]
    spec = work / f"vidur_spec_{tag}.json"
    spec.write_text(json.dumps({"argv": argv, "files": [str(work / rel) for rel in (MLP, ATTENTION, ALL_REDUCE,
                                                                                       SEND_RECV)]}))
    wait_quiet(args.busy_pattern)
    log = work / f"vidur_{tag}.log"
    t0 = time.monotonic()
    with log.open("w") as f:
        env = {**os.environ, "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1"}  # no hub, no wandb
        p = subprocess.run([args.vidur_python, __file__, "--vidur-child", str(spec)], cwd=work, stdout=f,
                           stderr=subprocess.STDOUT, env=env)
    if p.returncode:
        sys.exit(f"vidur ({scheduler}) failed at {rate:g} req/s (exit {p.returncode}); its log: {log}")
    child = json.loads([ln for ln in log.read_text().splitlines() if ln.startswith(RESULT_MARK)][-1][len(RESULT_MARK):])
    with (Path(child["output_dir"]) / "request_metrics.csv").open() as f:
        rows = sorted(csv.DictReader(f), key=lambda r: int(float(r["Request Id"])))
    if len(rows) != len(trace):
        sys.exit(f"vidur ({scheduler}) finished {len(rows)} of {len(trace)} requests at {rate:g} req/s")
    for r, t in zip(rows, trace):  # vidur numbers requests in trace order: the lengths must match
        assert int(float(r["request_num_prefill_tokens"])) == t.prompt_len, (r, t)
        assert int(float(r["request_num_decode_tokens"])) == t.output_len, (r, t)
    import numpy as np
    out = summarize([t.arrival_time for t in trace], [float(r["prefill_e2e_time"]) for r in rows],
                    [float(r["request_e2e_time"]) for r in rows], [t.output_len for t in trace])
    return {**out, "vidur_decode_time_normalized_median_ms": 1e3 * float(np.median(
                [float(r["decode_time_execution_plus_preemption_normalized"]) for r in rows])),
            "restarts": sum(int(float(r["request_num_restarts"])) for r in rows),
            "num_blocks": int(child["num_blocks"]), "predictor_s": round(child["predictor_s"], 1),
            "step_ms": child["step_ms"],
            "wall_s": round(time.monotonic() - t0, 1), "output_dir": child["output_dir"], "log": str(log),
            "training": re.findall(r"Trained model (\S+) and found best parameters: (\{.*?\}) with mean absolute "
                                   r"percentage error \(MEAP\) ([-\d.e]+)%", log.read_text())}


def run_pdserve(args, trace, rate: float, work: Path, profile: Path, num_blocks: int) -> dict:
    jsonl = work / f"trace_rate{rate:g}.jsonl"
    jsonl.write_text("".join(json.dumps({"arrival_time": r.arrival_time, "prompt_len": r.prompt_len,
                                         "output_len": r.output_len, "request_id": r.request_id}) + "\n"
                             for r in trace))
    out = work / f"pdserve_rate{rate:g}"
    wait_quiet(args.busy_pattern)
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-m", "pdserve.cli", "sim", "--profile", str(profile), "--trace", str(jsonl),
                    "--deployment", "collocated", "--max-num-seqs", str(args.max_num_seqs),
                    "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--block-size", "16",
                    "--num-gpu-blocks-override", str(num_blocks), "--no-enable-prefix-caching",
                    "--seed", str(args.seed), "--quiet", "--result-dir", str(out)],
                   cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    wall = time.monotonic() - t0
    (res,) = out.glob("collocated_rate*.json")
    d = json.loads(res.read_text())
    by_id = {t.request_id: t for t in trace}
    arrivals = [by_id[i].arrival_time for i in d["request_ids"]]
    s = summarize(arrivals, d["ttfts"], d["latencies"], d["output_lens"])
    s["own_figures"] = {k: d[k] for k in ("median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "mean_e2el_ms",
                                          "output_throughput")}  # pdserve's own summary, for a cross-check
    off = [k for k, v in s["own_figures"].items() if abs(s[k] - v) > 1e-6 * max(1.0, abs(v))]
    if off:
        print(f"note: at {rate:g} req/s this script's {off} differ from pdserve's own summary", flush=True)
    nodes = d["sim"]["nodes"]
    return {**s, "failed": d["failed"], "preemptions": sum(n["preemptions"] for n in nodes),
            "mean_rows_per_step": round(sum(n["rows"] for n in nodes) / max(1, sum(n["steps"] for n in nodes)), 1),
            "wall_s": round(wall, 1), "result": str(res)}


def roofline_steps(profile: dict) -> dict:
    """Our profile's time for the probe steps, ms (the shapes as the simulator builds them for such rows)."""
    from pdserve.sim.profile import StepShape, profile_from_dict
    p, out = profile_from_dict(profile), {}
    for b in PROBE_DECODE_ROWS:  # every size here is a capture size: no padding
        ctx = b * (PROBE_CONTEXT + 1)
        out[f"decode x{b}"] = 1e3 * p.step_time(StepShape("FULL", b, b, b, ctx, ctx))
    n = PROBE_PREFILL
    out[f"prefill {n}"] = 1e3 * p.step_time(StepShape("PIECEWISE", n, n, 1, n, n * (n + 1) // 2))
    return out


def vidur_child(spec_path: str) -> int:
    """Runs inside vidur's venv: one vidur simulation with the predictor pointed at local CSVs."""
    spec = json.loads(Path(spec_path).read_text())
    from vidur.config import SimulationConfig
    from vidur.execution_time_predictor import sklearn_execution_time_predictor as sk
    from vidur.simulator import Simulator
    from vidur.utils.random import set_seeds
    cls = sk.SklearnExecutionTimePredictor
    cls._get_input_files = lambda self: tuple(spec["files"])

    def no_hub(self):
        raise RuntimeError("not fetched: the forests are trained from local CSVs (benchmarks/sim_vidur.py)")
    cls._load_predictions_from_hf = no_hub
    timing, init = {}, cls.__init__

    def timed_init(self, *a, **k):
        t0 = time.perf_counter()
        init(self, *a, **k)
        timing["predictor_s"] = time.perf_counter() - t0
        predictors.append(self)
    predictors = []
    cls.__init__ = timed_init
    sys.argv = ["vidur", *spec["argv"]]
    config = SimulationConfig.create_from_cli_args()
    set_seeds(config.seed)
    sim = Simulator(config)
    sim.run()
    from vidur.entities import Batch  # vidur's own batch time for the probe shapes (no requests needed)
    shapes = {f"decode x{b}": ([1] * b, [PROBE_CONTEXT + 1] * b) for b in PROBE_DECODE_ROWS}
    # a fresh prompt: its KV tokens as vidur's schedulers pass them (processed + new)
    shapes[f"prefill {PROBE_PREFILL}"] = ([PROBE_PREFILL], [PROBE_PREFILL])
    steps = {name: 1e3 * predictors[0].get_execution_time(Batch(0, [None] * len(q), q, kv), 0).total_time
             for name, (q, kv) in shapes.items()}
    print(RESULT_MARK + json.dumps({"output_dir": config.metrics_config.output_dir, **timing, "step_ms": steps,
                                    "num_blocks": config.cluster_config.cache_config.num_blocks}), flush=True)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rates", default="2,4,6,16",
                    help="Request rates in req/s, one run of each simulator per rate (default: 2,4,6,16: the "
                         "first three a single A100 keeps up with in both models, 16 it does not).")
    ap.add_argument("--num-prompts", type=int, default=300, help="Requests per rate (default: 300).")
    ap.add_argument("--input-len", type=int, default=1024, help="Mean prompt tokens (default: 1024).")
    ap.add_argument("--output-len", type=int, default=256, help="Mean output tokens (default: 256).")
    ap.add_argument("--range-ratio", type=float, default=0.1,
                    help="Lengths drawn uniformly in mean x [1 - r, 1 + r], as bench serve (default: 0.1).")
    ap.add_argument("--seed", type=int, default=0, help="Seed of the lengths and arrivals, and of both simulators.")
    ap.add_argument("--max-num-seqs", type=int, default=128,
                    help="Batch cap on both sides: pdserve's max_num_seqs, vidur's batch_size_cap (default: 128).")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048,
                    help="Token budget of a step on both sides: pdserve's max_num_batched_tokens, vidur's vllm "
                         "max_tokens_in_batch and sarathi chunk_size (default: 2048, pdserve's default).")
    ap.add_argument("--vidur-schedulers", default="vllm,sarathi",
                    help="vidur replica schedulers to run, comma-separated (default: vllm,sarathi): vllm is vLLM v0's "
                         "batching, sarathi chunked prefill mixed with decodes (chunk = --max-num-batched-tokens), "
                         "the nearer to pdserve's own.")
    ap.add_argument("--vidur-python", default="/work/vidur-venv/bin/python",
                    help="The Python of the venv vidur is installed in (never pdserve's).")
    ap.add_argument("--vidur-repo", default="/work/.mirror/microsoft+vidur/repo",
                    help="A git snapshot of github.com/microsoft/vidur (bare is fine) to export profiling CSVs from.")
    ap.add_argument("--vidur-data", default=None,
                    help="A directory holding vidur's data/ tree (a vidur checkout's root); files found there win "
                         "over --vidur-repo's.")
    ap.add_argument("--rf-estimators", default="250", help="Random-forest trees, comma-separated grid (default: "
                                                           "250; vidur's: 250,500,750).")
    ap.add_argument("--rf-max-depth", default="32", help="Random-forest depths, comma-separated grid (default: 32; "
                                                         "vidur's: 8,16,32).")
    ap.add_argument("--rf-min-samples-split", default="2",
                    help="Random-forest min_samples_split, comma-separated grid (default: 2; vidur's: 2,5,10).")
    ap.add_argument("--rf-cv-splits", type=int, default=3,
                    help="Cross-validation folds of the grid search (default: 3; vidur's: 10).")
    ap.add_argument("--rf-full-grid", action="store_true",
                    help="vidur's own grid and folds, ignoring the --rf-* caps (hours on 2 cores).")
    ap.add_argument("--rf-threads", type=int, default=2, help="Training jobs at once (default: 2, this machine's "
                                                              "cores).")
    ap.add_argument("--busy-pattern", default="bench pd|plan_validate|sim_validate|make test|pytest",
                    help="pgrep -f pattern of timed runs to wait for before each simulation.")
    ap.add_argument("--work-dir", default=None, help="Where traces, vidur's data, caches and outputs go "
                                                     "(default: a temp dir).")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "sim_vidur.json"),
                    help="The result JSON (default: benchmarks/results/sim_vidur.json).")
    ap.add_argument("--vidur-child", default=None, help=argparse.SUPPRESS)  # one vidur run, inside vidur's venv
    args = ap.parse_args()
    if args.vidur_child:
        return vidur_child(args.vidur_child)
    sys.path.insert(0, str(REPO))  # this tree's pdserve, as the `-m pdserve.cli` runs (cwd REPO) get
    from pdserve.sim.trace import random_trace
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="sim-vidur-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    version = subprocess.run([args.vidur_python, "-c", "import importlib.metadata as m; print(m.version('vidur'))"],
                             capture_output=True, text=True)
    sources = export_vidur_data(args, work / "data")
    digest = hashlib.sha1(b"".join((work / rel).read_bytes() for rel in (MLP, ATTENTION))).hexdigest()[:10]
    profile = work / "llama-3-8b-a100-from-b200-fit.json"
    profile.write_text(json.dumps(a100_profile(), indent=1))
    rates = [float(r) for r in args.rates.split(",")]
    schedulers = [x for x in args.vidur_schedulers.split(",") if x]
    if not schedulers or set(schedulers) - {"vllm", "sarathi"}:
        ap.error("--vidur-schedulers: vllm and/or sarathi")
    rows, vidur_steps = [], None
    for rate in rates:
        trace = random_trace(args.num_prompts, args.input_len, args.output_len, rate, range_ratio=args.range_ratio,
                             seed=args.seed)
        row = {"rate": rate}
        for sched in schedulers:
            v = run_vidur(args, trace, rate, sched, work, digest)
            vidur_steps = vidur_steps or v["step_ms"]
            row[f"vidur-{sched}"] = v
            print(f"{rate:g} req/s: vidur ({sched}) {v['wall_s']} s (its predictor {v['predictor_s']} s)", flush=True)
        o = run_pdserve(args, trace, rate, work, profile, row[f"vidur-{schedulers[0]}"]["num_blocks"])
        print(f"{rate:g} req/s: pdserve sim {o['wall_s']} s", flush=True)
        row["pdserve"] = o
        rows.append(row)
    ours_steps = roofline_steps(a100_profile())
    print(f"\nOne step alone, ms (decode rows at {PROBE_CONTEXT} context tokens each; vidur's predictor as trained "
          f"here, ours the A100 roofline: FULL graph for decodes, PIECEWISE for the prompt):")
    print(f"{'step':>16} {'vidur':>7} {'ours':>7} {'ours/vidur':>10}")
    for k, v in vidur_steps.items():
        print(f"{k:>16} {v:>7.2f} {ours_steps[k]:>7.2f} {ours_steps[k] / v:>9.2f}x")
    keys = ("median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "mean_e2el_ms", "output_throughput")
    arms = [f"vidur-{x}" for x in schedulers] + ["pdserve"]
    print(f"\n{'rate':>5} {'simulator':>13} | {'TTFT p50 ms':>11} {'TTFT p99 ms':>11} {'TPOT p50 ms':>11} "
          f"{'E2E mean s':>10} {'out tok/s':>9} {'done':>5}")
    for row in rows:
        for name in arms:
            s = row[name]
            print(f"{row['rate']:>5g} {name:>13} | {s['median_ttft_ms']:>11.1f} {s['p99_ttft_ms']:>11.1f} "
                  f"{s['median_tpot_ms']:>11.2f} {s['mean_e2el_ms'] / 1e3:>10.2f} {s['output_throughput']:>9.0f} "
                  f"{s['completed']:>5}")
        for name in arms[:-1]:
            row[f"ours_over_{name}"] = r = {k: row["pdserve"][k] / row[name][k] for k in keys}
            print(f"{'':>5} {'ours/' + name[6:]:>13} | " + " ".join(f"{r[k]:>{w}.2f}x" for k, w in
                                                                   zip(keys, (10, 10, 10, 9, 8))))
    stand_in = sources[ATTENTION].startswith("STAND-IN")
    print("\nTwo models, neither validated here. vidur: operator times profiled on an A100 through random forests"
          + (" (attention: a STAND-IN table, see the docstring)" if stand_in else "")
          + "; vllm = vLLM v0 batching (prefills first, whole prompts), sarathi = chunked prefill mixed with decodes. "
            "Ours: pdserve's own scheduler over a roofline whose memory efficiency and step overheads were fitted on "
            "the seed's B200 figures, given an A100's datasheet (2039 GB/s, 312 TFLOPs): an assumption.")
    write_result(args.out, args, vidur_version=version.stdout.strip() or version.stderr.strip()[-200:],
                 vidur_data=sources, attention_stand_in=stand_in, work_dir=str(work),
                 pdserve_profile=a100_profile(), step_ms={"vidur": vidur_steps, "ours": ours_steps,
                                                          "probe_context_tokens": PROBE_CONTEXT},
                 workload={"num_prompts": args.num_prompts, "input_len": args.input_len,
                           "output_len": args.output_len, "range_ratio": args.range_ratio, "arrivals": "Poisson",
                           "seed": args.seed},
                 metric_sources={"vidur": "request_metrics.csv: prefill_e2e_time (TTFT), request_e2e_time (E2E), "
                                          "request_num_decode_tokens (outputs); TPOT = (E2E - TTFT) / (outputs - 1)",
                                 "pdserve": "collocated_rate*.json: ttfts, latencies, output_lens, same formulas"},
                 rows=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
