"""oneDNN's packed GEMM against F.linear on this CPU, float32: what `pdserve/model/layers.py`'s one-row rule
(`PLAIN_ONE_ROW_MAX`) rests on.

1. Each weight shape of the tiny and small models (and the tiny model's LM head) at M = 1, 2, 4, 8, 16 rows: the
   median time of one call, packed and plain, alternating.
2. A FULL decode step of a model (default: the tiny one) at 1, 2 and 8 rows, with the rule against every layer
   packed (the code before it), alternating.
3. The same model's Linears at one row: each alone (its weight hot in cache), summed, against one pass over all of
   them in the model's order (each weight read after all the others), alternating: where the pass is much slower,
   a one-row step reads its weights from memory, a floor no change of op dispatch can lower.

    .venv/bin/python benchmarks/linear_pack.py                     # ~2 min, 1 thread
    .venv/bin/python benchmarks/linear_pack.py --threads 2 --model qwen3-small-s0
    .venv/bin/python benchmarks/linear_pack.py --steps-only --threads 2 --out benchmarks/results/linear_pack_pass.json

Writes benchmarks/results/linear_pack.json (--out).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_file import write_result  # noqa: E402

SHAPES = [(256, 256), (512, 256), (256, 640), (256, 1024), (256, 8192), (1024, 1024), (1024, 3072), (3072, 1024)]
ROWS = (1, 2, 4, 8, 16)


def per_call_us(fn, n: int) -> float:
    for _ in range(max(5, n // 20)):
        fn()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n * 1e6


def shapes(reps: int) -> list[dict]:
    out = []
    with torch.inference_mode():
        for i, o in SHAPES:
            w = torch.randn(o, i)
            packed = torch.ops.mkldnn._reorder_linear_weight(w, 8)
            for m in ROWS:
                x = torch.randn(m, i)
                n = 1000 if i * o < 2_000_000 else 200
                got = {"packed": [], "plain": []}
                for r in range(reps):
                    for kind in (("packed", "plain") if r % 2 == 0 else ("plain", "packed")):
                        fn = (lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")) \
                            if kind == "packed" else (lambda: F.linear(x, w))
                        got[kind].append(per_call_us(fn, n))
                row = {"in": i, "out": o, "rows": m, **{k: statistics.median(v) for k, v in got.items()}}
                row["plain_over_packed"] = row["plain"] / row["packed"]
                out.append(row)
                print(f"{i:>5} x {o:<5} M={m:<3} packed {row['packed']:7.1f} us  plain {row['plain']:7.1f} us  "
                      f"plain/packed {row['plain_over_packed']:.2f}", flush=True)
    return out


def linears(llm) -> tuple[list, list[int]]:
    """The model's Linears and the rule's packed_min_rows of each (what all_packed() puts back)."""
    from pdserve.model.layers import Linear
    lins = [m for m in llm.engine.runner.model.modules() if isinstance(m, Linear)]
    return lins, [m.packed_min_rows for m in lins]


def all_packed(lins: list, rule: list[int], on: bool) -> None:
    """Every Linear on the packed GEMM at every row count (on), or the rule's choice back (off)."""
    for m, mr in zip(lins, rule):
        m.packed_min_rows = 1 if on else mr


def full_steps(llm, reps: int) -> tuple[list[dict], Callable[[], torch.Tensor]]:
    """(the FULL steps at 1, 2 and 8 rows, rule against all packed; the one-row step's callable)"""
    from pdserve import SamplingParams
    fg = llm.engine.runner.full_graphs
    seen, orig = {}, fg.run
    fg.run = lambda desc, layout: (seen.setdefault(desc.num_reqs, (desc, layout)), orig(desc, layout))[1]
    for rows in (1, 2, 8):
        llm.generate(["hello world " * 20] * rows, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    lins, rule = linears(llm)
    out = []
    for rows in sorted(seen):
        step = fg.step_callable(*seen[rows])
        got = {"rule": [], "all_packed": []}
        with torch.inference_mode():
            for r in range(reps):
                for kind in (("rule", "all_packed") if r % 2 == 0 else ("all_packed", "rule")):
                    all_packed(lins, rule, kind == "all_packed")
                    got[kind].append(per_call_us(step, 200) / 1e3)
        row = {"rows": rows, **{k: statistics.median(v) for k, v in got.items()}}
        row["rule_over_all_packed"] = row["rule"] / row["all_packed"]
        out.append(row)
        print(f"FULL step, {rows} row(s): rule {row['rule']:.3f} ms, all packed {row['all_packed']:.3f} ms, "
              f"rule/all packed {row['rule_over_all_packed']:.2f}", flush=True)
    all_packed(lins, rule, False)
    return out, fg.step_callable(*seen[1])


def weights_pass(llm, reps: int, step: Callable[[], torch.Tensor]) -> dict:
    """The model's Linears at one row, as a decode step calls them (their own weights, the rule's kernel): each
    called alone and over again (its weight stays in this core's caches), summed, against one pass over all of them
    in the model's order, over again (each weight read after all the others: from memory wherever the whole set
    does not fit the caches), with the rule and with every weight packed. The pass is the floor of a one-row step
    with these kernels that no change of op dispatch can lower: only fewer bytes or kernels that read faster can
    (`pass_gb_s` against the machine's streaming read); `mb` is what it reads."""
    lins, rule = linears(llm)
    xs = [torch.randn(1, m.weight.shape[1]) for m in lins]
    got = {"alone_sum": [], "pass": [], "pass_all_packed": [], "step": []}

    def one_pass():
        for m, x in zip(lins, xs):
            m(x)
    with torch.inference_mode():
        for r in range(reps):
            for kind in (list(got) if r % 2 == 0 else list(got)[::-1]):
                all_packed(lins, rule, kind == "pass_all_packed")
                got[kind].append(sum(per_call_us(lambda: m(x), 300) for m, x in zip(lins, xs))
                                 if kind == "alone_sum" else per_call_us(step if kind == "step" else one_pass, 200))
    all_packed(lins, rule, False)
    mb = sum(m.weight.numel() * m.weight.element_size() for m in lins) / 1e6
    row = {"linears": len(lins), "mb": mb, **{k: statistics.median(v) / 1e3 for k, v in got.items()}}
    # this VM's memory moves by 2-3x within minutes: each round's pass against the same round's step
    row["pass_over_step"] = statistics.median(p / t for p, t in zip(got["pass"], got["step"]))
    row["pass_over_alone"] = row["pass"] / row["alone_sum"]
    row["pass_gb_s"] = mb / 1e3 / (row["pass"] / 1e3)
    print(f"{len(lins)} Linears at 1 row, {mb:.1f} MB of weights: each alone (summed) {row['alone_sum']:.3f} ms, "
          f"one pass over all {row['pass']:.3f} ms ({row['pass_over_alone']:.2f}x, {row['pass_gb_s']:.1f} GB/s), "
          f"all packed {row['pass_all_packed']:.3f} ms; the one-row FULL step {row['step']:.3f} ms, the pass "
          f"{row['pass_over_step']:.0%} of it (median over rounds)", flush=True)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1, help="torch threads (default: 1, a P/D node's share here).")
    p.add_argument("--model", default=None,
                   help="Model for the FULL step part: a directory or a name under ~/.cache/pdserve/models "
                        "(default: qwen3-tiny-s0, made if missing).")
    p.add_argument("--reps", type=int, default=4, help="Alternating repetitions of each pair (default: 4).")
    p.add_argument("--steps-only", action="store_true",
                   help="Skip part 1 (the shapes alone): only the FULL steps and the weights pass (~30 s).")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "linear_pack.json"))
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from pdserve.model.make_model import ensure_model, pdserve_home
    model = str(ensure_model("qwen3", "tiny", 0)) if args.model is None else \
        args.model if os.path.isdir(args.model) else str(pdserve_home() / "models" / args.model)
    from pdserve import LLM
    got = {"shapes": [] if args.steps_only else shapes(args.reps)}
    llm = LLM(model, max_model_len=512)
    got["full_steps"], step = full_steps(llm, args.reps)
    got["weights_pass"] = weights_pass(llm, 2 * args.reps, step)
    write_result(args.out, args, **got)


if __name__ == "__main__":
    main()
