"""Load a Hugging Face checkpoint directory (config.json + single or sharded safetensors) into CausalLM."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import torch

from pdserve.model.hf_config import ARCHITECTURES, ModelDims, model_dims, read_hf_config
from pdserve.model.transformer import CausalLM

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, cfg: dict, device: torch.device) -> torch.dtype:
    if name != "auto":
        return DTYPES[name]
    ckpt = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
    dtype = DTYPES.get(ckpt, torch.float32)
    return torch.float32 if device.type == "cpu" and dtype == torch.float16 else dtype


def iter_safetensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (model_dir / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise ValueError(f"{str(model_dir)!r} has no model.safetensors or model.safetensors.index.json")
    for name in files:
        try:
            f = safe_open(model_dir / name, framework="pt")
        except Exception as e:  # safetensors' own error names no file
            raise ValueError(f"{model_dir / name}: cannot read the weights: {e}") from None
        with f:
            for key in f.keys():
                yield key, f.get_tensor(key)


def load_model(model_dir: str | Path, dtype: torch.dtype, device: torch.device, max_positions: int) -> CausalLM:
    model_dir = Path(model_dir)
    cfg = read_hf_config(model_dir)
    dims = model_dims(cfg, max_positions)
    with torch.device(device):
        model = CausalLM(dims, ARCHITECTURES[cfg["architectures"][0]], dtype)
    params = dict(model.named_parameters())
    # HF name -> (our parameter, row offset within the fused weight)
    fused = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
             "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
             "q_norm": ("qk_norm", 0), "k_norm": ("qk_norm", 1)}  # a [head_dim] norm weight fills its heads' rows
    loaded = set()
    for key, tensor in iter_safetensors(model_dir):
        name = key.removeprefix("model.")
        if "rotary_emb" in name:
            continue
        parts = name.split(".")
        if len(parts) >= 4 and parts[0] == "layers":
            parts = [p for p in parts if p not in ("self_attn", "mlp")]
            name = ".".join(parts)
            if parts[2] in fused:
                target, shard = fused[parts[2]]
                name = ".".join([parts[0], parts[1], target, parts[3]])
                dst = params[name]
                sizes = _fused_sizes(dims, target)
                start = sum(sizes[:shard])
                dst.data[start:start + sizes[shard]].copy_(tensor)
                loaded.add((name, shard))
                continue
        if name not in params:
            raise ValueError(f"unexpected tensor {key!r} in checkpoint {model_dir}")
        params[name].data.copy_(tensor)
        loaded.add((name, 0))
    if dims.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
        loaded.add(("lm_head.weight", 0))
    missing = [name for name in params for s in range(_NUM_SHARDS.get(name.split(".")[-2], 1))
               if (name, s) not in loaded]
    if missing:
        raise ValueError(f"checkpoint {model_dir} lacks tensors: {', '.join(sorted(set(missing))[:8])}")
    return model.eval()


_NUM_SHARDS = {"qkv_proj": 3, "gate_up_proj": 2, "qk_norm": 2}


def _fused_sizes(d: ModelDims, target: str) -> list[int]:
    if target == "qkv_proj":
        return [d.num_heads * d.head_dim, d.num_kv_heads * d.head_dim, d.num_kv_heads * d.head_dim]
    if target == "qk_norm":
        return [d.num_heads, d.num_kv_heads]
    return [d.intermediate_size, d.intermediate_size]
