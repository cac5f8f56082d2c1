"""Two checkouts of pdserve, alternating on the same machine: host work per step and offline throughput.

    .venv/bin/python benchmarks/ab_trees.py --base 4be9a0f            # base commit vs this tree
    .venv/bin/python benchmarks/ab_trees.py --base HEAD~3 --rounds 3 --rows 1,32,256

For a change that must not cost speed (a refactor): the base commit is checked out into a temporary worktree, then
each round runs, for base and this tree in turn (the order flips each round), `benchmarks/step_overhead.py` (this
tree's script, importing pdserve from the tree under test) and an offline `LLM.generate` of `--prompts` requests
(`--input-len` random prompt tokens, `--output-len` tokens, ignore_eos, greedy) on the tiny model `make demo`
builds. The table gives medians over rounds and the ratio this tree / base (host ms and step ms: lower is better;
throughput: higher is better). Run it on a quiet machine: two cores, and anything else distorts every figure.
Writes benchmarks/results/ab_trees.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

OFFLINE = r"""
import json, sys, time, random
from pdserve import LLM, SamplingParams
model, n, inp, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
llm = LLM(model=model, dtype="float32", max_model_len=inp + out + 8, max_num_seqs=64)
rng = random.Random(0)
prompts = [[rng.randrange(10, 1000) for _ in range(inp)] for _ in range(n)]
sp = SamplingParams(max_tokens=out, ignore_eos=True, temperature=0.0)
llm.generate(prompts[:4], sp)  # warm-up
t0 = time.perf_counter()
outs = llm.generate(prompts, sp)
dt = time.perf_counter() - t0
print(json.dumps({"seconds": dt, "output_tok_s": sum(len(o.outputs[0].token_ids) for o in outs) / dt}))
"""


def run_tree(tree: Path, args, model: str, tmp: Path, tag: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = tmp / f"{tag}.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks/step_overhead.py"), "--model", model, "--rows", args.rows,
                    "--workloads", args.workloads, "--steps", str(args.steps), "--out", str(out)],
                   env=env, check=True, cwd=tmp, stdout=subprocess.DEVNULL)
    steps = json.loads(out.read_text())
    offline = subprocess.run([sys.executable, "-c", OFFLINE, model, str(args.prompts), str(args.input_len),
                              str(args.output_len)], env=env, check=True, cwd=tmp, capture_output=True, text=True)
    return {"step_overhead": steps, "offline": json.loads(offline.stdout.strip().splitlines()[-1])}


def host_and_step(result: dict) -> dict[str, float]:
    """{'<workload> x<rows> host_ms': ..., '... step_ms': ...} from one step_overhead.json."""
    out = {}
    for case in result["results"]:
        key = f"{case['workload']} x{case['rows']}"
        out[f"{key} host_ms"] = case["host"]
        out[f"{key} step_ms"] = case["step"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="git revision to compare against (checked out in a temp worktree)")
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds (each runs both trees; default 2)")
    ap.add_argument("--rows", default="1,32", help="step_overhead batch sizes (default 1,32)")
    ap.add_argument("--workloads", default="greedy,mix", help="step_overhead workloads (default greedy,mix)")
    ap.add_argument("--steps", type=int, default=60, help="timed decode steps per step_overhead case (default 60)")
    ap.add_argument("--prompts", type=int, default=64, help="offline requests (default 64)")
    ap.add_argument("--input-len", type=int, default=64, help="offline prompt tokens (default 64)")
    ap.add_argument("--output-len", type=int, default=64, help="offline output tokens (default 64)")
    ap.add_argument("--model", default=None, help="model directory (default: the tiny Qwen3 `make demo` builds)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/ab_trees.json"), help="JSON result path")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from pdserve.model.make_model import ensure_model
    model = args.model or str(ensure_model("qwen3", "tiny", 0))
    rev = subprocess.run(["git", "rev-parse", args.base], cwd=ROOT, check=True, capture_output=True, text=True)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, check=True, capture_output=True, text=True)
    with tempfile.TemporaryDirectory(prefix="pdserve-ab-") as tmpdir:
        tmp = Path(tmpdir)
        base_tree = tmp / "base"
        subprocess.run(["git", "worktree", "add", "--detach", str(base_tree), rev.stdout.strip()], cwd=ROOT,
                       check=True, capture_output=True)
        try:
            runs: dict[str, list[dict]] = {"base": [], "this": []}
            for r in range(args.rounds):
                order = [("base", base_tree), ("this", ROOT)]
                for name, tree in order if r % 2 == 0 else order[::-1]:
                    print(f"round {r + 1}/{args.rounds}: {name} ({tree})", flush=True)
                    runs[name].append(run_tree(tree, args, model, tmp, f"{name}-{r}"))
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base_tree)], cwd=ROOT, capture_output=True)
    table = {}
    for name, results in runs.items():
        per = [host_and_step(x["step_overhead"]) for x in results]
        row = {k: statistics.median(p[k] for p in per) for k in per[0]}
        row["offline output tok/s"] = statistics.median(x["offline"]["output_tok_s"] for x in results)
        table[name] = row
    print(f"\n{'measure':32} {'base':>10} {'this':>10} {'this/base':>10}")
    for k in table["base"]:
        b, t = table["base"][k], table["this"][k]
        print(f"{k:32} {b:10.3f} {t:10.3f} {t / b:10.3f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"base": rev.stdout.strip(), "this": head.stdout.strip(),
                                          "dirty_tree_note": "this = the working tree at `this` (may have edits)",
                                          "args": vars(args), "median": table, "runs": runs}, indent=1))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
