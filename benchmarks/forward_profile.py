"""Where a decode step's forward goes on the small model: the op-level profile behind issue 11's small-model ratio.

    .venv/bin/python benchmarks/forward_profile.py            # writes benchmarks/results/forward_profile.json
    .venv/bin/python benchmarks/forward_profile.py --dtype bfloat16   # the same in bf16 (forward_profile_bfloat16.json)

For batch sizes 1, 4 and 8 (the concurrency of vs_vllm.py's small-model workload, 128 in / 32 out at 2 req/s, is
about 3), R requests with 128-token prompts are prefilled, then decode steps are profiled with torch.profiler and
every op's self time is put in a class: `gemm` (the linear layers and the LM head: oneDNN / MKL matmuls), `attention`
(the K/V gather from the paged cache and the attention math), `norm_rope` (RMSNorm, rotary embedding), `other`
(activation, residual adds, copies, indexing). The GEMMs' achieved GFLOP/s (2 x weights x rows per step) is set
against the same machine's GEMM rate on the same shapes measured in this script (the model's own widest projection, the
LM head, called alone at the same rows), so `gemm_share` x the step is the part
no engine change can remove: only less arithmetic (lower precision, fewer weights) or faster kernels can. Then a
128-token prefill step, timed and profiled the same way (`profile_prefill`), each projection timed inside
batch-1 decode steps and alone (`linears_in_step`), and the
floors (`floors`): the machine's read bandwidth, the decode step it allows, and the model's Linears alone at decode
and prefill sizes. Run it on a quiet machine.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GEMM = ("addmm", "mm", "linear", "matmul", "mkldnn", "bmm")
ATTN = ("scaled_dot_product", "index_select", "gather", "_softmax", "softmax", "baddbmm", "index")
NORM = ("rms_norm", "rsqrt", "pow", "mean", "cat", "neg", "flip")


def classify(name: str) -> str:
    n = name.split("::")[-1]
    if any(k in n for k in GEMM):
        return "gemm"
    if any(k in n for k in ATTN):
        return "attention"
    if any(k in n for k in NORM):
        return "norm_rope"
    return "other"


def gemm_rate(model, rows: int, steps: int = 50) -> float:
    """GFLOP/s of the model's own widest Linear (oneDNN-packed on CPU, as in the step) alone at `rows` rows: this
    machine's GEMM rate on the step's shapes, with nothing else between the calls."""
    import torch

    from pdserve.model.layers import Linear
    lin = max((m for m in model.modules() if isinstance(m, Linear)), key=lambda m: m.weight.numel())
    out_f, in_f = lin.weight.shape
    x = torch.randn(rows, in_f, dtype=lin.weight.dtype)
    with torch.inference_mode():
        for _ in range(5):
            lin(x)
        t = time.perf_counter()
        for _ in range(steps):
            lin(x)
        return 2 * rows * in_f * out_f * steps / (time.perf_counter() - t) / 1e9


def profile_rows(model: str, rows: int, steps: int, dtype: str = "float32") -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from pdserve import LLM, SamplingParams
    llm = LLM(model, dtype=dtype, max_model_len=512, max_num_seqs=max(rows, 1))
    eng = llm.engine
    for i in range(rows):
        eng.add_request([3 + (i * 131 + j * 7) % 8000 for j in range(128)],
                        SamplingParams(temperature=0, max_tokens=300, ignore_eos=True))
    while any(r.num_output_tokens == 0 for r in eng.scheduler.running) or eng.scheduler.waiting:
        eng.step()
    for _ in range(3):
        eng.step()
    times = []
    fwd = eng.runner.model.forward
    spent = []

    def timed(*a, **kw):
        t = time.perf_counter()
        try:
            return fwd(*a, **kw)
        finally:
            spent.append(time.perf_counter() - t)
    eng.runner.model.forward = timed
    for _ in range(steps):
        t = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            eng.step()
    by_class = _by_class(prof, steps)
    calls = sum(e.count for e in prof.key_averages() if e.key.startswith(("aten::", "mkldnn::")))
    c = eng.hf_config
    hd = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    h, q, kv = c["hidden_size"], c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    weights = c["num_hidden_layers"] * (2 * h * q + 2 * h * kv + 3 * h * c["intermediate_size"]) + h * c["vocab_size"]
    flops = 2 * weights * rows
    total_ops = sum(by_class.values())
    step_ms, fwd_ms = statistics.median(times) * 1e3, statistics.median(spent) * 1e3
    gemm_ms = by_class["gemm"] * step_ms / total_ops if total_ops else 0.0  # profiler times rescaled to the clock
    return {"rows": rows, "step_ms": step_ms, "forward_ms": fwd_ms,
            "op_ms": {k: round(v, 3) for k, v in sorted(by_class.items())},
            "op_share": {k: round(v / total_ops, 3) for k, v in sorted(by_class.items())},
            "op_calls_per_step": calls // steps, "matmul_weights": weights,
            "gemm_gflops_in_step": flops / (gemm_ms / 1e3) / 1e9 if gemm_ms else None,
            "gemm_gflops_ceiling": gemm_rate(eng.runner.model, rows), "torch_threads": torch.get_num_threads()}


def linears_alone(lins, rows: int):
    """A callable running `lins` in model order on `rows` rows of fixed random input (one tensor per input width),
    with nothing between the calls: the step's GEMMs alone."""
    import torch
    xs = {m.weight.shape[1]: torch.randn(rows, m.weight.shape[1], dtype=m.weight.dtype) for m in lins}

    def run() -> None:
        with torch.inference_mode():
            for m in lins:
                m(xs[m.weight.shape[1]])
    return run


def profile_prefill(model: str, tokens: int = 128, reps: int = 12, dtype: str = "float32") -> dict:
    """A prompt of `tokens` tokens prefilled alone, one step each (the step that sets TTFT and, with decodes riding
    on it, the p99 ITL of vs_vllm.py's small workload), timed, then profiled by op class as the decode steps."""
    from torch.profiler import ProfilerActivity, profile

    from pdserve import LLM, SamplingParams
    llm = LLM(model, dtype=dtype, max_model_len=512, max_num_seqs=1)
    eng = llm.engine
    seen = [0]

    def step() -> None:
        seen[0] += 1  # another prompt each time: no prefix-cache hit
        eng.add_request([3 + (seen[0] * 131 + j * 7) % 8000 for j in range(tokens)],
                        SamplingParams(temperature=0, max_tokens=1))
        while eng.scheduler.waiting or eng.scheduler.running:
            eng.step()
    from pdserve.model.layers import Linear
    # the LM head at every row here: an upper bound
    linears = linears_alone([m for m in eng.runner.model.modules() if isinstance(m, Linear)], tokens)
    for _ in range(3):
        step()
    times, alone = [], []
    for _ in range(reps):  # interleaved with the Linears alone: this VM's speed drifts within minutes
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
        t = time.perf_counter()
        linears()
        alone.append(time.perf_counter() - t)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(reps):
            step()
    by_class = _by_class(prof, reps)
    total = sum(by_class.values())
    return {"tokens": tokens, "step_ms": statistics.median(times) * 1e3,
            "linears_alone_ms": statistics.median(alone) * 1e3,
            "op_ms": {k: round(v, 3) for k, v in sorted(by_class.items())},
            "op_share": {k: round(v / total, 3) for k, v in sorted(by_class.items())}}


def linears_in_step(model: str, steps: int = 60, dtype: str = "float32") -> dict:
    """Each projection's median time inside batch-1 decode steps and called alone back to back (same module, same
    input width, the same minute): whether the GEMMs run slower between the step's other ops than alone."""
    from pdserve import LLM, SamplingParams
    from pdserve.model.layers import Linear
    llm = LLM(model, dtype=dtype, max_model_len=512, max_num_seqs=1)
    eng = llm.engine
    eng.add_request([5] * 128, SamplingParams(temperature=0, max_tokens=300, ignore_eos=True))
    for _ in range(5):
        eng.step()
    mods = [(n.split(".")[-1], m) for n, m in eng.runner.model.named_modules() if isinstance(m, Linear)]
    spent = {"step": defaultdict(list), "alone": defaultdict(list)}
    where = ["step"]
    for kind, m in mods:
        def timed(x, _f=m.forward, _k=kind):
            t = time.perf_counter()
            y = _f(x)
            spent[where[0]][_k].append(time.perf_counter() - t)
            return y
        m.forward = timed
    alone_pass = linears_alone([m for _, m in mods], 1)
    for _ in range(steps):  # interleaved: this VM's speed drifts within minutes
        where[0] = "step"
        eng.step()
        where[0] = "alone"
        alone_pass()
    in_step, alone = ({k: statistics.median(v) * 1e6 for k, v in spent[w].items()} for w in ("step", "alone"))
    count = defaultdict(int)
    for kind, _ in mods:
        count[kind] += 1
    return {"us_in_step": in_step, "us_alone": alone, "calls_per_step": dict(count),
            "ms_per_step_in_step": sum(in_step[k] * n for k, n in count.items()) / 1e3,
            "ms_per_step_alone": sum(alone[k] * n for k, n in count.items()) / 1e3}


def _by_class(prof, steps: int) -> dict:
    by_class = defaultdict(float)
    for e in prof.key_averages():
        if e.key.startswith(("aten::", "mkldnn::")):
            by_class[classify(e.key)] += e.self_cpu_time_total / steps / 1e3
    return by_class


def floors(model: str, dtype: str = "float32") -> dict:
    """What the hardware allows the same forward: this machine's read bandwidth over a buffer the size of the
    weights (none of it in cache), the decode floor it sets (every weight read once per step), and every Linear of
    the model called in model order at 1, 4, 8 and 128 rows (weights streamed from memory, as in a step, with
    nothing else between the calls): the GEMM time of a decode step and of a 128-token prefill chunk."""
    import torch

    from pdserve import LLM
    from pdserve.model.layers import Linear
    llm = LLM(model, dtype=dtype, max_model_len=128, max_num_seqs=1, num_gpu_blocks_override=10)
    lins = [m for m in llm.engine.runner.model.modules() if isinstance(m, Linear)]
    nbytes = sum(m.weight.numel() * m.weight.element_size() for m in lins)
    buf = torch.ones(nbytes // 4, dtype=torch.float32)
    buf.sum()
    t = time.perf_counter()
    for _ in range(5):
        buf.sum()
    read = nbytes * 5 / (time.perf_counter() - t) / 1e9
    del buf
    out = {"weight_bytes": nbytes, "read_gb_s": read, "decode_floor_ms": nbytes / read / 1e6, "linears": []}
    for rows in (1, 4, 8, 128):
        run = linears_alone(lins, rows)
        run()
        reps = 3 if rows == 128 else 10
        t = time.perf_counter()
        for _ in range(reps):
            run()
        ms = (time.perf_counter() - t) / reps * 1e3
        flops = 2 * rows * sum(m.weight.numel() for m in lins)
        out["linears"].append({"rows": rows, "ms": ms, "gflops": flops / ms / 1e6, "gb_s": nbytes / ms / 1e6})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model directory (default: the small Qwen3 vs_vllm.py uses)")
    ap.add_argument("--rows", default="1,4,8", help="comma-separated batch sizes")
    ap.add_argument("--steps", type=int, default=30, help="profiled decode steps per batch size")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="model dtype (bfloat16: the "
                    "float32 weights cast at load, oneDNN-packed as float32's are)")
    ap.add_argument("--out", default=None, help="JSON result path (default benchmarks/results/forward_profile.json, "
                    "forward_profile_bfloat16.json for --dtype bfloat16)")
    args = ap.parse_args()
    suffix = "" if args.dtype == "float32" else f"_{args.dtype}"
    args.out = args.out or str(ROOT / f"benchmarks/results/forward_profile{suffix}.json")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from pdserve.model.make_model import ensure_model
    model = args.model or str(ensure_model("qwen3", "small", 0))
    results = []
    for rows in (int(r) for r in args.rows.split(",")):
        r = profile_rows(model, rows, args.steps, args.dtype)
        results.append(r)
        print(f"rows {rows:3d}: step {r['step_ms']:.2f} ms, forward {r['forward_ms']:.2f} ms; op share "
              + ", ".join(f"{k} {v:.0%}" for k, v in r["op_share"].items())
              + f"; GEMM {r['gemm_gflops_in_step']:.0f} GFLOP/s in the step vs {r['gemm_gflops_ceiling']:.0f} "
                "standalone", flush=True)
    pre = profile_prefill(model, dtype=args.dtype)
    print(f"prefill of {pre['tokens']} tokens: step {pre['step_ms']:.2f} ms, its Linears alone "
          f"{pre['linears_alone_ms']:.2f} ms; op share "
          + ", ".join(f"{k} {v:.0%}" for k, v in pre["op_share"].items()), flush=True)
    per = linears_in_step(model, dtype=args.dtype)
    print("batch-1 projections, us in a step vs alone: " + ", ".join(
        f"{k} {per['us_in_step'][k]:.0f} / {per['us_alone'][k]:.0f}" for k in per["us_in_step"])
        + f"; per step {per['ms_per_step_in_step']:.2f} / {per['ms_per_step_alone']:.2f} ms", flush=True)
    fl = floors(model, args.dtype)
    print(f"floors: read {fl['read_gb_s']:.1f} GB/s, so reading the {fl['weight_bytes'] / 1e6:.0f} MB of weights "
          f"takes {fl['decode_floor_ms']:.2f} ms; the model's Linears alone: "
          + ", ".join(f"{x['rows']} rows {x['ms']:.2f} ms ({x['gb_s']:.0f} GB/s, {x['gflops']:.0f} GFLOP/s)"
                      for x in fl["linears"]), flush=True)
    Path(args.out).write_text(json.dumps({"model": model, "dtype": args.dtype, "results": results, "prefill": pre,
                                          "linears_in_step": per, "floors": fl}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
