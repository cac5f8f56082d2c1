"""The seed's arrival pattern on one decode node, per full-graph rule, and the cost of choosing a graph.

    .venv/bin/python benchmarks/graph_dispatch.py            # tiny model from $PDSERVE_HOME (built if missing)

Part 1: 16 requests decoding while replay arrivals (prompt KV imported by the D-side arrival driver, as from a
prefill node) land at 4 rates; for each rule: FULL steps, non-FULL steps and the non-FULL share, with reasons.
With --speculative-config (e.g. '{"method": "ngram", "num_speculative_tokens": 3}') every run speculates, and
each run's tokens are checked against a run without it at the same rate (greedy: every request's tokens so far
are a prefix of the other's, whatever the rule).
Part 2: classification + dispatch time per step for 256 scheduled rows, next to the engine step's own time.
On CPU nothing is captured, so only the counts and the dispatch cost mean anything here, not step-time ratios.
"""
from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from pathlib import Path

from pdserve import LLM, SamplingParams
from pdserve.model.make_model import ensure_model
from pdserve.worker.cudagraph_dispatch import RULES

CONSUMER = {"kv_connector": "DecodeBenchConnector", "kv_role": "kv_consumer"}


def prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 8000) for _ in range(n)]


def arrival_run(model: str, rule: str, rate: float, steps: int, seed: int, spec=None) -> dict:
    llm = LLM(model, full_graph_rule=rule, kv_transfer_config=CONSUMER, max_model_len=512, kv_cache_memory_gb=0.1,
              speculative_config=spec)
    e = llm.engine
    done: dict[str, list[int]] = {}
    rng = random.Random(seed)
    for i in range(16):
        e.add_prefilled_request(prompt(rng, 64), SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
    e.step()  # the 16 base replays
    base = e.graph_stats()
    arrivals = 0
    for _ in range(steps):
        for _ in range(_poisson(rng, rate)):
            e.add_prefilled_request(prompt(rng, rng.randrange(32, 200)),
                                    SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
            arrivals += 1
        done.update({o.request_id: list(o.outputs[0].token_ids) for o in e.step() if o.finished})
    tokens = {**{rid: list(r.output_token_ids) for rid, r in e.scheduler.requests.items()}, **done}
    s = e.graph_stats()
    full = s["full_steps"] - base["full_steps"]
    non_full = s["non_full_steps"] - base["non_full_steps"]
    reasons = {r: n - base["non_full_by_reason"].get(r, 0) for r, n in s["non_full_by_reason"].items()}
    return {"rule": rule, "rate_per_step": rate, "arrivals": arrivals, "full_steps": full, "non_full_steps": non_full,
            "non_full_share": non_full / max(1, full + non_full),
            "reasons": {r: n for r, n in reasons.items() if n}, "tokens": tokens,
            "spec_decode": e.spec_decode_stats()}


def same_tokens(a: dict, b: dict) -> bool:
    """Each request's tokens so far in one run are a prefix of its tokens in the other."""
    return a.keys() == b.keys() and all(x[:len(y)] == y[:len(x)] for k in a for x, y in [(a[k], b[k])])


def _poisson(rng: random.Random, lam: float) -> int:
    n, t = 0, rng.expovariate(1.0)
    while t < lam:
        n += 1
        t += rng.expovariate(1.0)
    return n


def dispatch_cost(model: str, num_reqs: int, iters: int) -> dict:
    llm = LLM(model, max_num_seqs=num_reqs, max_num_batched_tokens=max(2048, num_reqs), max_model_len=256,
              kv_transfer_config=CONSUMER, kv_cache_memory_gb=0.2)
    e = llm.engine
    rng = random.Random(0)
    for _ in range(num_reqs):
        e.add_prefilled_request(prompt(rng, 40), SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    e.step()
    step_times = []
    for _ in range(10):
        t0 = time.perf_counter()
        e.step()
        step_times.append(time.perf_counter() - t0)
    rows = e.scheduler.schedule().rows  # a real 256-row decode step, scheduled but not run
    runner = e.runner
    t0 = time.perf_counter()
    for _ in range(iters):
        runner.choose_graph(rows)
    per_step_us = (time.perf_counter() - t0) / iters * 1e6
    return {"num_reqs": len(rows), "classify_dispatch_us": per_step_us,
            "engine_step_ms": statistics.median(step_times) * 1e3, "device": e.device.type}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="Model directory (default: the tiny qwen3 demo model).")
    ap.add_argument("--rates", default="0.05,0.1,0.2,0.4", help="Arrivals per decode step (Poisson means).")
    ap.add_argument("--steps", type=int, default=200, help="Decode steps per run.")
    ap.add_argument("--out", default="benchmarks/results/graph_dispatch.json", help="JSON result file.")
    ap.add_argument("--speculative-config", default=None, metavar="JSON",
                    help="Speculative decoding for every run (vLLM's JSON, n-gram); tokens checked against plain.")
    args = ap.parse_args()
    model = args.model or str(ensure_model("qwen3", "tiny", 0))
    rates = [float(r) for r in args.rates.split(",")]
    spec = json.loads(args.speculative_config) if args.speculative_config else None
    runs = []
    print(f"{'rate/step':>9} {'rule':>14} {'arrivals':>8} {'FULL':>6} {'non-FULL':>8} {'share':>7}  reasons"
          + ("  (accepted/draft tokens, same tokens as without spec)" if spec else ""))
    for rate in rates:
        plain = arrival_run(model, "decode-shaped", rate, args.steps, seed=1)["tokens"] if spec else None
        for rule in RULES:
            r = arrival_run(model, rule, rate, args.steps, seed=1, spec=spec)
            tokens = r.pop("tokens")
            extra = ""
            if spec:
                r["same_tokens_as_plain"] = same_tokens(tokens, plain)
                sd = r["spec_decode"]
                extra = f"  ({sd['num_accepted_tokens']}/{sd['num_draft_tokens']}, {r['same_tokens_as_plain']})"
            runs.append(r)
            print(f"{rate:>9} {rule:>14} {r['arrivals']:>8} {r['full_steps']:>6} {r['non_full_steps']:>8} "
                  f"{r['non_full_share']:>7.1%}  {r['reasons']}{extra}")
    cost = dispatch_cost(model, 256, 2000)
    print(f"\nclassification + dispatch for {cost['num_reqs']} rows: {cost['classify_dispatch_us']:.1f} us per step "
          f"(target < 50 us); the engine step itself: {cost['engine_step_ms']:.1f} ms on {cost['device']}")
    result = {"machine": platform.processor() or platform.machine(), "device": cost["device"], "model": model,
              "steps": args.steps, "speculative_config": spec, "runs": runs, "dispatch_cost": cost,
              "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
