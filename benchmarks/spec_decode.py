"""Speculative decoding on CPU: decode tokens/s and acceptance, n-gram drafts against two reference drafters.

    .venv/bin/python benchmarks/spec_decode.py            # small model from $PDSERVE_HOME (built if missing)

For batch 1 and 8 (greedy, 128 output tokens per request, EOS ignored), decode tokens/s (the steps after every
request's prefill, timed in the engine loop) without speculative decoding (the baseline, run in the same script,
alternating with the others) and with K drafts from:
- ngram: the prompt-lookup proposer (prompt_lookup_min 1, max 3) on code-like prompts (stdlib source) and random
  token ids;
- oracle: the tokens a run without speculation produced (every draft right: the bound on what drafting can give);
- anti-oracle: a token that is never the right one (every draft wrong: the cost of verifying K for nothing).
Each arm checks that its tokens equal the baseline's. Acceptance rate is accepted / draft tokens, mean acceptance
length 1 + accepted / drafts (vLLM's definitions). Also the proposer's host cost per call at 256 to 4096 tokens of
context. Median of --reps runs; ratios are against the baseline of the same prompts and batch.
"""
from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from pdserve import LLM, SamplingParams
from pdserve.model.make_model import ensure_model
from pdserve.spec_decode.ngram_proposer import propose

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.oracle import corpus_text  # noqa: E402  (stdlib source: the code-like prompts)


class FixedDrafter:
    """Drafts from each request's reference continuation: right (oracle) or shifted off it (anti-oracle)."""

    def __init__(self, refs: dict[tuple, list[int]], vocab: int, wrong: bool):
        self.refs, self.vocab, self.wrong = refs, vocab, wrong

    def propose_padded_for(self, req, k: int) -> list[int]:
        ref = self.refs[tuple(req.prompt_token_ids)]
        d = ref[req.num_output_tokens:req.num_output_tokens + k]
        d = [(t + 1) % self.vocab for t in d] if self.wrong else d
        return d + [-1] * (k - len(d))


def decode_run(llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]], dict]:
    """(decode tokens/s, tokens per prompt, spec counters of this run)."""
    e = llm.engine
    before = e.spec_decode_stats() or {}
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ids = [e.add_request(p, sp).request_id for p in prompts]
    done = {}
    while any(e.scheduler.requests[r].num_output_tokens == 0 for r in ids):  # every prefill, untimed
        done.update({o.request_id: o for o in e.step() if o.finished})
    t0 = time.perf_counter()
    while e.has_unfinished_requests():
        done.update({o.request_id: o for o in e.step() if o.finished})
    dt = time.perf_counter() - t0
    tokens = [list(done[r].outputs[0].token_ids) for r in ids]
    after = e.spec_decode_stats() or {}
    delta = {k: after[k] - before.get(k, 0) for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")} \
        if after else None
    return sum(len(t) - 1 for t in tokens) / dt, tokens, delta


def prompt_sets(tok, rng: random.Random, n: int, length: int) -> dict[str, list[list[int]]]:
    ids = tok(corpus_text()).input_ids
    code = []
    for _ in range(n):
        s = rng.randrange(0, len(ids) - length)
        code.append(ids[s:s + length])
    rand = [[rng.randrange(3, tok.vocab_size) for _ in range(length)] for _ in range(n)]
    return {"code": code, "random": rand}


def proposer_cost(reps: int = 2000) -> dict:
    rng = np.random.default_rng(0)
    out = {}
    for n in (256, 1024, 4096):
        t = rng.integers(0, 8000, n)
        t0 = time.perf_counter()
        for _ in range(reps):
            propose(t, 3, 1, 3)
        out[n] = (time.perf_counter() - t0) / reps * 1e6
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="Model directory (default: the small qwen3 model).")
    ap.add_argument("--k", type=int, default=3, help="num_speculative_tokens (default: 3).")
    ap.add_argument("--batches", default="1,8", help="Batch sizes (default: 1,8).")
    ap.add_argument("--max-tokens", type=int, default=128, help="Output tokens per request (default: 128).")
    ap.add_argument("--prompt-len", type=int, default=128, help="Prompt tokens (default: 128).")
    ap.add_argument("--reps", type=int, default=3, help="Runs per arm (median; default: 3).")
    ap.add_argument("--out", default="benchmarks/results/spec_decode.json", help="JSON result file.")
    args = ap.parse_args()
    model = args.model or str(ensure_model("qwen3", "small", 0))
    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    engine = dict(max_model_len=args.prompt_len + args.max_tokens + 16, kv_cache_memory_gb=0.5)
    base = LLM(model, **engine)
    drafting = LLM(model, speculative_config=spec, **engine)
    ngram_proposer = drafting.engine.scheduler.proposer
    vocab = base.engine.vocab_size
    rng = random.Random(0)
    results = []
    print(f"{'batch':>5} {'prompts':>7} {'drafter':>11} {'tok/s':>8} {'ratio':>6} {'accept':>7} {'mean len':>8} "
          f"{'same':>5}")
    for batch in [int(b) for b in args.batches.split(",")]:
        for kind, prompts in prompt_sets(base.get_tokenizer(), rng, batch, args.prompt_len).items():
            # baseline first: its tokens are the oracle's drafts
            _, ref, _ = decode_run(base, prompts, args.max_tokens)
            refs = {tuple(p): t for p, t in zip(prompts, ref)}
            drafters = {"ngram": ngram_proposer, "oracle": FixedDrafter(refs, vocab, False),
                        "anti-oracle": FixedDrafter(refs, vocab, True)}
            if kind == "random":
                drafters.pop("oracle"), drafters.pop("anti-oracle")  # the bounds do not depend on the prompts
            speeds = {name: [] for name in ["baseline", *drafters]}
            stats, same = {}, {}
            for _ in range(args.reps):
                speeds["baseline"].append(decode_run(base, prompts, args.max_tokens)[0])
                for name, d in drafters.items():
                    drafting.engine.scheduler.proposer = d
                    tps, toks, st = decode_run(drafting, prompts, args.max_tokens)
                    speeds[name].append(tps)
                    stats[name], same[name] = st, toks == ref
            b = statistics.median(speeds["baseline"])
            print(f"{batch:>5} {kind:>7} {'none':>11} {b:>8.1f} {1.0:>6.2f}")
            for name in drafters:
                v, st = statistics.median(speeds[name]), stats[name]
                rate = st["num_accepted_tokens"] / max(1, st["num_draft_tokens"])
                mean_len = 1 + st["num_accepted_tokens"] / max(1, st["num_drafts"])
                print(f"{batch:>5} {kind:>7} {name:>11} {v:>8.1f} {v / b:>6.2f} {rate:>7.1%} {mean_len:>8.2f} "
                      f"{str(same[name]):>5}")
                results.append({"batch": batch, "prompts": kind, "drafter": name, "tokens_per_s": v,
                                "baseline_tokens_per_s": b, "ratio": v / b, "acceptance_rate": rate,
                                "mean_acceptance_length": mean_len, "same_tokens": same[name], **st})
    cost = proposer_cost()
    print("proposer host cost per call (K=3, n 1..3): " + ", ".join(f"{n} tokens {us:.1f} us"
                                                                   for n, us in cost.items()))
    out = {"machine": platform.processor() or platform.machine(), "model": model, "k": args.k,
           "max_tokens": args.max_tokens, "prompt_len": args.prompt_len, "reps": args.reps, "results": results,
           "proposer_us_per_call": cost, "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
