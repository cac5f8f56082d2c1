"""`pdserve bench pd`: the seed's experiment end to end on loopback.

1. the model: `--model DIR`, or the tiny model, built once under $PDSERVE_HOME if missing;
2. for each arm (`collocated`; 1P1D whose D uses `--full-graph-rule strict`; 1P1D with the default rule, D replaying
   the last prompt token; 1P1D `first-token`, the first token from P (`--pd-first-token prefill`); more by
   `--arms`): launch its processes, wait for /health, run one warm-up, then `bench serve` at every rate of the
   sweep;
3. tear the arm down before the next one, so arms never share the CPU or GPU;
4. print the table (ISL/OSL, rate, arm, non-FULL share, mean/p99 TPOT, p99 ITL, median TTFT), write every run's JSON,
   a summary JSON and a PNG plot to `--result-dir`.
Children are killed on every exit path: normal end, an error, Ctrl-C, SIGTERM, and (Linux) the bench's own death.
"""
from __future__ import annotations

import argparse
import json
import math
import secrets
import shlex
import os
import signal
import sys
import time
from pathlib import Path

from pdserve.bench.arrivals import arrival_offsets
from pdserve.bench.launcher import FIRST_TOKEN_ARMS, Deployment, collocated_nodes, launch, vllm_router_program
from pdserve.bench.metrics import gap_medians, itl_tail
from pdserve.bench.report import format_table, plot
from pdserve.bench.serve import add_bench_serve_args, json_safe, run_bench_serve
from pdserve.worker.cudagraph_dispatch import RULES

ARMS = ("collocated", "default", *FIRST_TOKEN_ARMS, *RULES)


def add_bench_pd_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="Local model directory (default: the tiny model under "
                                                  "$PDSERVE_HOME, built if missing).")
    p.add_argument("--arms", default="collocated,strict,default,first-token",
                   help="Comma-separated arms: collocated, or a 1P1D deployment named by its decode node's "
                        f"--full-graph-rule ({', '.join(RULES)}), or 'default' for 1P1D without the flag (D replays "
                        "the last prompt token), or 'first-token' for 1P1D with the first token from P "
                        "(--pd-first-token prefill on P and the router; default rule on D; with pdserve's router "
                        "D gets the request as P does, its --pd-early-decode default), or 'first-token-early' (the "
                        "same, the flag given), or 'first-token-late' (--no-pd-early-decode: D asked after P "
                        "answered), or "
                        "'collocated-xN' for N "
                        "collocated servers behind pdserve's router (a pool without prefill nodes; each server gets "
                        "1/N of the cores, as P and D get half each) "
                        "(default: collocated,strict,default,first-token).")
    p.add_argument("--rates", default="1,2,4,8", help="Comma-separated request rates in req/s (default: 1,2,4,8).")
    p.add_argument("--num-prompts", type=int, default=64, help="Requests per rate and arm (default: 64).")
    p.add_argument("--random-input-len", type=int, default=256, help="Mean prompt tokens (default: 256).")
    p.add_argument("--random-output-len", type=int, default=64, help="Output tokens per request (default: 64).")
    p.add_argument("--random-range-ratio", type=float, default=0.0, help="Length spread, as bench serve.")
    p.add_argument("--burstiness", type=float, default=1.0, help="Arrival gamma shape, as bench serve (default: 1).")
    p.add_argument("--seed", type=int, default=0, help="Seed for prompts and arrivals (default: 0).")
    p.add_argument("--warmup", type=int, default=2, help="Unmeasured requests before each arm's sweep (default: 2).")
    p.add_argument("--router", choices=("pdserve", "vllm-router"), default="pdserve",
                   help="The router in front of each 1P1D arm: pdserve's, or vLLM's vllm-router in its P/D mode "
                        "(pip install vllm-router==0.1.17; default: pdserve).")
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help="Speculative decoding on the collocated server and on D (as `pdserve serve "
                        "--speculative-config`), so the table shows strict / prompt-tail / default at K > 0.")
    p.add_argument("--server-args", default="", metavar="ARGS",
                   help="Extra flags for every `pdserve serve` (one string, e.g. '--max-num-seqs 64').")
    p.add_argument("--kv-transfer-extra", default=None, metavar="JSON",
                   help="Fields merged into every P/D node's --kv-transfer-config (a JSON object), e.g. "
                        "'{\"kv_load_wait_ms\": 0}' to compare D without the early-load wait.")
    p.add_argument("--result-dir", default="bench-results/pd", help="Where runs, summary and plot go "
                                                                    "(default: bench-results/pd).")
    p.add_argument("--ready-timeout", type=float, default=180.0,
                   help="Seconds to wait for an arm's processes to be healthy (default: 180).")
    p.add_argument("--disable-tqdm", action="store_true", help="No progress bars.")


def _parse(args) -> tuple[list[str], list[float]]:
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    bad = [a for a in arms if a not in ARMS and not collocated_nodes(a)]
    if bad or not arms:
        raise ValueError(f"--arms: unknown arm {bad[0] if bad else '(none)'!r} (choose from {', '.join(ARMS)}, or "
                         "collocated-xN with N >= 2)")
    try:
        rates = [float(r) for r in args.rates.split(",") if r.strip()]
    except ValueError:
        raise ValueError(f"--rates: {args.rates!r} is not a comma-separated list of numbers") from None
    if not rates or any(not r > 0 for r in rates):
        raise ValueError("--rates: every rate must be > 0 (inf allowed)")
    for flag in ("num_prompts", "random_input_len", "random_output_len"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1")
    if args.warmup < 0 or not 0 <= args.random_range_ratio < 1:
        raise ValueError("--warmup must be >= 0" if args.warmup < 0 else "--random-range-ratio must be in [0, 1)")
    arrival_offsets(1, 1.0, args.burstiness)  # raises naming --burstiness
    if not 0 <= args.seed < 2 ** 32 - 1000 * len(rates):  # rate i runs with seed + 1000 i
        raise ValueError(f"--seed must be in [0, 2**32 - 1000 x {len(rates)} rates)")
    if not 0 < args.ready_timeout < math.inf:  # NaN fails both comparisons
        raise ValueError("--ready-timeout must be a number of seconds > 0")
    for arm in ("first-token-early", "first-token-late"):
        if args.router == "vllm-router" and arm in arms:  # vllm-router has no early decode
            raise ValueError(f"--arms {arm} needs --router pdserve (early decode is pdserve's router's)")
    if args.router == "vllm-router" and vllm_router_program() is None:
        raise ValueError("--router vllm-router: the vllm-router executable is not installed "
                         "(pip install vllm-router==0.1.17)")
    if args.speculative_config is not None:
        from pdserve.spec_decode.config import SpeculativeConfig
        SpeculativeConfig.from_flag(args.speculative_config)
    if args.kv_transfer_extra is not None:
        try:
            extra = json.loads(args.kv_transfer_extra)
        except ValueError as e:
            raise ValueError(f"--kv-transfer-extra: not valid JSON: {e}") from None
        if not isinstance(extra, dict):
            raise ValueError("--kv-transfer-extra must be a JSON object")
        from pdserve.kv_transfer_config import KVTransferConfig
        try:  # a wrong field fails here, not in every arm's start-up
            KVTransferConfig.from_dict({"kv_connector": "TcpConnector", "kv_role": "kv_consumer", **extra})
        except ValueError as e:
            raise ValueError(f"--kv-transfer-extra: {e}") from None
        args.kv_transfer_extra = extra
    try:
        args.server_args = shlex.split(args.server_args)
    except ValueError as e:
        raise ValueError(f"--server-args: {e}") from None
    return arms, rates


def _serve_args(args, dep, model: str, rate: float, seed: int, warmup: int, save: Path) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_bench_serve_args(p)
    ns = p.parse_args([])  # bench serve's defaults, then this sweep point's values
    ns.__dict__.update(base_url=dep.url, metrics_url=dep.decode_urls or None, tokenizer=model,
                       num_prompts=args.num_prompts, request_rate=rate, seed=seed,
                       random_input_len=args.random_input_len, random_output_len=args.random_output_len,
                       random_range_ratio=args.random_range_ratio, burstiness=args.burstiness, warmup=warmup,
                       ignore_eos=True, save_result=str(save), disable_tqdm=args.disable_tqdm)
    return ns


def _row(arm: str, rate: float, r: dict) -> dict:
    g = r["graph"] or {}
    return {"arm": arm, "rate": rate, "isl": r["random_input_len"], "osl": r["random_output_len"],
            "completed": r["completed"], "failed": r["failed"], "non_full_share": g.get("non_full_share", math.nan),
            "non_full_steps": g.get("non_full_steps"), "full_steps": g.get("full_steps"),
            "non_full_reasons": g.get("non_full_reasons", {}), "device": g.get("device", ""),
            "mean_tpot_ms": r["tpot_ms"]["mean"], "p99_tpot_ms": r["tpot_ms"]["p99"], "p99_itl_ms": r["itl_ms"]["p99"],
            "median_ttft_ms": r["ttft_ms"]["median"], "request_throughput": r["request_throughput"],
            "router_ttft_split_ms": r.get("router_ttft_split_ms"), "decode_phases_ms": r.get("decode_phases_ms"),
            "spec_decode": g.get("spec_decode"), **gap_medians(r.get("itls") or []),
            **itl_tail(r.get("start_times"), r.get("ttfts"), r.get("itls"))}


def run_bench_pd(args) -> int:
    arms, rates = _parse(args)
    if args.model:
        model = str(Path(args.model).absolute())
        if not (Path(model) / "config.json").is_file():
            raise ValueError(f"--model {args.model}: not a Hugging Face model directory (no config.json)")
    else:
        from pdserve.model.make_model import ensure_model
        model = str(ensure_model("qwen3", "tiny", 0))
    out = Path(args.result_dir)
    try:
        (out / "logs").mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a file in the way, no permission
        raise ValueError(f"--result-dir {out}: {e.strerror or e}") from None
    token = secrets.token_hex(16)
    rows, dep, interrupted = [], None, False

    def on_term(signum, frame):
        raise KeyboardInterrupt  # one exit path for Ctrl-C and SIGTERM: the finally below
    old = signal.signal(signal.SIGTERM, on_term)
    # Ours for SIGINT too: with Python's default handler in place, asyncio.run installs its own, which only
    # cancels the client's main task, and a bench whose client rides that out kept sending (or, when the task had
    # just ended, died by SIGINT later): 1 run in ~20 of tests/bench/test_bench_pd.py timed out or exited -2.
    signal.signal(signal.SIGINT, on_term)
    try:
        for arm in arms:
            t0 = time.monotonic()
            print(f"[bench pd] {arm}: starting", flush=True)
            dep = Deployment(arm, out / "logs")  # before any spawn: the finally sees every child started
            launch(dep, model, args.server_args, token, args.router, args.speculative_config, args.kv_transfer_extra)
            dep.wait_healthy(args.ready_timeout)
            print(f"[bench pd] {arm}: healthy in {time.monotonic() - t0:.1f} s ({dep.url})", flush=True)
            for i, rate in enumerate(rates):
                # Fresh prompts at every rate (and for the warm-up): a prompt seen before would be a prefix-cache
                # hit, and its TTFT, transfer and graph steps would not be comparable with the first rate's.
                save = out / f"{arm}_rate{rate:g}.json"
                result = run_bench_serve(_serve_args(args, dep, model, rate, args.seed + 1000 * i,
                                                     args.warmup if i == 0 else 0, save), quiet=True)
                rows.append(_row(arm, rate, result))
                split = result.get("router_ttft_split_ms") or {}
                parts = [f"{k} {split[k]:.1f}" for k in ("prefill", "kv_transfer", "decode_queue") if k in split]
                if "decode_queue" not in split and (phases := result.get("decode_phases_ms")):
                    # collocated, or P's token is the first: the serving nodes' own queue and first step (on a
                    # first-token arm's D, its half of the gap between the first two tokens)
                    labels = (("queue", "queue"), ("prefill", "first own step"))
                    parts += [f"{label} {phases[k]:.1f}" for k, label in labels if k in phases]
                where = f" (mean ms: {', '.join(parts)})" if parts else ""
                first = rows[-1]["first_gap_median_ms"]
                print(f"[bench pd] {arm} @ {rate:g} req/s: {result['completed']} ok, {result['failed']} failed, "
                      f"median TTFT {result['ttft_ms']['median']:.1f} ms{where}, "
                      f"p99 ITL {result['itl_ms']['p99']:.1f} ms"
                      + (f" (median first gap {first:.1f})" if first is not None else ""), flush=True)
            killed = dep.stop()
            dep = None
            if killed:
                print(f"[bench pd] {arm}: had to kill {', '.join(killed)}", flush=True)
    except KeyboardInterrupt:
        interrupted = True
        print("\n[bench pd] interrupted: stopping the deployment", flush=True)
        return 130
    finally:
        # a second Ctrl-C or SIGTERM must not cut the teardown short
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if dep is not None:
            dep.stop(timeout=10.0)
        if interrupted:
            # Exit here, the deployment torn down: a log-draining daemon thread caught by interpreter shutdown
            # ended the process as -6 instead of 130 now and then.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(130)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, old)
    table = format_table(rows)
    print(table)
    (out / "table.txt").write_text(table + "\n")
    (out / "summary.json").write_text(json.dumps(json_safe({"date": time.strftime("%Y-%m-%d %H:%M:%S"),
                                                            "model": model, "arms": arms, "rates": rates,
                                                            "rows": rows}), indent=1))
    png = plot(rows, out / "bench_pd.png")
    print(f"[bench pd] results in {out}/ (summary.json, table.txt{', ' + png.name if png else ''})")
    return 0 if all(r["failed"] == 0 for r in rows) else 1
