"""What an engine step costs right after the engine sat idle: the cause of D's slow first own step (issue 35).

    .venv/bin/python benchmarks/idle_step.py                    # tiny model, ~40 s; benchmarks/results/idle_step.json
    .venv/bin/python benchmarks/idle_step.py --model small --requests 24

One engine in this process (collocated, --threads OpenMP threads: 1 by default, as bench pd gives a P/D node on two
cores). Each request (a --prompt-len prompt, greedy) runs its prefill and --warm decode steps back to back; then the
engine waits --gaps ms before its next step, idle one of three ways (--kinds): `sleep` (the thread blocked, as an
idle engine waits for work), `spin` (a Python loop on the same thread: the core stays busy, nothing of the step's
is touched), `sleep+forward` (blocked, then one forward of the last step's batch run again before the timed step:
a diagnostic that touches the model runner's private parts, the step's outputs unchanged). The model runner's part
of each step (`execute`) is timed for --after steps past the gap; the table gives each one's extra over the same
request's steady steps before the gap, as medians over the requests (the combinations taken in turn, one a request,
so each sees the same drift). A decode node that waits for P's KV is idle in exactly this way before its first own
step, so that step pays the first column.
"""
from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_file import write_result  # noqa: E402
from spies import timed  # noqa: E402

KINDS = ("sleep", "spin", "sleep+forward")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny", help="qwen3 size made by `pdserve make-model` (default: tiny).")
    ap.add_argument("--gaps", default="0,1,5,20,50", help="Idle gaps before the timed step, ms (default 0,1,5,20,50).")
    ap.add_argument("--kinds", default=",".join(KINDS), help=f"How the engine idles, of {', '.join(KINDS)}.")
    ap.add_argument("--requests", type=int, default=6,
                    help="Requests per (gap, kind) combination (default 6), after --skip warm-up requests.")
    ap.add_argument("--skip", type=int, default=3, help="Warm-up requests left out (default 3).")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--warm", type=int, default=6, help="Decode steps before the gap (default 6; the last 3 are the "
                                                        "request's steady reference).")
    ap.add_argument("--after", type=int, default=4, help="Steps timed after the gap (default 4).")
    ap.add_argument("--threads", type=int, default=1, help="OpenMP threads of the engine (default 1).")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "idle_step.json"))
    args = ap.parse_args()
    kinds = [k for k in args.kinds.split(",") if k]
    bad = [k for k in kinds if k not in KINDS]
    if bad or not kinds:
        ap.error(f"--kinds: unknown {bad[0] if bad else '(none)'}; known: {', '.join(KINDS)}")
    try:
        gaps = [float(g) for g in args.gaps.split(",") if g]
    except ValueError:
        ap.error(f"--gaps: comma-separated numbers of ms, got {args.gaps!r}")
    if not gaps or min(gaps) < 0:
        ap.error("--gaps: at least one gap, none negative")
    if args.warm < 3 or args.after < 1 or args.requests < 1 or args.skip < 0:
        ap.error("--warm must be >= 3, --after and --requests >= 1, --skip >= 0")
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # before torch
    import torch

    from pdserve import LLM, SamplingParams
    from pdserve.model.make_model import ensure_model

    torch.set_num_threads(args.threads)
    llm = LLM(str(ensure_model("qwen3", args.model, 0)), max_model_len=args.prompt_len + args.warm + args.after + 8,
              kv_cache_memory_gb=0.05)
    eng = llm.engine
    runner = eng.runner
    prepare = runner.prepare
    step_ms: list[float] = []
    last = []

    def kept_prepare(*a, **kw):
        last[:] = [prepare(*a, **kw)]
        return last[0]
    runner.execute, runner.prepare = timed(runner.execute, step_ms), kept_prepare

    def idle(kind: str, gap_ms: float) -> None:
        end = time.perf_counter() + gap_ms / 1e3
        if kind == "spin":
            while time.perf_counter() < end:
                pass
        else:
            time.sleep(gap_ms / 1e3)
        if kind == "sleep+forward":  # the last step's forward again: its buffers are still the inputs
            step = last[0]
            with torch.inference_mode():
                if step.batch.layout is not None:
                    runner.full_graphs.run(step.desc, step.batch.layout)
                else:
                    runner.forward_all(step.batch)

    sp = SamplingParams(temperature=0, max_tokens=args.warm + args.after + 1, ignore_eos=True)
    combos = list(itertools.product(gaps, kinds))
    extra: dict[tuple, list[list[float]]] = {c: [] for c in combos}
    steady_all = []
    n = args.skip + args.requests * len(combos)
    for i in range(n):
        combo = combos[i % len(combos)]
        prompt = [(i * 131 + j * 7) % 8000 + 3 for j in range(args.prompt_len)]
        eng.add_request(prompt, sp, request_id=f"r{i}")
        times = []
        for k in range(1 + args.warm + args.after):  # prefill, warm decodes, then the timed steps after the gap
            if k == 1 + args.warm:
                idle(combo[1], combo[0])
            step_ms.clear()
            eng.step()
            times.append(sum(step_ms))
        while eng.has_unfinished_requests():
            eng.step()
        steady = statistics.median(times[args.warm - 2:1 + args.warm])
        if i >= args.skip:
            steady_all.append(steady)
            extra[combo].append([t - steady for t in times[1 + args.warm:]])
        if sys.stderr.isatty():
            print(f"\r{i + 1}/{n} requests", end="", file=sys.stderr, flush=True)
    if sys.stderr.isatty():
        print(file=sys.stderr)
    rows = []
    print(f"steady step {statistics.median(steady_all):.2f} ms (median); extra ms over it, step 1..{args.after} "
          f"after the gap:")
    print(f"{'gap ms':>7} {'idle':<14} " + " ".join(f"{'+' + str(j + 1):>7}" for j in range(args.after)))
    for (gap, kind), runs in extra.items():
        med = [statistics.median(r[j] for r in runs) for j in range(args.after)]
        rows.append({"gap_ms": gap, "kind": kind, "extra_ms": med, "requests": len(runs)})
        print(f"{gap:>7g} {kind:<14} " + " ".join(f"{m:7.2f}" for m in med))
    write_result(args.out, args, steady_step_ms=statistics.median(steady_all), rows=rows)
    eng.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
