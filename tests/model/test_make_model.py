import json
import os

import pytest
import torch
from safetensors import safe_open

from pdserve.model import make_model as mm

PROMPTS = ["def foo(x):", "import os\n", "The quick brown fox", "class A:",
           "héllo 世界", "for i in range(10):", "return None", "# comment"]


@pytest.fixture(scope="session")
def home(tmp_path_factory):
    # One shared home for the whole session so the tokenizer is trained only once.
    mp = pytest.MonkeyPatch()
    h = tmp_path_factory.mktemp("pdserve_home")
    mp.setenv("PDSERVE_HOME", str(h))
    mp.setenv("HF_HUB_OFFLINE", "1")
    yield h
    mp.undo()


@pytest.fixture(scope="session")
def models(home):
    return {arch: mm.ensure_model(arch, "tiny", 0) for arch in mm.ARCHS}


def _load(d):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    return AutoModelForCausalLM.from_pretrained(d).eval(), AutoTokenizer.from_pretrained(d)


def _tensors(path):
    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def test_paths(home, models):
    assert mm.pdserve_home() == home
    assert mm.default_model_dir("llama", "small", 3) == home / "models" / "llama-small-s3"
    assert models["qwen3"] == home / "models" / "qwen3-tiny-s0"
    assert mm.tokenizer_path().is_relative_to(home / "tokenizer")
    # ensure_model on a complete dir must not rebuild
    st = (models["qwen3"] / "model.safetensors").stat().st_mtime_ns
    assert mm.ensure_model("qwen3") == models["qwen3"]
    assert (models["qwen3"] / "model.safetensors").stat().st_mtime_ns == st
    # the atomic build leaves no temp dirs behind
    assert sorted(p.name for p in (home / "models").iterdir()) == ["llama-tiny-s0", "qwen3-tiny-s0"]


@pytest.mark.parametrize("arch", mm.ARCHS)
def test_load_and_config(models, arch):
    d = models[arch]
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
              "generation_config.json"):
        assert (d / f).exists(), f
    model, tok = _load(d)
    n = sum(p.numel() for p in model.parameters())
    assert 4.0e6 < n < 5.0e6, n
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["architectures"] == [{"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}[arch]]
    assert cfg["vocab_size"] == 8192 and cfg["tie_word_embeddings"] is True
    rope = cfg["rope_parameters"]
    assert rope["rope_theta"] == 10000.0
    if arch == "llama":
        assert rope["rope_type"] == "llama3" and rope["factor"] == 8.0
        assert rope["original_max_position_embeddings"] == 1024
    gen = json.loads((d / "generation_config.json").read_text())
    assert not {"do_sample", "temperature", "top_p", "top_k"} & set(gen)
    eos = {"qwen3": "<|im_end|>", "llama": "<|endoftext|>"}[arch]
    assert gen["eos_token_id"] == cfg["eos_token_id"] == tok.convert_tokens_to_ids(eos) == tok.eos_token_id
    # tied layout: no separate lm_head tensor on disk
    names = set(_tensors(d / "model.safetensors"))
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names


@pytest.mark.parametrize("size,lo,hi", [("tiny", 4.0e6, 5.0e6), ("small", 100e6, 120e6)])
@pytest.mark.parametrize("arch", mm.ARCHS)
def test_param_counts(arch, size, lo, hi):
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(mm._config(arch, size, "float32"))
    assert lo < sum(p.numel() for p in model.parameters()) < hi
    assert model.config.tie_word_embeddings is (size == "tiny")


@pytest.mark.parametrize("arch", mm.ARCHS)
def test_tokenizer(models, arch):
    _, tok = _load(models[arch])
    assert tok.is_fast
    assert len(tok) == 8192
    assert tok("hello", add_special_tokens=True).input_ids == tok.encode("hello", add_special_tokens=False)
    assert tok.bos_token_id not in tok("hello").input_ids
    for text in ("héllo 世界 🙂", "def f(x):\n    return x  # ok\n", "  leading spaces"):
        assert tok.decode(tok(text).input_ids) == text
    for i, t in enumerate(mm.SPECIALS):
        assert tok(t).input_ids == [i]


@pytest.mark.parametrize("arch", mm.ARCHS)
def test_chat_template(models, arch):
    _, tok = _load(models[arch])
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi 🙂"}]
    body = "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi 🙂<|im_end|>\n"
    assert tok.apply_chat_template(msgs, tokenize=False) == body
    assert tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == \
        body + "<|im_start|>assistant\n"


@pytest.mark.parametrize("arch", mm.ARCHS)
def test_logits_are_decisive(models, arch):
    # Greedy must not hinge on near-ties (engines differ in fp rounding) and should vary.
    model, tok = _load(models[arch])
    ties = steps = 0
    stds, distinct = [], []
    for p in PROMPTS:
        ids = tok(p, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=32, min_new_tokens=32, do_sample=False,
                                 output_logits=True, return_dict_in_generate=True)
        for logits in out.logits:
            top2 = logits[0].topk(2).values
            ties += bool(top2[0] - top2[1] < 1e-4)
            steps += 1
            stds.append(logits[0].std().item())
        distinct.append(len(set(out.sequences[0, ids.shape[1]:].tolist())))
    assert ties / steps < 0.01
    assert 2.0 < sum(stds) / len(stds) < 6.0
    assert sorted(distinct)[len(distinct) // 2] >= 8, distinct


def test_determinism(models, tmp_path):
    same = mm.make_model(tmp_path / "same", "qwen3", "tiny", 0, progress=False)
    assert (same / "model.safetensors").read_bytes() == (models["qwen3"] / "model.safetensors").read_bytes()
    other = _tensors(mm.make_model(tmp_path / "other", "qwen3", "tiny", 1, progress=False) / "model.safetensors")
    base = _tensors(same / "model.safetensors")
    assert all(not torch.equal(base[k], other[k]) for k in base)
    # rebuilding over an existing dir replaces it
    mm.make_model(same, "qwen3", "tiny", 1, progress=False)
    assert torch.equal(_tensors(same / "model.safetensors")["model.norm.weight"], other["model.norm.weight"])


def test_sharded_and_bf16(models, tmp_path):
    from transformers import AutoModelForCausalLM
    d = mm.make_model(tmp_path / "sharded", "llama", "tiny", 0, progress=False, max_shard_size="5MB")
    index = json.loads((d / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert not (d / "model.safetensors").exists()
    ids = torch.tensor([[5, 100, 2000, 7]])
    with torch.no_grad():
        a = AutoModelForCausalLM.from_pretrained(d)(ids).logits
        b = AutoModelForCausalLM.from_pretrained(models["llama"])(ids).logits
    assert torch.equal(a, b)
    d = mm.make_model(tmp_path / "bf16", "qwen3", "tiny", 0, progress=False, dtype="bfloat16")
    assert json.loads((d / "config.json").read_text())["dtype"] == "bfloat16"
    assert _tensors(d / "model.safetensors")["model.norm.weight"].dtype == torch.bfloat16


def test_bad_args(home, tmp_path):
    with pytest.raises(ValueError, match=r"arch.*qwen3.*llama"):
        mm.make_model(tmp_path / "x", arch="gpt2")
    with pytest.raises(ValueError, match=r"size.*tiny.*small"):
        mm.ensure_model(size="huge")
    with pytest.raises(ValueError, match="dtype"):
        mm.make_model(tmp_path / "x", dtype="int8")
    assert not (tmp_path / "x").exists()


def test_never_replaces_what_it_did_not_build(home, tmp_path, capsys):
    """A rebuild replaces --out whole: a non-empty directory without make-model's marker (`.`, a home, a
    downloaded model) or a file is refused before anything is built, and left as it was (it was deleted)."""
    from pdserve.cli import main
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "data.txt").write_text("precious")
    (tmp_path / "file").write_text("precious")
    for out, why in ((tmp_path / "mine", "is not empty and has no .pdserve-make-model"),
                     (tmp_path / "file", "is not a directory")):
        with pytest.raises(ValueError, match=why):
            mm.make_model(out, progress=False)
        with pytest.raises(SystemExit) as e:
            main(["make-model", "--out", str(out)])
        assert e.value.code == 2 and "--out" in capsys.readouterr().err
    assert (tmp_path / "mine" / "data.txt").read_text() == "precious" and (tmp_path / "file").read_text() == "precious"
    assert sorted(os.listdir(tmp_path)) == ["file", "mine"]  # no temp dir left behind either
    with pytest.raises(SystemExit) as e:
        main(["make-model", "--out", ""])
    assert e.value.code == 2 and "--out: empty path" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert mm.is_complete(mm.make_model(tmp_path / "empty", progress=False))


def test_crash_leaves_nothing(home, tmp_path, monkeypatch):
    def boom(*a):
        raise RuntimeError("boom")
    monkeypatch.setattr(mm, "_init_weights", boom)
    with pytest.raises(RuntimeError):
        mm.make_model(tmp_path / "m", progress=False)
    assert os.listdir(tmp_path) == []


def test_progress_to_stderr(home, tmp_path, capsys):
    mm.make_model(tmp_path / "m", progress=True)
    cap = capsys.readouterr()
    assert "writing weights" in cap.err and cap.out == ""
