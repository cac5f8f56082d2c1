"""The engine's tokenizer: the Rust `tokenizers` object for decoding, transformers' tokenizer only when asked; and
`load_hf_tokenizer`, transformers' tokenizer as AutoTokenizer makes it, without AutoTokenizer's import where it can.

Importing transformers costs each process ~1 s (it scans its model folders) and building its tokenizer ~0.7 s more;
an engine under a server only decodes (the server tokenizes), and decoding already goes to the Rust backend when
transformers' own decode would only wrap it (detokenizer.backend_decoder). So where that holds (a tokenizer.json,
and tokenizer_config.json saying `clean_up_tokenization_spaces: false`), the engine starts with the backend alone and
loads transformers' tokenizer at the first use of anything else (encoding a prompt, bad words, an attribute).
Elsewhere it loads transformers' tokenizer at once, as before.
"""
from __future__ import annotations

import importlib
import json
import logging
import os
import tempfile
import threading
from pathlib import Path

logger = logging.getLogger("pdserve.tokenizer")


class LazyTokenizer:
    def __init__(self, model_dir: str, backend, clean_up_tokenization_spaces: bool):
        self.model_dir = model_dir
        self._tokenizer = backend  # the object transformers' fast tokenizer keeps under the same name
        self.clean_up_tokenization_spaces = clean_up_tokenization_spaces
        self._hf = None
        self._lock = threading.Lock()

    @property
    def hf(self):
        """transformers' tokenizer, loaded once (its own backend then replaces the file's, so both decode alike)."""
        if self._hf is None:
            with self._lock:
                if self._hf is None:
                    hf = load_hf_tokenizer(self.model_dir)
                    self._tokenizer = getattr(hf, "_tokenizer", self._tokenizer)
                    self._hf = hf
        return self._hf

    def __getattr__(self, name: str):  # only what is not set above
        if name.startswith("__") or name in ("_hf", "_lock", "model_dir"):
            raise AttributeError(name)
        return getattr(self.hf, name)

    def __call__(self, *args, **kwargs):
        return self.hf(*args, **kwargs)

    def __len__(self) -> int:
        return len(self.hf)


def load_tokenizer(model_dir: str):
    path = Path(model_dir)
    try:
        cfg = json.loads((path / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        cfg = {}
    lean = isinstance(cfg, dict) and cfg.get("clean_up_tokenization_spaces") is False
    if lean and (path / "tokenizer.json").is_file():
        try:
            from tokenizers import Tokenizer
            return LazyTokenizer(model_dir, Tokenizer.from_file(str(path / "tokenizer.json")), False)
        except Exception:  # a file the Rust library cannot read alone: transformers' way decides
            pass
    return load_hf_tokenizer(model_dir)


# --------------------------------------------------------------------------------------- AutoTokenizer, remembered
# Importing transformers' AutoTokenizer imports torch (its config classes do), ~1.3 s of CPU in every process that
# loads a tokenizer: the server with the engine in its own process, the bench's client, none of which runs torch.
# AutoTokenizer only picks a class (from tokenizer_config.json, config.json's model_type and its own tables) and
# calls its from_pretrained. So the class it picked for a model's files under one transformers version is written
# down, once a direct load of that class was seen to give an equal tokenizer, and later loads of the same files take
# the class directly. Any change to a file (size, mtime), another transformers version, or remote code: AutoTokenizer.
_WEIGHTS = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".onnx")


def _classes_file() -> Path:
    from pdserve.model.make_model import pdserve_home
    return pdserve_home() / "cache" / "tokenizer_classes.json"


def _files_key(model_dir: str) -> str:
    """The model directory and every file in it but the weights (name, size, mtime), and transformers' version."""
    from importlib.metadata import version
    path = Path(model_dir).resolve()
    files = sorted((e.name, e.stat().st_size, e.stat().st_mtime_ns) for e in os.scandir(path)
                   if e.is_file() and not e.name.endswith(_WEIGHTS))
    return json.dumps([str(path), version("transformers"), files])


def _read_classes() -> dict:
    try:
        data = json.loads(_classes_file().read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _fingerprint(tok) -> tuple:
    """What makes two tokenizers of one class the same: the Rust tokenizer whole (vocab, merges, normalizer,
    pre-tokenizer, post-processor, decoder, added tokens) and what transformers keeps beside it."""
    backend = getattr(tok, "backend_tokenizer", None)
    return (type(tok), backend.to_str() if backend is not None else None, repr(sorted(tok.init_kwargs.items())),
            repr(tok.special_tokens_map), getattr(tok, "chat_template", None), len(tok))


def _remember(key: str, tok, model_dir: str) -> None:
    cls = type(tok)
    if not cls.__module__.startswith("transformers."):  # remote code: only AutoTokenizer loads that
        return
    try:
        if _fingerprint(cls.from_pretrained(model_dir, _from_auto=True)) != _fingerprint(tok):
            return
        classes = {**_read_classes(), key: [cls.__module__, cls.__qualname__]}
        out = _classes_file()
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=".tokenizer_classes-")
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(classes, fh)
        os.replace(tmp, out)  # servers starting together: whole files only, the last one written wins
    except Exception as e:  # a cache that cannot be written or read back costs the next start ~1 s, nothing more
        logger.debug("tokenizer class of %s not remembered: %s", model_dir, e)


def load_hf_tokenizer(model_dir: str):
    """transformers' tokenizer for `model_dir`, the one `AutoTokenizer.from_pretrained(model_dir)` gives."""
    try:
        key = _files_key(model_dir)
    except OSError:
        key = None
    entry = _read_classes().get(key) if key is not None else None
    # only transformers' own classes: the file names a module to import, and nothing else is ever written there
    if isinstance(entry, list) and len(entry) == 2 and all(isinstance(x, str) for x in entry) and \
            entry[0].startswith("transformers."):
        try:
            cls = getattr(importlib.import_module(entry[0]), entry[1])
            return cls.from_pretrained(model_dir, _from_auto=True)
        except Exception as e:  # whatever went wrong, AutoTokenizer decides (and raises what it raises)
            logger.debug("remembered tokenizer class %s failed: %s", entry, e)
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir)
    if key is not None:
        _remember(key, tok, model_dir)
    return tok
