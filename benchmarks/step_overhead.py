"""Host work per decode step, by phase, on the tiny model: what the engine spends around the forward pass.

    .venv/bin/python benchmarks/step_overhead.py                  # writes benchmarks/results/step_overhead.json
    .venv/bin/python benchmarks/step_overhead.py --rows 32 --steps 100
    PYTHONPATH=/tmp/base .venv/bin/python benchmarks/step_overhead.py --out /tmp/before.json   # another checkout
    .venv/bin/python benchmarks/step_overhead.py --async    # writes benchmarks/results/step_overhead_async.json

For each batch size (1, 32, 256 rows by default) and workload, R requests with distinct 64-token prompts are
prefilled, then `--steps` decode steps are timed phase by phase (wrappers around the engine's own functions):
  schedule  Scheduler.schedule (plus the connector and metrics bookkeeping of LLMEngine.step before the model)
  prepare   InputBuffers.prepare (filling the input buffers)
  forward   the model's forward (on CPU this is compute; for the tiny model much of it is op dispatch)
  logits    the LM head (compute_logits)
  sample    the sampler (penalties, filters, noise, logprobs, the read-back)
  outputs   the rest of LLMEngine.step: update_from_output, stop checks, detokenizer, RequestOutput objects
  server    what the server's engine loop adds per step (the picklable records sent to the HTTP side)
"op calls" counts the aten/oneDNN calls of one more step (torch.profiler). Workloads: `greedy` (all rows
temperature 0) and `mix` (half greedy, half temperature 0.8 + top-p 0.9 + repetition
penalty 1.1; the random half seeded; 4 rows with logprobs=5). "host" = everything but forward and logits. Medians
over the timed steps. Run it on a quiet machine: two cores, and anything else running distorts every figure.

The phases are of the synchronous step (async scheduling off). `--async` times, for each case, one engine with async
scheduling off (phase by phase, as above) and one with it on (whole steps: step() and the records, as the engine
loop does), alternating every 10 steps so that both see the same machine, both running their model on one thread
(the async engine's worker: one OpenMP pool, pdserve/worker/openmp.py); "hidden" = (step_off - step_on) / host_off,
the share of the synchronous step's host time the overlap hides (negative: it costs more than it hides).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PHASES = ("schedule", "prepare", "forward", "logits", "sample", "outputs", "server")


def params_for(workload: str, i: int, n: int):
    from pdserve import SamplingParams
    common = dict(max_tokens=400, ignore_eos=True)
    try:  # as the server asks (a tree from before output kinds, run as the baseline, has only cumulative outputs)
        from pdserve.sampling_params import RequestOutputKind
        common["output_kind"] = RequestOutputKind.DELTA
    except ImportError:
        pass
    if workload == "greedy" or i < n // 2:
        return SamplingParams(temperature=0, logprobs=5 if workload == "mix" and i < 2 else None, **common)
    return SamplingParams(temperature=0.8, top_p=0.9, repetition_penalty=1.1, seed=1000 + i,
                          logprobs=5 if i >= n - 2 else None, **common)


class PhaseTimer:
    """Accumulates seconds per phase within a step; `wrap` times a bound callable as one phase."""

    def __init__(self):
        self.cur = defaultdict(float)

    def wrap(self, obj, name: str, phase: str):
        fn = getattr(obj, name)

        def timed(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.cur[phase] += time.perf_counter() - t
        setattr(obj, name, timed)


def engine(model: str, rows: int, workload: str, prompt_len: int, async_scheduling: bool = False):
    """An engine with `rows` requests decoding (prefilled, three steps in)."""
    from pdserve import LLM
    from pdserve.config import SchedulerConfig
    ctx = prompt_len + 400 + 16
    kw = {"async_scheduling": async_scheduling} if "async_scheduling" in SchedulerConfig.__dataclass_fields__ else {}
    llm = LLM(model, max_model_len=ctx, max_num_seqs=max(rows, 1), max_num_batched_tokens=max(2048, rows),
              num_gpu_blocks_override=rows * (ctx // 16 + 1) + ctx // 16 + 2, **kw)
    eng = llm.engine
    for i in range(rows):
        eng.add_request([3 + (i * 131 + j * 7) % 8000 for j in range(prompt_len)], params_for(workload, i, rows))
    while any(r.num_output_tokens == 0 for r in eng.scheduler.running) or eng.scheduler.waiting:
        eng.step()  # prefill (and the first tokens)
    for _ in range(3):
        eng.step()
    return eng


def measure(model: str, rows: int, workload: str, steps: int, prompt_len: int = 64, chunk: int = 0,
            other=None, on_thread=None) -> dict:
    """Phase medians of `steps` synchronous steps. --async: `other(n)` runs between chunks of `chunk` steps, and
    `on_thread(fn, n)` runs each chunk where the other engine runs its model."""
    from pdserve.serve.engine_messages import record
    eng = engine(model, rows, workload, prompt_len)
    runner = eng.runner
    timer = PhaseTimer()
    timer.wrap(eng.scheduler, "schedule", "schedule")
    timer.wrap(runner.buffers, "prepare", "prepare")
    timer.wrap(runner.model, "compute_logits", "logits")
    sampler, model_call = runner.sampler, runner.model.forward
    runner.sampler = lambda *a, **kw: _timed(timer, "sample", sampler, *a, **kw)
    runner.model.forward = lambda *a, **kw: _timed(timer, "forward", model_call, *a, **kw)
    per_step = defaultdict(list)

    def timed_steps(n: int) -> None:
        for _ in range(n):
            timer.cur.clear()
            t = time.perf_counter()
            outs = eng.step()
            total = time.perf_counter() - t
            t = time.perf_counter()
            records = [record(o) for o in outs]
            timer.cur["server"] = time.perf_counter() - t
            assert len(records) == rows, f"{len(records)} outputs for {rows} rows"
            timer.cur["outputs"] = total - sum(timer.cur[p] for p in PHASES if p not in ("outputs", "server"))
            for p in PHASES:
                per_step[p].append(timer.cur[p] * 1e3)
            per_step["host"].append(sum(timer.cur[p] for p in PHASES if p not in ("forward", "logits")) * 1e3)
            per_step["step"].append((total + timer.cur["server"]) * 1e3)
    if chunk:
        for k in range(0, steps, chunk):
            other(min(chunk, steps - k))
            on_thread(timed_steps, min(chunk, steps - k))
    else:
        timed_steps(steps)
    assert eng.graph_stats()["full_steps"] > 0
    if chunk:
        return {k: statistics.median(v) for k, v in per_step.items()}
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:  # one more step, counted op by op (not timed)
        eng.step()
    ops = sum(e.count for e in prof.key_averages() if e.key.startswith(("aten::", "mkldnn::")))
    return {**{k: statistics.median(v) for k, v in per_step.items()}, "op_calls": ops}


def measure_async(model: str, rows: int, workload: str, steps: int, prompt_len: int = 64, chunk: int = 10) -> dict:
    """Step medians with async scheduling off (by phase) and on (whole steps), alternating every `chunk` steps."""
    from pdserve.serve.engine_messages import record
    eng, times = engine(model, rows, workload, prompt_len, async_scheduling=True), []

    def run_on(n: int) -> None:
        for _ in range(n):
            t = time.perf_counter()
            records = [record(o) for o in eng.step()]  # the engine loop's own work overlaps the forward too
            times.append((time.perf_counter() - t) * 1e3)
            assert len(records) == rows, f"{len(records)} outputs for {rows} rows"
    # The synchronous engine's steps run on the other's model thread: one OpenMP pool (pdserve/worker/openmp.py;
    # two pools on few cores throttle every parallel region), freed on this thread once the engines are built.
    from pdserve.worker.openmp import release_thread_pool

    def on_model_thread(fn, n: int) -> None:
        release_thread_pool()  # (building the synchronous engine made this thread's pool again)
        eng.steps.call(fn, n)
    off = measure(model, rows, workload, steps, prompt_len, chunk, run_on, on_model_thread)
    assert eng.steps.num_overlapped >= steps
    eng.shutdown()
    on = statistics.median(times)
    return {"step_off": off["step"], "step_on": on, "host_off": off["host"],
            "hidden": (off["step"] - on) / off["host"], **{f"off_{p}": off[p] for p in PHASES}}


def _timed(timer, phase, fn, *a, **kw):
    t = time.perf_counter()
    try:
        return fn(*a, **kw)
    finally:
        timer.cur[phase] += time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model directory (default: the tiny Qwen3 `make demo` builds)")
    ap.add_argument("--rows", default="1,32,256", help="comma-separated batch sizes (rows per decode step)")
    ap.add_argument("--workloads", default="greedy,mix", help="comma-separated: greedy, mix")
    ap.add_argument("--steps", type=int, default=60, help="timed decode steps per case (median reported)")
    ap.add_argument("--prompt-len", type=int, default=64, help="prompt tokens per request (the context the timed "
                    "steps decode over; the tiny model allows up to ~1600)")
    ap.add_argument("--async", dest="overlap", action="store_true", help="async scheduling on against off: the "
                    "share of the host time hidden behind the forward (default --out: step_overhead_async.json)")
    ap.add_argument("--out", default=None, help="JSON result path (default: benchmarks/results/step_overhead.json)")
    args = ap.parse_args()
    args.out = args.out or str(ROOT / "benchmarks/results" / f"step_overhead{'_async' if args.overlap else ''}.json")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if not os.environ.get("PYTHONPATH"):  # PYTHONPATH=<another checkout> measures that tree (a baseline)
        sys.path.insert(0, str(ROOT))
    from pdserve.model.make_model import ensure_model
    model = args.model or str(ensure_model("qwen3", "tiny", 0))
    import torch
    results = []
    if args.overlap:
        print(f"{'rows':>5} {'workload':>8} {'host off':>9} {'step off':>9} {'step on':>9} {'hidden':>7}  (ms)")
    else:
        print(f"{'rows':>5} {'workload':>8} " + " ".join(f"{p:>9}" for p in PHASES) + f" {'host':>7} {'step':>7}  (ms)"
              f" {'op calls':>8}")
    for rows in map(int, args.rows.split(",")):
        for wl in args.workloads.split(","):
            if args.overlap:
                r = measure_async(model, rows, wl, args.steps, args.prompt_len)
                results.append({"rows": rows, "workload": wl, **r})
                print(f"{rows:>5} {wl:>8} {r['host_off']:9.3f} {r['step_off']:9.3f} {r['step_on']:9.3f} "
                      f"{r['hidden']:7.1%}", flush=True)
                continue
            r = measure(model, rows, wl, args.steps, args.prompt_len)
            results.append({"rows": rows, "workload": wl, **r})
            print(f"{rows:>5} {wl:>8} " + " ".join(f"{r[p]:9.3f}" for p in PHASES) + f" {r['host']:7.3f} "
                  f"{r['step']:7.3f}       {r['op_calls']:8d}", flush=True)
    import subprocess
    import pdserve
    tree = Path(pdserve.__file__).resolve().parent.parent
    rev = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    out = {"tree": str(tree), "rev": rev.stdout.strip(), "prompt_len": args.prompt_len, "torch": torch.__version__,
           "threads": torch.get_num_threads(), "steps": args.steps, "model": model, "async": args.overlap,
           "results": results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
