"""The device script for issue 13: the seed's scenario on one GPU, D's step times per graph mode, rule and backend.

    python benchmarks/cuda_decode_bench.py --out $OUT/cuda_decode_bench.json      # on the GPU machine (<= 5 min)
    python benchmarks/cuda_decode_bench.py --device cpu --shape tiny --out /tmp/x.json   # smoke test, CPU

Needs only torch, safetensors (and triton for the Triton backend) and this source tree: no server packages, no
tokenizer (the engine's scheduler and model runner are driven with token ids). It writes random weights of a
Qwen3-0.6B shape in bf16 (`--shape 0.6b`; `tiny` for a CPU smoke run), then for each attention backend:
1. kernel: the Triton decode kernel alone at batch 64, 4K context, 8 KV heads x 128, bf16: K/V bytes read per
   second against the GPU's copy bandwidth measured here (a device-to-device copy of 2 GiB);
2. arrivals: `--batch` requests decoding at `--context` tokens while imported-KV replays (the D-side arrival driver:
   a local prefill of all but the last prompt token, then the replay row) arrive as a Poisson process per step, for
   each rate x rule (strict, decode-shaped) x K (0, 3) x mode (FULL graphs with PIECEWISE for the rest, PIECEWISE
   only, eager): median and p99 step ms, the non-FULL share with reasons, tokens equal to eager's, graph logits
   against eager's (max abs difference), and that
   no KV block outside the ones handed to requests was written (padded rows stay on the null block).
Results go to --out after every run (partial JSON if the time limit or an error stops it), and a seed-style table
is printed at the end.
"""
from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import random
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve.config import EngineConfig  # noqa: E402
from pdserve.core.kv_cache_manager import KVCacheManager, cdiv  # noqa: E402
from pdserve.core.scheduler import Scheduler  # noqa: E402
from pdserve.request import Request  # noqa: E402
from pdserve.sampling_params import SamplingParams  # noqa: E402
from pdserve.worker.model_runner import ModelRunner  # noqa: E402

SHAPES = {  # Qwen3-0.6B's shape, and a tiny one for CPU smoke runs
    "0.6b": dict(vocab_size=151936, hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, intermediate_size=3072),
    "tiny": dict(vocab_size=512, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=32, intermediate_size=256),
}


def write_model(d: Path, shape: dict, dtype: torch.dtype) -> None:
    from safetensors.torch import save_file
    d.mkdir(parents=True, exist_ok=True)
    cfg = {**shape, "rms_norm_eps": 1e-6, "max_position_embeddings": 8192, "tie_word_embeddings": False,
           "architectures": ["Qwen3ForCausalLM"], "rope_theta": 1e6, "torch_dtype": str(dtype).removeprefix("torch.")}
    (d / "config.json").write_text(json.dumps(cfg))
    g = torch.Generator().manual_seed(0)
    h, i, hd, nh, kvh = (shape[k] for k in ("hidden_size", "intermediate_size", "head_dim", "num_attention_heads",
                                             "num_key_value_heads"))
    t = {"model.embed_tokens.weight": torch.randn(shape["vocab_size"], h, generator=g) * 4 / h ** 0.5,
         "lm_head.weight": torch.randn(shape["vocab_size"], h, generator=g) * 4 / h ** 0.5,
         "model.norm.weight": torch.ones(h)}
    for n in range(shape["num_hidden_layers"]):
        p = f"model.layers.{n}."
        for name, (o, k) in {"self_attn.q_proj": (nh * hd, h), "self_attn.k_proj": (kvh * hd, h),
                             "self_attn.v_proj": (kvh * hd, h), "self_attn.o_proj": (h, nh * hd),
                             "mlp.gate_proj": (i, h), "mlp.up_proj": (i, h), "mlp.down_proj": (h, i)}.items():
            t[p + name + ".weight"] = torch.randn(o, k, generator=g) / k ** 0.5
        for name, size in {"input_layernorm": h, "post_attention_layernorm": h, "self_attn.q_norm": hd,
                           "self_attn.k_norm": hd}.items():
            t[p + name + ".weight"] = torch.ones(size)
    # written under another name first: a run killed mid-save must not leave a truncated file later runs would load
    save_file({k: v.to(dtype).contiguous() for k, v in t.items()}, str(d / "model.safetensors.tmp"))
    os.replace(d / "model.safetensors.tmp", d / "model.safetensors")


def error_text(e: BaseException) -> str:
    """The traceback with its chained causes: a failed CUDA graph capture raises again on leaving the capture
    block ("operation not permitted when stream is capturing"), which hides the first error behind it."""
    return "".join(traceback.format_exception(e))[-3000:]


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


# (tile, num_warps, num_stages) timed beside the default launch: tiles at Triton's defaults, then warps and stages
LAUNCHES = [(32, 4, 3), (64, 4, 3), (16, 8, 3), (32, 8, 3), (64, 8, 3), (16, 4, 2), (16, 4, 4), (32, 4, 4)]


def kernel_bandwidth(device: str, dtype: torch.dtype, smoke: bool) -> dict:
    """The Triton decode kernel alone against a device copy (bytes moved per second)."""
    from pdserve.attention.triton_decode import DecodeWorkspace, paged_decode
    from pdserve.attention.triton_backend import num_splits
    rows, ctx, kvh, hd, bs, group = (2, 64, 2, 32, 16, 2) if smoke else (64, 4096, 8, 128, 16, 2)
    nb = cdiv(ctx, bs)
    cache = torch.randn(2, rows * nb + 1, bs, kvh, hd, device=device, dtype=dtype)
    table = torch.arange(1, rows * nb + 1, device=device).view(rows, nb)
    positions = torch.full((rows, 1), ctx - 1, device=device, dtype=torch.long)
    q = torch.randn(rows, kvh * group, hd, device=device, dtype=dtype)
    ws = DecodeWorkspace(torch.device(device))
    splits = num_splits(rows, nb)

    def timed(fn, reps):
        fn()
        sync(device)
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        sync(device)
        return (time.perf_counter() - t0) / reps
    reps = 2 if smoke else 50
    t_kernel = timed(lambda: paged_decode(q, cache, table, positions, hd ** -0.5, splits, ws), reps)
    # bf16 correctness on the device (the CPU interpreter's bf16 dot is not faithful): the torch backend in fp32
    from pdserve.attention.metadata import AttentionMetadata, AttnGroup
    from pdserve.attention.torch_backend import attention_masks, paged_attention
    few = slice(0, 4)
    meta = AttentionMetadata(positions[:0, 0], [AttnGroup(slice(0, 4), table[few], positions[few])])
    ref = paged_attention(q[few].float(), cache.float(), table[few], positions[few],
                          attention_masks(meta, bs, group, torch.float32)[0], hd ** -0.5)
    got = paged_decode(q[few], cache, table[few], positions[few], hd ** -0.5, splits, ws).float()
    kv_bytes = 2 * rows * ctx * kvh * hd * cache.element_size()
    src = torch.empty(2 ** (20 if smoke else 30), device=device, dtype=torch.float16)
    dst = torch.empty_like(src)
    t_copy = timed(lambda: dst.copy_(src), reps)
    copy_bw = 2 * src.numel() * src.element_size() / t_copy  # read + write
    # the first GPU run says whether another launch than the default (the block size's tile, 4 warps, 3 stages)
    # pays: keys per loop step, warps, pipeline stages (LAUNCHES; each compiles once, a second or two)
    launches = {}
    for tile, warps, stages in LAUNCHES:
        try:
            t = timed(lambda: paged_decode(q, cache, table, positions, hd ** -0.5, splits, ws, tile, warps, stages),
                      reps)
            launches[f"tile{tile}_w{warps}_s{stages}"] = kv_bytes / t / copy_bw
        except Exception as e:  # e.g. out of shared memory for a deep pipeline: the others still count
            launches[f"tile{tile}_w{warps}_s{stages}"] = error_text(e).splitlines()[-1]
    return {"rows": rows, "context": ctx, "kv_heads": kvh, "head_dim": hd, "splits": splits,
            "kernel_ms": t_kernel * 1e3, "kv_gb_per_s": kv_bytes / t_kernel / 1e9, "copy_gb_per_s": copy_bw / 1e9,
            "share_of_copy": kv_bytes / t_kernel / copy_bw, "max_abs_err_vs_torch_fp32": float((got - ref).abs().max()),
            "share_of_copy_by_launch": launches}


def capture_ladder(batch: int, q: int) -> list[int]:
    """The sizes this scenario's steps can take (batch..batch + 32 rows of 1 or q tokens): every size a FULL step
    needs, PIECEWISE every 8 (q = 1) or 32 tokens between, instead of the default ladder's ~L + 1 graphs for each of
    ~40 sizes no step here reaches."""
    rows = range(batch, batch + 33, 8)
    return sorted({1, 2, 4, 8, 16, 32, *rows, *(q * r for r in rows), *range(q * batch, q * (batch + 32) + 1, 32)})


class Run:
    """One (backend, mode, rule, K) engine: a scheduler and model runner over one KV pool, the arrival driver."""

    def __init__(self, model: Path, device: str, dtype: torch.dtype, backend: str, mode: str, rule: str, k: int,
                 batch: int, context: int, steps: int):
        self.device, self.context = device, context
        # room for every step to emit 1 + K tokens: the base batch must not reach max_model_len and thin out
        max_len = context + (1 + k) * (steps + 2) + 32
        blocks = (batch + 32) * cdiv(max_len, 16) + 1
        kw = {"enforce_eager": True} if mode == "NONE" else \
            {"cudagraph_mode": "PIECEWISE" if mode == "PIECEWISE" else "FULL_AND_PIECEWISE",
             "cudagraph_capture_sizes": ",".join(map(str, capture_ladder(batch, 1 + k)))}
        spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2} if k else None
        cfg = EngineConfig.from_kwargs(str(model), device=device, dtype=str(dtype).removeprefix("torch."),
                                       max_model_len=max_len, max_num_seqs=batch + 32, num_gpu_blocks_override=blocks,
                                       max_num_batched_tokens=8192, attention_backend=backend, full_graph_rule=rule,
                                       speculative_config=spec, **kw)
        self.kv = KVCacheManager(blocks, 16, True)
        self.touched = touched = set()  # the closure holds the set, not self: a Run must be freed when dropped
        alloc = self.kv.pool.allocate

        def tracked(n):
            got = alloc(n)
            touched.update(got)
            return got
        self.kv.pool.allocate = tracked
        self.sched = Scheduler(cfg.scheduler, self.kv, max_len, speculative_config=cfg.speculative_config)
        self.ids = itertools.count()
        self.runner = ModelRunner(cfg, torch.device(device), dtype, max_len, blocks)
        t0 = time.perf_counter()
        self.runner.capture_graphs(progress=False)
        self.capture_s = time.perf_counter() - t0
        logits: list[torch.Tensor] = []  # kept on the device during the timed steps; no reference to self
        self.logits = logits
        self.runner.logits_hook = lambda reqs, lg: len(logits) < 8 and logits.append(lg.detach().clone())

    def arrive(self, prompt: list[int], max_tokens: int) -> Request:
        """The arrival driver: real KV for all but the last prompt token, then the request waits for its replay."""
        req = Request(f"r{next(self.ids)}", prompt,
                      SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
        self.sched.add_request(req)
        n = len(prompt)
        assert self.kv.allocate_slots(req, n + self.sched.num_lookahead(req)), "pool too small for the scenario"
        self.runner.prefill_kv(req, 0, n - 1, self.kv.block_table)
        req.num_computed_tokens = n - 1
        self.kv.cache_blocks(req)
        self.sched.mark_imported(req)
        return req

    def step(self) -> float:
        out = self.sched.schedule()
        sync(self.device)
        t0 = time.perf_counter()
        res = self.runner.execute(out.rows, self.kv.block_table)
        sync(self.device)
        dt = time.perf_counter() - t0
        self.sched.update_from_output(out, res.sampled)
        return dt

    def untouched_blocks_clean(self) -> bool:
        """Blocks never handed to a request (the null block aside) hold no KV: padded rows wrote only block 0."""
        never = [b for b in range(1, self.runner.kv_caches[0].shape[1]) if b not in self.touched]
        if not never:
            return True
        idx = torch.tensor(never, device=self.runner.kv_caches[0].device)
        return all(bool((c[:, idx] == 0).all()) for c in self.runner.kv_caches)


def scenario(run: Run, batch: int, rate: float, steps: int, seed: int, vocab: int) -> dict:
    rng = random.Random(seed)

    def prompt(n):  # repeats, so an n-gram drafter finds matches in the replays' prompts
        base = [rng.randrange(3, vocab) for _ in range(64)]
        return (base * (n // 64 + 1))[:n]
    base = [run.arrive(prompt(run.context), 10_000) for _ in range(batch)]
    run.step()  # the base replays
    run.step()  # warm-up: first launches (Triton compiles its variants) are not timed
    g0 = run.runner.graph_stats.snapshot()
    times, arrivals = [], []
    for _ in range(steps):
        n, t = 0, rng.expovariate(1.0)
        while t < rate:
            n, t = n + 1, t + rng.expovariate(1.0)
        arrivals += [run.arrive(prompt(run.context), 16) for _ in range(n)]
        times.append(run.step())
    g = run.runner.graph_stats.snapshot()
    full, total = g["full_steps"] - g0["full_steps"], g["total_steps"] - g0["total_steps"]
    reasons = {r: v - g0["non_full_by_reason"].get(r, 0) for r, v in g["non_full_by_reason"].items()}
    times.sort()
    return {"median_step_ms": statistics.median(times) * 1e3, "p99_step_ms": times[int(0.99 * (len(times) - 1))] * 1e3,
            "non_full_share": (total - full) / max(1, total), "reasons": {r: v for r, v in reasons.items() if v},
            "arrivals": len(arrivals), "tokens": [r.output_token_ids[:32] for r in base + arrivals],
            "blocks_clean": run.untouched_blocks_clean()}


def first_divergence(ours: list[list[int]], ref: list[list[int]]):
    """The earliest output index at which any request's tokens differ from the reference's (None: none)."""
    steps = [next(i for i, (x, y) in enumerate(zip(a, b)) if x != y) for a, b in zip(ours, ref)
             if any(x != y for x, y in zip(a, b))]
    return min(steps, default=None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/cuda_decode_bench.json")
    ap.add_argument("--device", default="cuda", help="cuda; cpu only to smoke-test this script (TRITON_INTERPRET=1 "
                                                     "for the triton backend)")
    ap.add_argument("--shape", choices=SHAPES, default="0.6b")
    ap.add_argument("--backends", default="torch,triton", help="attention backends, in order")
    ap.add_argument("--batch", type=int, default=64, help="requests decoding when arrivals start")
    ap.add_argument("--context", type=int, default=2048, help="prompt tokens of every request")
    ap.add_argument("--rates", default="0.1,0.4", help="replay arrivals per decode step (Poisson means)")
    ap.add_argument("--steps", type=int, default=100, help="timed decode steps per run")
    ap.add_argument("--time-limit", type=float, default=240.0, help="seconds; stop starting runs after this")
    args = ap.parse_args()
    assert args.device == "cpu" or torch.cuda.is_available(), "needs a CUDA GPU"
    t_start = time.monotonic()
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model = Path(f"/tmp/pdserve-{args.shape}-{str(dtype).removeprefix('torch.')}")
    if not (model / "model.safetensors").is_file():
        write_model(model, SHAPES[args.shape], dtype)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "torch": torch.__version__,
              "shape": args.shape, "dtype": str(dtype), "batch": args.batch, "context": args.context,
              "steps": args.steps, "kernel": None, "runs": []}

    def save():
        out.write_text(json.dumps(result, indent=1) + "\n")
    if "triton" in args.backends:
        try:
            result["kernel"] = kernel_bandwidth(args.device, dtype, smoke=args.device == "cpu")
        except Exception as e:
            result["kernel"] = {"error": error_text(e)}
        print("kernel:", json.dumps(result["kernel"]), flush=True)
        save()
    eager_ref: dict = {}
    # K = 0 for every backend first: if the time limit cuts the run, the plain FULL-vs-eager rows are in
    for k in (0, 3):
        for backend in args.backends.split(","):
            for rate in map(float, args.rates.split(",")):
                # eager first (it ignores the rule: one per backend, rate and K), the reference of the FULL runs
                for rule, mode in (("decode-shaped", "NONE"), ("strict", "FULL"), ("decode-shaped", "FULL"),
                                   ("decode-shaped", "PIECEWISE")):
                    if time.monotonic() - t_start > args.time_limit:
                        print("time limit reached: partial results", flush=True)
                        save()
                        return
                    row = {"backend": backend, "rate": rate, "k": k, "rule": rule, "mode": mode}
                    try:
                        run = Run(model, args.device, dtype, backend, mode, rule, k, args.batch, args.context,
                                  args.steps)
                        row.update(scenario(run, args.batch, rate, args.steps, 1, SHAPES[args.shape]
                                            ["vocab_size"]), capture_s=run.capture_s)
                        key = (backend, rate, k)
                        if mode == "NONE":
                            eager_ref[key] = (row["tokens"], [x.cpu() for x in run.logits])
                        elif key in eager_ref:
                            # informational: eager and FULL group rows (and split the context) differently,
                            # so in bf16 a near-tie can flip a greedy token without any bug
                            ref_tokens, ref_logits = eager_ref[key]
                            row["tokens_equal_eager"] = row["tokens"] == ref_tokens
                            row["first_divergence_step"] = first_divergence(row["tokens"], ref_tokens)
                            row["max_logit_diff_vs_eager"] = max(
                                (float((a.float().cpu() - b.float()).abs().max())
                                 for a, b in zip(run.logits, ref_logits)
                                 if a.shape == b.shape), default=None)
                    except Exception as e:  # one failing configuration ends only its row
                        row["error"] = error_text(e)
                    finally:  # ~27 GB of KV and graphs per run on the 0.6B shape: free them before the next
                        run = None
                        gc.collect()
                        if args.device == "cuda":
                            torch.cuda.empty_cache()
                    row.pop("tokens", None)
                    result["runs"].append(row)
                    print(json.dumps(row), flush=True)
                    save()
    save()
    print(table(result))


def table(result: dict) -> str:
    lines = [f"{'backend':>7} {'rate':>5} {'K':>2} {'rule':>14} {'mode':>9} {'median ms':>9} {'p99 ms':>8} "
             f"{'non-FULL':>8}  reasons / check"]
    for r in result["runs"]:
        if "error" in r:
            lines.append(f"{r['backend']:>7} {r['rate']:>5} {r['k']:>2} {r['rule']:>14} {r['mode']:>9}  "
                         f"error: {r['error'].strip().splitlines()[-1][:100]}")
            continue
        check = "" if r["mode"] == "NONE" else f" tokens==eager {r.get('tokens_equal_eager')}"
        lines.append(f"{r['backend']:>7} {r['rate']:>5} {r['k']:>2} {r['rule']:>14} {r['mode']:>9} "
                     f"{r['median_step_ms']:>9.2f} {r['p99_step_ms']:>8.2f} {100 * r['non_full_share']:>7.1f}%  "
                     f"{r['reasons'] or '-'}{check} blocks_clean {r['blocks_clean']}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
