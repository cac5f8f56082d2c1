"""Build small random-weight models in the Hugging Face layout, fully offline.

The serving engine needs real checkpoints to test against but cannot reach a model
hub, so we synthesize them: a byte-level BPE tokenizer trained on Python's own stdlib
sources (present on every machine) plus deterministic random weights, saved with
transformers itself so the files are exactly what `from_pretrained` expects.

Special token ids are fixed: 0 `<|endoftext|>`, 1 `<|im_start|>`, 2 `<|im_end|>`.
bos is `<|endoftext|>` for both archs but is never added automatically; eos is
`<|im_end|>` for qwen3 (chat-style) and `<|endoftext|>` for llama; pad is `<|endoftext|>`.
"""
from __future__ import annotations

import hashlib
import json
import os
import pathlib
import shutil
import sys
import sysconfig
import tempfile
import time
import zlib

ARCHS = ("qwen3", "llama")
SIZES = ("tiny", "small")
DTYPES = ("float32", "bfloat16", "float16")
VOCAB = 8192
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TOKENIZER_TEXT_CAP = 4_000_000
_TOKENIZER_VERSION = 1  # bump when training settings change so stale caches are ignored
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
_SIZES = {
    "tiny": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=64, intermediate_size=512, tie_word_embeddings=True, max_position_embeddings=2048),
    "small": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
                  head_dim=64, intermediate_size=3072, tie_word_embeddings=False, max_position_embeddings=4096),
}
_LOGIT_STD = 4.0  # target spread of next-token logits: big enough that greedy rarely ties
_QK_GAIN, _MLP_GAIN = 1.5, 2.0  # see _init_weights


def _log(progress: bool, msg: str) -> None:
    if progress:
        print(f"[make-model] {msg}", file=sys.stderr, flush=True)


MARKER = ".pdserve-make-model"  # in every model make-model writes: what a rebuild may replace


def _check(name: str, value: str, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")


def pdserve_home() -> pathlib.Path:
    return pathlib.Path(os.environ.get("PDSERVE_HOME") or pathlib.Path.home() / ".cache" / "pdserve")


def default_model_dir(arch: str = "qwen3", size: str = "tiny", seed: int = 0) -> pathlib.Path:
    return pdserve_home() / "models" / f"{arch}-{size}-s{seed}"


def _training_text():
    # Sorted paths + a byte cap keep the corpus identical across runs on one Python build.
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = sorted((p for p in root.rglob("*.py")
                    if not {"site-packages", "dist-packages"} & set(p.relative_to(root).parts)),
                   key=lambda p: p.relative_to(root).as_posix())
    total = 0
    for f in files:
        try:
            text = f.read_bytes().decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue  # a few stdlib test files are deliberately non-UTF-8
        yield text
        total += len(text)
        if total >= TOKENIZER_TEXT_CAP:
            return


def tokenizer_path(progress: bool = False) -> pathlib.Path:
    """Train (once per Python version) and cache the shared tokenizer.json."""
    key = hashlib.sha256(f"{sys.version}|{TOKENIZER_TEXT_CAP}|{VOCAB}|{_TOKENIZER_VERSION}".encode()).hexdigest()[:16]
    path = pdserve_home() / "tokenizer" / key / "tokenizer.json"
    if path.exists():
        return path
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    _log(progress, "training tokenizer...")
    t0 = time.time()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # The full 256-byte alphabet guarantees any UTF-8 input (emoji, CJK) round-trips.
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=list(SPECIALS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_training_text(), trainer=trainer)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".tokenizer.{os.getpid()}.tmp")  # parallel builders never see half a file
    tok.save(str(tmp))
    os.replace(tmp, path)
    _log(progress, f"tokenizer trained in {time.time() - t0:.1f}s")
    return path


def _config(arch: str, size: str, dtype: str):
    import transformers

    ids = {t: i for i, t in enumerate(SPECIALS)}
    kw = dict(_SIZES[size], vocab_size=VOCAB, rms_norm_eps=1e-6, dtype=dtype, bos_token_id=ids["<|endoftext|>"],
              pad_token_id=ids["<|endoftext|>"])
    if arch == "qwen3":
        rope = {"rope_type": "default", "rope_theta": 10000.0 if size == "tiny" else 1e6}
        return transformers.Qwen3Config(**kw, rope_parameters=rope, eos_token_id=ids["<|im_end|>"],
                                        architectures=["Qwen3ForCausalLM"])
    rope = {"rope_type": "llama3", "rope_theta": 10000.0 if size == "tiny" else 500000.0, "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 1024}
    return transformers.LlamaConfig(**kw, rope_parameters=rope, eos_token_id=ids["<|endoftext|>"],
                                    architectures=["LlamaForCausalLM"])


def _init_weights(model, seed: int) -> None:
    import torch

    hidden = model.config.hidden_size
    g = torch.Generator()
    with torch.no_grad():
        for name, p in model.named_parameters():
            # Seed per tensor name so a tensor's values don't depend on module iteration order
            # (a side effect: llama and qwen3 of one seed share every same-named tensor).
            g.manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            r = torch.randn(p.shape, generator=g, dtype=torch.float32)
            # Plain 1/sqrt(fan_in) init gives near-uniform attention that averages the context
            # into a fixed point, so greedy decoding repeats one token forever. Sharper q.k
            # (gain on q/k projections, or on qwen3's q/k norms which undo the projection scale)
            # and a stronger MLP make each step depend on recent tokens: varied greedy output,
            # and an engine whose attention or KV cache is wrong diverges visibly.
            qk = _QK_GAIN if any(k in name for k in ("q_proj", "k_proj", "q_norm", "k_norm")) else 1.0
            if name.endswith("norm.weight"):
                # Jitter (not all-ones) so a loader that drops norm weights produces wrong logits.
                p.copy_(qk * (1.0 + 0.1 * r))
            elif "embed_tokens" in name or name.startswith("lm_head"):
                # Normalized hidden states have rms ~1, so this sets logit std ~_LOGIT_STD
                # (tied or not); 0.02-style init would make every greedy step a near-tie.
                p.copy_(r * (_LOGIT_STD / hidden ** 0.5))
            else:
                gain = qk * (_MLP_GAIN if "down_proj" in name else 1.0)
                p.copy_(r * (gain / p.shape[1] ** 0.5))


def make_model(out: str | os.PathLike, arch: str = "qwen3", size: str = "tiny", seed: int = 0, *,
               progress: bool = True, dtype: str = "float32", max_shard_size: str | None = None) -> pathlib.Path:
    _check("arch", arch, ARCHS)
    _check("size", size, SIZES)
    _check("dtype", dtype, DTYPES)
    import torch
    import transformers
    from transformers.utils import logging as hf_logging

    out = pathlib.Path(out).absolute()
    _check_replaceable(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tok_src = tokenizer_path(progress)
    cfg = _config(arch, size, dtype)
    # Build in a sibling temp dir and rename at the end: a crash never leaves a half model at `out`.
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        _log(progress, f"building {arch}-{size} seed={seed}...")
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        _init_weights(model, seed)
        model.to(getattr(torch, dtype))
        # Only ids in the generation config, so greedy decoding stays the default.
        model.generation_config = transformers.GenerationConfig(
            bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id, pad_token_id=cfg.pad_token_id)
        _log(progress, "writing weights...")
        kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
        bars = hf_logging.is_progress_bar_enabled()
        if not progress:
            hf_logging.disable_progress_bar()  # transformers draws its own shard-writing bar
        try:
            model.save_pretrained(tmp, **kw)
        finally:
            if bars:
                hf_logging.enable_progress_bar()
        shutil.copyfile(tok_src, tmp / "tokenizer.json")
        names = {"bos_token": SPECIALS[0], "eos_token": SPECIALS[cfg.eos_token_id], "pad_token": SPECIALS[0]}
        tok_cfg = dict(names, tokenizer_class="PreTrainedTokenizerFast", add_bos_token=False,
                       add_eos_token=False, clean_up_tokenization_spaces=False,
                       model_max_length=cfg.max_position_embeddings, chat_template=CHAT_TEMPLATE,
                       additional_special_tokens=list(SPECIALS[1:]))
        (tmp / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
        (tmp / "special_tokens_map.json").write_text(json.dumps(names, indent=2) + "\n")
        (tmp / MARKER).write_text(json.dumps({"arch": arch, "size": size, "seed": seed, "dtype": dtype}) + "\n")
        tmp.chmod(0o755)  # mkdtemp makes it owner-only
        old = out.with_name(f".{out.name}.old.{os.getpid()}")
        if out.exists():
            out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _log(progress, f"wrote {out}")
    return out


def _check_replaceable(out: pathlib.Path) -> None:
    """A rebuild replaces `out` whole, so only what make-model built (its marker) or an empty directory may be
    there: a path given by mistake (`.`, a home directory, a downloaded model) is never deleted."""
    if not out.exists() and not out.is_symlink():
        return
    if not out.is_dir() or out.is_symlink():
        raise ValueError(f"{out} exists and is not a directory (--out): choose a new or empty directory")
    if any(out.iterdir()) and not (out / MARKER).is_file():
        raise ValueError(f"{out} is not empty and has no {MARKER} (--out): choose a new or empty directory, or "
                         "delete it yourself if it is a make-model build from before the marker; nothing was changed")


def is_complete(d: pathlib.Path) -> bool:
    return all((d / f).exists() for f in ("config.json", "model.safetensors", "tokenizer.json"))


def ensure_model(arch: str = "qwen3", size: str = "tiny", seed: int = 0) -> pathlib.Path:
    d = default_model_dir(arch, size, seed)
    if not is_complete(d):
        try:
            make_model(d, arch, size, seed)
        except OSError:
            if not is_complete(d):  # tolerate a concurrent builder that renamed in first
                raise
    return d
