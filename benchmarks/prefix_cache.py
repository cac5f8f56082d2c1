"""What the prefix cache saves: TTFT of prompts sharing a long prefix, prefix caching on against off, on one server.

    .venv/bin/python benchmarks/prefix_cache.py          # small model, 2 x 2 runs of 16 requests, ~4 min

Each run starts its own collocated `pdserve serve` (prefix caching on, or `--no-enable-prefix-caching`), then
`pdserve bench serve` (in process) sends --num-prompts completions at --rate requests/s (constant gaps), each prompt
--prefix-len random tokens shared by all (`--random-prefix-len`) then --input-len of its own, greedy,
--output-len tokens. The arms alternate (on, off, on, off) so a drift of the machine hits both. The rate is low
enough that a prompt prefilled in full is done before the next arrives: the figure is the prefill the cache skips,
not a queue. From the server's /metrics, before and after the run: vLLM's prefix-cache queries and hits and
`vllm:prompt_tokens_by_source`, so the hit rate is the server's own count. The ratio is on / off of the mean TTFT
over the runs of each arm, in this one script. A run during which other processes used more than 0.3 cores is redone
(up to --retries). Writes benchmarks/results/prefix_cache.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from pdserve.bench.launcher import Deployment, launch
from pdserve.bench.serve import add_bench_serve_args, run_bench_serve

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kv_transfer import busy_jiffies, log, wait_quiet  # noqa: E402
from pd_ttft import ours  # noqa: E402

COMMON = ["--max-model-len", "2048", "--kv-cache-memory-gb", "0.5", "--log-level", "warning"]
SERIES = {"queries": ("vllm:prefix_cache_queries_total", {}), "hits": ("vllm:prefix_cache_hits_total", {}),
          **{src: ("vllm:prompt_tokens_by_source_total", {"source": src})
             for src in ("local_compute", "local_cache_hit", "external_kv_transfer")}}


def counts(url: str) -> dict:
    samples = [s for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text)
               for s in fam.samples]
    return {k: sum(s.value for s in samples if s.name == name and labels.items() <= s.labels.items())
            for k, (name, labels) in SERIES.items()}


def one_run(model: str, caching: bool, args, logs: Path) -> dict:
    dep = Deployment("collocated", logs)
    try:
        launch(dep, model, COMMON + ([] if caching else ["--no-enable-prefix-caching"]), "prefix-cache-bench")
        dep.wait_healthy(300.0)
        p = argparse.ArgumentParser()
        add_bench_serve_args(p)
        bench = p.parse_args(["--base-url", dep.url, "--model", model, "--random-prefix-len", str(args.prefix_len),
                              "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
                              "--num-prompts", str(args.num_prompts), "--request-rate", str(args.rate),
                              "--burstiness", "inf", "--warmup", "2", "--seed", str(args.seed),
                              "--disable-tqdm"])
        load = wait_quiet(args.wait_idle)
        before = counts(dep.url)
        (b0, t0), c0, w0 = busy_jiffies(), ours(dep), time.perf_counter()
        res = run_bench_serve(bench, quiet=True)
        (b1, t1), c1, wall = busy_jiffies(), ours(dep), time.perf_counter() - w0
        after = counts(dep.url)
    finally:
        dep.stop(60.0)
    delta = {k: after[k] - before[k] for k in after}
    busy = (b1 - b0) / max(t1 - t0, 1) * os.cpu_count()
    return {"caching": caching, "loadavg_1m_before": load, "other_cores_during": max(0.0, busy - (c1 - c0) / wall),
            "mean_ttft_ms": res["mean_ttft_ms"],
            "median_ttft_ms": res["median_ttft_ms"], "p99_ttft_ms": res["p99_ttft_ms"],
            "mean_tpot_ms": res["mean_tpot_ms"], "completed": res["completed"], "failed": res["failed"],
            "prefix_hit_rate": delta["hits"] / delta["queries"] if delta["queries"] else None,
            "prompt_tokens_by_source": {k: delta[k] for k in ("local_compute", "local_cache_hit",
                                                              "external_kv_transfer")},
            "generated_texts": res["generated_texts"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="Model directory (default: the small qwen3 model).")
    ap.add_argument("--prefix-len", type=int, default=896, help="Shared prefix tokens (default: 896).")
    ap.add_argument("--input-len", type=int, default=64, help="Tokens of each prompt's own part (default: 64).")
    ap.add_argument("--output-len", type=int, default=8, help="Output tokens (default: 8).")
    ap.add_argument("--num-prompts", type=int, default=16, help="Requests per run (default: 16).")
    ap.add_argument("--rate", type=float, default=0.5, help="Requests per second (default: 0.5).")
    ap.add_argument("--repeats", type=int, default=2, help="Runs per arm, alternating (default: 2).")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--retries", type=int, default=2, help="Redo a run disturbed by other processes this often.")
    ap.add_argument("--wait-idle", type=float, default=120.0, help="Most seconds to wait for a quiet CPU per run.")
    ap.add_argument("--out", default="benchmarks/results/prefix_cache.json")
    args = ap.parse_args()
    if args.model is None:
        from pdserve.model.make_model import ensure_model
        args.model = str(ensure_model("qwen3", "small", 0))
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    logs = Path(tempfile.mkdtemp(prefix="pdserve-prefix-"))
    runs = []
    for i in range(args.repeats):
        for caching in (True, False):
            for attempt in range(args.retries + 1):  # redone while other processes used > 0.3 cores during it
                r = one_run(args.model, caching, args, logs)
                log(f"run {i + 1} caching {'on ' if caching else 'off'}: TTFT mean {r['mean_ttft_ms']:.0f} ms, "
                    f"median {r['median_ttft_ms']:.0f} ms, p99 {r['p99_ttft_ms']:.0f} ms; hit rate "
                    f"{r['prefix_hit_rate']}; {r['completed']} ok, {r['failed']} failed; others used "
                    f"{r['other_cores_during']:.2f} cores")
                if r["other_cores_during"] < 0.3:
                    break
            runs.append({**r, "attempt": attempt})
    on = [r for r in runs if r["caching"]]
    off = [r for r in runs if not r["caching"]]
    mean = {name: statistics.mean(r["mean_ttft_ms"] for r in arm) for name, arm in (("on", on), ("off", off))}
    same = sum(a == b for r_on, r_off in zip(on, off) for a, b in zip(r_on["generated_texts"],
                                                                      r_off["generated_texts"]))
    result = {"model": args.model, "prefix_len": args.prefix_len, "input_len": args.input_len,
              "output_len": args.output_len, "num_prompts": args.num_prompts, "rate_per_s": args.rate,
              "repeats": args.repeats, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
              "mean_ttft_ms_on": mean["on"], "mean_ttft_ms_off": mean["off"],
              "ttft_ratio_on_over_off": mean["on"] / mean["off"],
              "same_texts": f"{same}/{sum(len(r['generated_texts']) for r in on)}",
              "runs": [{k: v for k, v in r.items() if k != "generated_texts"} for r in runs]}
    log(f"mean TTFT: caching on {mean['on']:.0f} ms, off {mean['off']:.0f} ms, on/off "
        f"{result['ttft_ratio_on_over_off']:.2f}; same texts {result['same_texts']}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
