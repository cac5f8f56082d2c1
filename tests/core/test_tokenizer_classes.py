"""`load_hf_tokenizer`: the tokenizer AutoTokenizer gives, loaded by the class AutoTokenizer picked once a direct
load of it was seen equal, so a server or bench process after the first needs neither AutoTokenizer nor torch."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from pdserve.core import tokenizer as tk


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def model_copy(tmp_path, src: str):
    dst = tmp_path / "model"
    shutil.copytree(src, dst)
    return str(dst)


def same_as_auto(tok, model_dir: str) -> None:
    from transformers import AutoTokenizer
    auto = AutoTokenizer.from_pretrained(model_dir)
    assert tk._fingerprint(tok) == tk._fingerprint(auto)
    text = "def f(x):\n    return x  # é ü 😀 <|im_end|>"
    assert tok(text).input_ids == auto(text).input_ids
    assert tok.decode(auto(text).input_ids) == auto.decode(auto(text).input_ids)
    msgs = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == \
        auto.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_first_load_remembers_and_the_second_takes_the_class_without_torch(tiny_models, tmp_path, home, arch):
    model_dir = model_copy(tmp_path, tiny_models[arch])
    first = tk.load_hf_tokenizer(model_dir)
    same_as_auto(first, model_dir)
    classes = json.loads((home / "cache" / "tokenizer_classes.json").read_text())
    assert list(classes.values()) == [[type(first).__module__, type(first).__qualname__]]
    probe = ("import sys; from pdserve.core.tokenizer import load_hf_tokenizer; "
             f"t = load_hf_tokenizer({model_dir!r}); print(type(t).__name__, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                         env={**os.environ, "PDSERVE_HOME": str(home)}).stdout.split()
    assert out == [type(first).__name__, "False"], out
    same_as_auto(tk.load_hf_tokenizer(model_dir), model_dir)


def test_a_changed_file_goes_through_autotokenizer_again(tiny_models, tmp_path, home, monkeypatch):
    model_dir = model_copy(tmp_path, tiny_models["qwen3"])
    tk.load_hf_tokenizer(model_dir)
    cfg_path = tmp_path / "model" / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    cfg_path.write_text(json.dumps(cfg))
    called = []
    import transformers
    real = transformers.AutoTokenizer.from_pretrained
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained",
                        lambda *a, **k: called.append(a) or real(*a, **k))
    tok = tk.load_hf_tokenizer(model_dir)
    assert called and tok.chat_template == cfg["chat_template"]
    assert len(json.loads((home / "cache" / "tokenizer_classes.json").read_text())) == 2  # both versions' keys
    called.clear()
    tk.load_hf_tokenizer(model_dir)
    assert not called  # the new files' class is remembered too


def test_a_bad_entry_or_an_unequal_direct_load_falls_back_and_remembers_nothing(tiny_models, tmp_path, home,
                                                                                 monkeypatch):
    model_dir = model_copy(tmp_path, tiny_models["qwen3"])
    key = tk._files_key(model_dir)
    out = home / "cache" / "tokenizer_classes.json"
    out.parent.mkdir(parents=True)
    out.write_text(json.dumps({key: ["transformers.no_such_module", "Nope"]}))
    same_as_auto(tk.load_hf_tokenizer(model_dir), model_dir)  # AutoTokenizer, then the right class written over
    assert json.loads(out.read_text())[key][1] != "Nope"
    imported, real = [], tk.importlib.import_module
    monkeypatch.setattr(tk.importlib, "import_module", lambda name, *a: imported.append(name) or real(name, *a))
    out.write_text(json.dumps({key: ["json", "JSONDecoder"]}))  # a module outside transformers is never imported
    same_as_auto(tk.load_hf_tokenizer(model_dir), model_dir)
    assert "json" not in imported
    monkeypatch.undo()
    monkeypatch.setenv("PDSERVE_HOME", str(home))
    out.unlink()
    prints = iter(range(10))
    monkeypatch.setattr(tk, "_fingerprint", lambda tok: next(prints))  # the direct load never equals AutoTokenizer's
    tk.load_hf_tokenizer(model_dir)
    assert not out.exists()
    out.write_text("not json")  # a torn or foreign file: AutoTokenizer, and the file is not trusted
    monkeypatch.undo()
    monkeypatch.setenv("PDSERVE_HOME", str(home))
    same_as_auto(tk.load_hf_tokenizer(model_dir), model_dir)


def test_a_missing_directory_says_what_autotokenizer_says(home, tmp_path):
    with pytest.raises(OSError):
        tk.load_hf_tokenizer(str(tmp_path / "nowhere"))
