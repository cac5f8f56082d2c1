"""`pdserve bench serve`: load an OpenAI-compatible endpoint (pdserve, its router, or vLLM) and report vLLM's serving
metrics, plus the share of non-FULL decode-graph steps when the target exposes pdserve's graph counters.

Requests are sent at absolute offsets from the start (gamma arrivals), so a slow response never delays the next
send; `--max-concurrency` caps the requests in flight on top of that.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import math
import os
import signal
import threading
import time
from pathlib import Path

import aiohttp
from tqdm import tqdm

from pdserve.bench.arrivals import arrival_offsets
from pdserve.bench.client import RequestSpec, send_request
from pdserve.bench.http_get import get_json
from pdserve.bench.datasets import jsonl_dataset, random_dataset, random_prefix
from pdserve.bench.server_metrics import (format_phases, format_share, format_ttft_split, means_ms, metric_targets,
                                          scrape, scrape_phases, scrape_ttft_stages)
from pdserve.bench.metrics import compute_metrics, format_metrics, parse_goodput, parse_percentiles, summarize


def add_bench_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000",
                   help="Server or router base URL, without the route (default: http://127.0.0.1:8000).")
    p.add_argument("--endpoint", choices=("/v1/completions", "/v1/chat/completions"), default="/v1/completions",
                   help="OpenAI route to load (default: /v1/completions).")
    p.add_argument("--model", default=None,
                   help="Model name sent in requests; a local directory sends its name, which `pdserve serve` "
                        "answers to by default, and is the default --tokenizer (default: the first id of the "
                        "target's /v1/models).")
    p.add_argument("--tokenizer", default=None, help="Local tokenizer directory, for the random dataset and for "
                                                      "prompt lengths (default: --model when it is a directory).")
    p.add_argument("--dataset", choices=("random", "jsonl"), default="random",
                   help="random: token-id prompts decoded with the tokenizer, each re-encoding to exactly its drawn "
                        "length; jsonl: prompts from --dataset-path.")
    p.add_argument("--dataset-path", default=None, help="The jsonl file: one {\"prompt\": ..., \"output_len\": ...} "
                                                         "object per line (output_len optional).")
    p.add_argument("--random-input-len", type=int, default=1024,
                   help="Mean prompt tokens as the server counts them (a BOS it adds included, as vLLM), besides "
                        "the --random-prefix-len ones (default: 1024).")
    p.add_argument("--random-output-len", type=int, default=128,
                   help="Mean output tokens; max_tokens of each request; also the jsonl default (default: 128).")
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="Lengths drawn uniformly from [len*(1-r), len*(1+r)] (default: 0, fixed lengths).")
    p.add_argument("--random-prefix-len", type=int, default=0, metavar="N",
                   help="Random tokens every prompt starts with, the same in each (measured and warm-up), for "
                        "prefix caching; they add to --random-input-len, as vLLM's: a prompt is N + its drawn "
                        "length (default: 0).")
    p.add_argument("--num-prompts", type=int, default=100, help="Requests in the measured run (default: 100).")
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="Requests per second, or inf to send all at once (default: inf).")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="Gamma shape of the arrival gaps: 1 is Poisson, lower is burstier (default: 1).")
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="Most requests in flight at once (default: no limit).")
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=None,
                   help="Ask the server to generate max_tokens every time (default: on for --dataset random, as "
                        "vLLM's client, so every request has its drawn output length; off for jsonl).")
    p.add_argument("--temperature", type=float, default=0.0, help="Sampling temperature (default: 0, greedy).")
    p.add_argument("--seed", type=int, default=0, help="Seed for prompts and arrivals (default: 0).")
    p.add_argument("--warmup", type=int, default=0, help="Requests sent (and not measured) before the run, all at "
                                                          "once; their prompts are drawn apart from the measured "
                                                          "ones, which stay the same (default: 0).")
    p.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el", metavar="LIST",
                   help="Metrics whose statistics are printed and saved under vLLM's flat keys, comma-separated "
                        "(default: ttft,tpot,itl,e2el; vLLM's is ttft,tpot,itl).")
    p.add_argument("--metric-percentiles", default="90,99", metavar="LIST",
                   help="Percentiles reported beside the mean, median and std, comma-separated, e.g. 50,99.9 "
                        "(default: 90,99; vLLM's is 99).")
    p.add_argument("--goodput", nargs="+", default=None, metavar="METRIC:MS",
                   help="SLOs for goodput, e.g. ttft:500 tpot:50 (metrics: ttft, tpot, e2el; milliseconds).")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="Bearer token for the target (default: $OPENAI_API_KEY).")
    p.add_argument("--request-timeout", type=float, default=600.0, help="Seconds before a request fails "
                                                                        "(default: 600).")
    p.add_argument("--metrics-url", nargs="+", default=None, metavar="URL",
                   help="pdserve nodes whose /metrics give the decode-graph share (default: the decode nodes a "
                        "pdserve router lists at /nodes, else --base-url): for a router that lists none, e.g. "
                        "vllm-router, name the decode nodes.")
    p.add_argument("--save-result", default=None, metavar="FILE.json",
                   help="Write metrics under vLLM's keys (its peaks too: max_output_tokens_per_s, "
                        "max_concurrent_requests) and pdserve's, and per-request data.")
    p.add_argument("--disable-tqdm", action="store_true", help="No progress bar.")


def _check(args) -> None:
    if args.num_prompts < 1:
        raise ValueError("--num-prompts must be >= 1")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError("--max-concurrency must be >= 1")
    if args.warmup < 0:
        raise ValueError("--warmup must be >= 0")
    if args.dataset == "jsonl" and not args.dataset_path:
        raise ValueError("--dataset jsonl needs --dataset-path")
    if args.random_prefix_len < 0:
        raise ValueError("--random-prefix-len must be >= 0")
    if args.random_prefix_len and args.dataset != "random":
        raise ValueError("--random-prefix-len applies only to --dataset random")
    if args.dataset_path and args.dataset != "jsonl":
        raise ValueError("--dataset-path is read only with --dataset jsonl")
    if not 0 <= args.seed < 2 ** 32:
        raise ValueError("--seed must be in [0, 2**32)")
    if not 0 < args.request_timeout < math.inf:  # NaN fails both comparisons
        raise ValueError("--request-timeout must be a number of seconds > 0")
    if not 0 <= args.temperature < math.inf:
        raise ValueError("--temperature must be a number >= 0")
    # before the run, not after it: a result path that cannot be written would waste the whole run
    if args.save_result:
        out = Path(args.save_result).absolute()
        if out.is_dir():
            raise ValueError(f"--save-result {args.save_result}: is a directory (name a .json file)")
        parent = next(p for p in out.parents if p.exists())  # the directories below it are made at save time
        if not parent.is_dir():
            raise ValueError(f"--save-result {args.save_result}: {parent} is a file, not a directory")
        if not os.access(parent, os.W_OK | os.X_OK):
            raise ValueError(f"--save-result {args.save_result}: {parent} is not writable")


def _model_name(args) -> str:
    if args.model:
        return Path(args.model).name if Path(args.model).is_dir() else args.model
    try:
        return get_json(args.base_url + "/v1/models", 10.0,
                        {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {})["data"][0]["id"]
    except (OSError, ValueError, KeyError, IndexError, TypeError) as e:
        raise ValueError(f"--model not given and {args.base_url}/v1/models did not name one ({e})") from None


def _tokenizer_path(args):
    return args.tokenizer or (args.model if args.model and Path(args.model).is_dir() else None)


@contextlib.contextmanager
def _signals_deferred():
    """SIGINT and SIGTERM held until the block ends, then raised again. transformers' first import (torch, numpy:
    ~4 s here) does not survive an interrupt raised inside it: numpy left half-imported, or the KeyboardInterrupt
    swallowed by an import fallback (both seen with one raised at a chosen call). bench pd's interrupt test sends its
    signal in that window (and exited -6 twice in CI). Recorded by a handler rather than masked: with any other
    thread alive, a masked signal is taken by that thread and its handler still runs in the main thread."""
    if threading.current_thread() is not threading.main_thread():  # handlers can only be set from the main thread
        yield
        return
    caught: list[int] = []
    held = {s: signal.signal(s, lambda signum, frame: caught.append(signum)) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in held.items():
            signal.signal(s, handler)
        for s in dict.fromkeys(caught):
            signal.raise_signal(s)  # to the handler that was in place: bench pd's raises KeyboardInterrupt


def _tokenizer(args):
    path = _tokenizer_path(args)
    if path is None:
        if args.dataset == "random":
            raise ValueError("--dataset random needs --tokenizer (a local directory) or --model as a directory")
        return None
    if not Path(path).is_dir():
        raise ValueError(f"--tokenizer {path}: not a local directory (nothing is downloaded)")
    try:
        with _signals_deferred():
            from pdserve.core.tokenizer import load_hf_tokenizer
            return load_hf_tokenizer(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"--tokenizer {path}: cannot load a tokenizer there ({e})") from None


async def _run(specs: list[RequestSpec], offsets: list[float], args, tokenizer, desc: str):
    """Results, the run's duration, and each send's lag behind its scheduled time (seconds)."""
    conn = aiohttp.TCPConnector(limit=args.max_concurrency or 0, ttl_dns_cache=300)
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    bar = tqdm(total=len(specs), desc=desc, disable=args.disable_tqdm, unit="req")
    async with aiohttp.ClientSession(connector=conn, timeout=timeout, read_bufsize=1 << 16) as session:
        async def one(spec):
            if sem is None:
                r = await send_request(session, spec, tokenizer)
            else:
                async with sem:
                    r = await send_request(session, spec, tokenizer)
            bar.update(1)
            return r

        tasks, t0 = [], time.perf_counter()
        for spec, off in zip(specs, offsets):
            delay = t0 + off - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(spec)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    bar.close()
    return results, duration, [r.start - (t0 + off) for r, off in zip(results, offsets)]


def _samples(args, tokenizer) -> tuple[list, list]:
    """(measured, warm-up) prompts. The measured ones do not depend on --warmup: the warm-up's random prompts come
    from a stream of their own (a seed no --seed can give) after the shared prefix, jsonl's are the file's next
    lines, cycled."""
    n, w = args.num_prompts, args.warmup
    if args.dataset == "random":
        prefix = random_prefix(tokenizer, args.random_prefix_len, args.seed)

        def draw(count, seed):
            return random_dataset(tokenizer, count, args.random_input_len, args.random_output_len,
                                  args.random_range_ratio, seed, prefix) if count else []
        return draw(n, args.seed), draw(w, args.seed + 2 ** 32)
    try:
        rows = jsonl_dataset(args.dataset_path, n + w, args.random_output_len, tokenizer)
    except OSError as e:
        raise ValueError(f"--dataset-path {args.dataset_path}: {e.strerror or e}") from None
    return rows[:n], rows[n:]


def json_safe(x):
    """NaN (a metric with no samples) becomes null, infinity (a rate or burstiness) "inf": strict JSON readers
    reject both."""
    if isinstance(x, float) and math.isnan(x):
        return None
    if isinstance(x, float) and math.isinf(x):
        return "inf" if x > 0 else "-inf"
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, list):
        return [json_safe(v) for v in x]
    return x


def _print(args, model: str, metrics, shown, graph, split, phases) -> None:
    rate = "inf" if math.isinf(args.request_rate) else f"{args.request_rate:g}"
    print(f"target {args.base_url}{args.endpoint}  model {model}  request rate {rate}  "
          f"burstiness {args.burstiness:g}  max concurrency {args.max_concurrency or 'none'}")
    print(format_metrics(metrics, metrics=shown))
    if graph is not None:
        print(format_share(graph))
    if split:
        print(format_ttft_split(split))
    if phases:
        print(format_phases(phases))


def run_bench_serve(args, quiet: bool = False) -> dict:
    """Runs the benchmark described by `args` (the flags above); returns what --save-result writes."""
    _check(args)
    shown, percentiles = parse_percentiles(args.percentile_metrics, args.metric_percentiles)
    args.base_url = args.base_url.rstrip("/")
    slos = parse_goodput(args.goodput)
    tokenizer = _tokenizer(args)
    model = _model_name(args)
    if args.ignore_eos is None:
        args.ignore_eos = args.dataset == "random"
    measured, warm_up = _samples(args, tokenizer)
    specs, warm = ([RequestSpec(args.base_url, args.endpoint, model, s.prompt, s.prompt_len, s.output_len,
                                args.ignore_eos, args.temperature, args.api_key) for s in part]
                   for part in (measured, warm_up))
    offsets = arrival_offsets(len(specs), args.request_rate, args.burstiness, args.seed)
    loop_run = asyncio.run
    try:
        import uvloop  # the client must keep up with the schedule: a faster loop leaves more headroom
        loop_run = uvloop.run
    except ImportError:
        pass
    if warm:
        warm_results = loop_run(_run(warm, [0.0] * len(warm), args, tokenizer, "warmup"))[0]
        if not any(r.success for r in warm_results):
            raise RuntimeError(f"every warm-up request to {args.base_url} failed: {warm_results[0].error}")
    targets = args.metrics_url or metric_targets(args.base_url)
    before, stages_before, phases_before = scrape(targets), scrape_ttft_stages(args.base_url), scrape_phases(targets)
    gc.collect()
    gc.freeze()  # as vLLM's client: no collector pause over the objects built so far lands inside a timed request
    results, duration, lags = loop_run(_run(specs, offsets, args, tokenizer, "requests"))
    after, split = scrape(targets), means_ms(stages_before, scrape_ttft_stages(args.base_url))
    phases = means_ms(phases_before, scrape_phases(targets))
    metrics = compute_metrics(results, duration, slos, percentiles)
    graph = (after - before).summary() if before is not None and after is not None else None
    if not quiet:
        _print(args, model, metrics, shown, graph, split, phases)
    # vLLM's keys where it has the figure (flat statistics, per-request lists, `errors` one per request), plus
    # pdserve's nested statistics (`ttft_ms: {mean, ...}`), the graph share, the router's TTFT split and the decode
    # nodes' phases
    out = {"date": time.strftime("%Y%m%d-%H%M%S"), "backend": "openai-chat" if "chat" in args.endpoint else "openai",
           "base_url": args.base_url, "endpoint": args.endpoint, "model_id": model, "model": model,
           "tokenizer_id": _tokenizer_path(args),
           "dataset": args.dataset, "num_prompts": args.num_prompts, "request_rate": args.request_rate,
           "burstiness": args.burstiness, "max_concurrency": args.max_concurrency, "seed": args.seed,
           "random_input_len": args.random_input_len, "random_output_len": args.random_output_len,
           "random_range_ratio": args.random_range_ratio,
           "random_prefix_len": args.random_prefix_len, "ignore_eos": args.ignore_eos,
           "temperature": args.temperature, "warmup": args.warmup,
           "goodput_slos_ms": {k: v * 1000 for k, v in slos.items()}, **metrics.to_dict(), **metrics.vllm_keys(shown),
           "graph": graph, "router_ttft_split_ms": split, "decode_phases_ms": phases, "send_lag_ms": summarize(lags),
           "input_lens": [r.prompt_len for r in results],
           "output_lens": [r.output_tokens if r.success else 0 for r in results],
           "ttfts": [r.ttft for r in results], "itls": [r.itl for r in results],
           "latencies": [r.latency for r in results], "start_times": [r.start for r in results],
           "generated_texts": [r.generated_text for r in results], "errors": [r.error for r in results]}
    if args.save_result:
        try:
            Path(args.save_result).parent.mkdir(parents=True, exist_ok=True)
            Path(args.save_result).write_text(json.dumps(json_safe(out), indent=1))
        except OSError as e:
            raise ValueError(f"--save-result {args.save_result}: {e.strerror or e}") from None
    return out
