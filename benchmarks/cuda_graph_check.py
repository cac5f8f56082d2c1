"""One-shot CUDA check for a lent GPU: capture, replay equality FULL vs eager, step times per mode.

    python benchmarks/cuda_graph_check.py --out $OUT/cuda_graph_check.json     # on the GPU machine

Needs only torch, safetensors and the pdserve source tree (no server packages). It builds the small model with
random weights directly (no tokenizer training: the engine is driven with token ids), then for batch 1, 8, 64:
runs decode steps under FULL (captured graphs), PIECEWISE (captured non-attention segments, attention eager) and
eager (NONE), compares the greedy tokens, and reports the median step time of each mode.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve.config import EngineConfig  # noqa: E402
from pdserve.core.kv_cache_manager import KVCacheManager  # noqa: E402
from pdserve.core.scheduler import Scheduler  # noqa: E402
from pdserve.request import Request  # noqa: E402
from pdserve.sampling_params import SamplingParams  # noqa: E402
from pdserve.worker.model_runner import ModelRunner  # noqa: E402
from cuda_decode_bench import error_text  # noqa: E402  (the script beside this one)

SMALL = dict(vocab_size=8192, hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
             head_dim=64, intermediate_size=3072, rms_norm_eps=1e-6, max_position_embeddings=4096,
             tie_word_embeddings=False, architectures=["Qwen3ForCausalLM"], rope_theta=1e6)


def write_model(d: Path) -> None:
    """Random small Qwen3 weights in the HF layout (config.json + model.safetensors), std as make-model's."""
    from safetensors.torch import save_file
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(SMALL))
    g = torch.Generator().manual_seed(0)
    h, i, hd, L = 768, 3072, 64, 12
    t = {"model.embed_tokens.weight": torch.randn(8192, h, generator=g) * 4 / h ** 0.5,
         "lm_head.weight": torch.randn(8192, h, generator=g) * 4 / h ** 0.5, "model.norm.weight": torch.ones(h)}
    for n in range(L):
        p = f"model.layers.{n}."
        for name, (o, k) in {"self_attn.q_proj": (12 * hd, h), "self_attn.k_proj": (4 * hd, h),
                             "self_attn.v_proj": (4 * hd, h), "self_attn.o_proj": (h, 12 * hd),
                             "mlp.gate_proj": (i, h), "mlp.up_proj": (i, h), "mlp.down_proj": (h, i)}.items():
            t[p + name + ".weight"] = torch.randn(o, k, generator=g) / k ** 0.5
        for name, size in {"input_layernorm": h, "post_attention_layernorm": h, "self_attn.q_norm": hd,
                           "self_attn.k_norm": hd}.items():
            t[p + name + ".weight"] = torch.ones(size)
    save_file({k: v.contiguous() for k, v in t.items()}, str(d / "model.safetensors"))


def run(model: Path, mode: str, batch: int, steps: int, device: str, backend: str = "torch"
        ) -> tuple[list[list[int]], float, dict]:
    kw = {"enforce_eager": True} if mode == "NONE" else {"cudagraph_mode": "PIECEWISE" if mode == "PIECEWISE"
                                                         else "FULL_AND_PIECEWISE"}
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    cfg = EngineConfig.from_kwargs(str(model), device=device, dtype=str(dtype).removeprefix("torch."),
                                   max_model_len=1024, max_num_seqs=64, num_gpu_blocks_override=64 * 64 + 1,
                                   attention_backend=backend, **kw)
    kv = KVCacheManager(cfg.cache.num_gpu_blocks_override, 16, True)
    sched = Scheduler(cfg.scheduler, kv, 1024)
    runner = ModelRunner(cfg, torch.device(device), dtype, 1024, cfg.cache.num_gpu_blocks_override)
    runner.capture_graphs(progress=False)
    reqs = [Request(f"r{b}", [3 + (b * 37 + j) % 8000 for j in range(128)],
                    SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True)) for b in range(batch)]
    for r in reqs:
        sched.add_request(r)
    times = []
    while sched.has_unfinished():
        out = sched.schedule()
        sync(device)
        t0 = time.perf_counter()
        res = runner.execute(out.rows, kv.blocks_of)
        sync(device)
        if all(r.num_scheduled_tokens == 1 for r in out.rows):
            times.append(time.perf_counter() - t0)
        sched.update_from_output(out, res.sampled)
    stats = runner.graph_stats.snapshot()
    return [r.output_token_ids for r in reqs], statistics.median(times) * 1e3, stats


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/cuda_graph_check.json")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--device", default="cuda", help="cuda; cpu only to smoke-test this script")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--attention-backends", default="torch,triton",
                    help="Backends to run, each through every mode (torch first: it ran before the Triton kernel).")
    args = ap.parse_args()
    assert args.device == "cpu" or torch.cuda.is_available(), "needs a CUDA GPU"
    model = Path("/tmp/pdserve-small-cuda")
    write_model(model)
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    result = {"gpu": gpu, "torch": torch.__version__, "runs": []}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    for backend in args.attention_backends.split(","):
        for batch in map(int, args.batches.split(",")):
            eager = None  # NONE runs first: the reference of the other two, None if it failed
            for mode in ("NONE", "PIECEWISE", "FULL"):
                row = {"backend": backend, "batch": batch, "mode": mode}
                try:
                    tokens, ms, stats = run(model, mode, batch, args.steps, args.device, backend)
                    if mode == "NONE":
                        eager = tokens
                    row.update(median_decode_step_ms=ms, graph_steps=stats["steps"], captured=stats["captured"])
                    if mode != "NONE" and eager is not None:
                        row["tokens_equal_eager"] = tokens == eager
                except Exception as e:  # one backend failing (e.g. a kernel that does not compile) ends only its rows
                    row["error"] = error_text(e)
                result["runs"].append(row)
                print(json.dumps(row), flush=True)
                Path(args.out).write_text(json.dumps(result, indent=2) + "\n")  # partial results as it goes


if __name__ == "__main__":
    main()
