"""A CPU prefill chunk with and without pdserve keeping freed host memory (`worker/host_memory.py`).

    .venv/bin/python benchmarks/host_memory.py            # writes benchmarks/results/host_memory.json; ~15 s
    .venv/bin/python benchmarks/host_memory.py --vllm     # and vLLM's prefill of the same requests; ~1 min

Each arm is a fresh interpreter (the allocator setting is process-wide) running the small model: 12 requests one
after another, each a 128-token prompt and 4 output tokens (so decode steps run between two prefills, as in
serving), timing each request's prefill step and counting the minor page faults the whole request took. Arms
alternate (on, off, on, off); medians over the last 10 requests of each run. With `--vllm` (needs the venv
`vs_vllm.py --install` makes), vLLM's offline `LLM` runs the same requests too, same dtype, block size 32 and
threads, and its prefill is timed as the wall time of a `generate` of one token (its own scheduling included, so
an upper bound on its step). Run it on a quiet machine.
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

PROBE = """
import json, os, resource, sys, time
from pdserve import LLM, SamplingParams
llm = LLM(sys.argv[1], max_model_len=512, max_num_seqs=32, block_size=32)
eng = llm.engine
prefill, faults = [], []
for i in range(12):
    eng.add_request([3 + (i * 131 + j * 7) % 8000 for j in range(128)],
                    SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    f = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t = time.perf_counter()
    eng.step()
    prefill.append((time.perf_counter() - t) * 1e3)
    while eng.has_unfinished_requests():
        eng.step()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f)
print(json.dumps({"prefill_ms": prefill[2:], "faults": faults[2:]}))
"""


VLLM_PROBE = """
import json, sys, time
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
def main():
    llm = LLM(sys.argv[1], dtype="float32", max_model_len=512, block_size=32, max_num_seqs=32)
    sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    prefill = []
    for i in range(12):
        p = TokensPrompt(prompt_token_ids=[3 + (i * 131 + j * 7) % 8000 for j in range(128)])
        t = time.perf_counter()
        llm.generate([p], sp, use_tqdm=False)
        prefill.append((time.perf_counter() - t) * 1e3)
    print(json.dumps({"prefill_ms": prefill[2:]}))
if __name__ == "__main__":
    main()
"""


def run_vllm(model: str, tmp: Path) -> dict:
    from vs_vllm import VENV
    script = tmp / "vllm_prefill.py"  # vLLM's engine spawns a process: it needs a real main module
    script.write_text(VLLM_PROBE)
    env = {**os.environ, "OMP_NUM_THREADS": "2", "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1",
           "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, sorted(os.sched_getaffinity(0))[:2]))}
    out = subprocess.run([str(VENV / "bin/python"), str(script), model], env=env, capture_output=True, text=True,
                         check=True, cwd=tmp)
    return json.loads(next(ln for ln in reversed(out.stdout.splitlines()) if ln.startswith('{"prefill_ms"')))


def run(model: str, keep: bool) -> dict:
    env = {**os.environ, "PDSERVE_KEEP_HOST_MEMORY": "1" if keep else "0", "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", PROBE, model], env=env, capture_output=True, text=True, check=True,
                         cwd=ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model directory (default: the small Qwen3 vs_vllm.py uses)")
    ap.add_argument("--rounds", type=int, default=2, help="runs of each arm, alternating")
    ap.add_argument("--vllm", action="store_true", help="also time vLLM's offline prefill of the same requests")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/host_memory.json"), help="JSON result path")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from pdserve.model.make_model import ensure_model
    model = args.model or str(ensure_model("qwen3", "small", 0))
    arms: dict[str, list[dict]] = {"kept": [], "returned": []}
    for _ in range(args.rounds):
        for name in arms:
            r = run(model, name == "kept")
            arms[name].append(r)
            print(f"{name:8s}: prefill {statistics.median(r['prefill_ms']):6.1f} ms, "
                  f"{statistics.median(r['faults']):7.0f} minor faults per request", flush=True)
    summary = {name: {"prefill_ms": statistics.median(x for r in runs for x in r["prefill_ms"]),
                      "faults_per_request": statistics.median(x for r in runs for x in r["faults"])}
               for name, runs in arms.items()}
    if args.vllm:
        sys.path.insert(0, str(ROOT / "benchmarks"))
        with tempfile.TemporaryDirectory() as tmp:
            v = run_vllm(model, Path(tmp))
        summary["vllm"] = {"prefill_ms": statistics.median(v["prefill_ms"])}
        print(f"vllm    : prefill {summary['vllm']['prefill_ms']:6.1f} ms (generate of one token)", flush=True)
    ratio = summary["kept"]["prefill_ms"] / summary["returned"]["prefill_ms"]
    print(f"128-token prefill: {summary['kept']['prefill_ms']:.1f} ms kept vs {summary['returned']['prefill_ms']:.1f}"
          f" ms returned ({ratio:.2f}x)")
    Path(args.out).write_text(json.dumps({"model": model, "summary": summary, "ratio": ratio, "runs": arms},
                                         indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
