"""A Hugging Face model directory's config.json, checked and read into the decoder's dimensions: no torch here, so
the API server (whose engine runs in another process) reads and checks the model without importing torch."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ArchSpec:
    """What an architecture name means for the shared decoder."""
    qk_norm: bool


ARCHITECTURES: dict[str, ArchSpec] = {
    "Qwen3ForCausalLM": ArchSpec(qk_norm=True),
    "LlamaForCausalLM": ArchSpec(qk_norm=False),
}


@dataclass(frozen=True)
class ModelDims:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    max_positions: int
    attention_bias: bool
    mlp_bias: bool
    tie_word_embeddings: bool
    rope: dict


def read_hf_config(model_dir: str | Path) -> dict:
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ValueError(f"model directory {str(model_dir)!r} does not exist")
    path = model_dir / "config.json"
    if not path.is_file():
        raise ValueError(f"{str(model_dir)!r} has no config.json: not a Hugging Face model directory")
    cfg = read_json_file(path)
    arch = (cfg.get("architectures") or ["<none>"])[0]
    if arch not in ARCHITECTURES:
        raise ValueError(f"unsupported architecture {arch!r} in {path}; supported: {', '.join(ARCHITECTURES)}")
    for key in SIZES:
        v = cfg.get(key)
        if v is None and key == "max_position_embeddings":  # optional: the engine assumes 4096
            continue
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{path}: {key} must be a positive integer, got {v!r}")
    return cfg


SIZES = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
         "max_position_embeddings")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def check_model_dir(model_dir: str | Path) -> dict:
    """The model's config.json, once the directory is known to hold a model this engine runs and a tokenizer:
    checked before anything is loaded or a port opened, so a wrong path is one line naming it."""
    cfg = read_hf_config(model_dir)
    if not any((Path(model_dir) / f).is_file() for f in TOKENIZER_FILES):
        raise ValueError(f"{str(model_dir)!r} has no tokenizer (none of {', '.join(TOKENIZER_FILES)})")
    return cfg


def read_json_file(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: must hold a JSON object")
    return data


def rope_parameters(cfg: dict) -> dict:
    """Both spellings: transformers >= 5 writes `rope_parameters`, older files `rope_theta` + `rope_scaling`."""
    rope = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling") or {}
    rope = {**scaling, **rope}
    rope.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    rope.setdefault("rope_type", rope.get("type", "default"))
    return rope


def model_dims(cfg: dict, max_positions: int) -> ModelDims:
    heads = cfg["num_attention_heads"]
    return ModelDims(
        vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"], num_layers=cfg["num_hidden_layers"],
        num_heads=heads, num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads, intermediate_size=cfg["intermediate_size"],
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6), max_positions=max_positions,
        attention_bias=bool(cfg.get("attention_bias", False)), mlp_bias=bool(cfg.get("mlp_bias", False)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)), rope=rope_parameters(cfg))
