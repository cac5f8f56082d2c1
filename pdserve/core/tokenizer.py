"""The engine's tokenizer: the Rust `tokenizers` object for decoding, transformers' tokenizer only when asked.

Importing transformers costs each process ~1 s (it scans its model folders) and building its tokenizer ~0.7 s more;
an engine under a server only decodes (the server tokenizes), and decoding already goes to the Rust backend when
transformers' own decode would only wrap it (detokenizer.backend_decoder). So where that holds (a tokenizer.json,
and tokenizer_config.json saying `clean_up_tokenization_spaces: false`), the engine starts with the backend alone and
loads transformers' tokenizer at the first use of anything else (encoding a prompt, bad words, an attribute).
Elsewhere it loads transformers' tokenizer at once, as before.
"""
from __future__ import annotations

import json
import threading
from pathlib import Path


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
                    from transformers import AutoTokenizer
                    hf = AutoTokenizer.from_pretrained(self.model_dir)
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
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(model_dir)
