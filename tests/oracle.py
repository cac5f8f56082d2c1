"""The correctness oracle: Hugging Face `transformers` greedy generation on the same weights, one prompt at a time.

float64: tokens must be identical. float32: tokens identical up to a first divergence, allowed only where the
reference's top-2 logit gap is below 1e-4, and logits before it within 1e-4 x max(1, max |logit|). bfloat16 (8
mantissa bits, so one rounding step of a logit near 20 is 0.125): the same with BF16_NEAR_TIE and BF16_LOGIT_RTOL.
"""
from __future__ import annotations

import functools
import sysconfig
from pathlib import Path

import torch

NEAR_TIE = 1e-4
LOGIT_RTOL = 1e-4
BF16_NEAR_TIE = 0.25  # two rounding steps of a logit in [16, 32)
BF16_LOGIT_RTOL = 0.03  # the tiny models' logits differ from transformers' by up to 1.7% of max |logit| in bf16


def corpus_text() -> str:
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("[a-h]*.py"))
    return "\n".join(f.read_text(encoding="utf-8", errors="replace") for f in files[:6])


def make_prompts(tokenizer, lengths: list[int], seed: int = 0) -> list[list[int]]:
    """Token-id prompts of exactly these lengths, cut from different places of stdlib source text."""
    ids = tokenizer(corpus_text()).input_ids
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        start = int(torch.randint(0, len(ids) - n, (1,), generator=g))
        out.append(ids[start:start + n])
    return out


@functools.lru_cache(maxsize=None)
def _hf_model(model_dir: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa").eval()


def hf_greedy(model_dir: str, dtype: torch.dtype, prompt: list[int], max_new_tokens: int):
    """(tokens, logits [steps, vocab] float64) from transformers' generate, EOS ignored."""
    model = _hf_model(model_dir, dtype)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new_tokens,
                             min_new_tokens=max_new_tokens, output_logits=True, return_dict_in_generate=True,
                             pad_token_id=0)
    tokens = out.sequences[0, len(prompt):].tolist()
    logits = torch.stack([step[0] for step in out.logits]).double()
    return tokens, logits


def compare(ours: list[int], our_logits: torch.Tensor | None, ref: list[int], ref_logits: torch.Tensor,
            exact: bool, near_tie: float = NEAR_TIE, logit_rtol: float = LOGIT_RTOL) -> str:
    """'same' or 'near-tie-divergence'; raises AssertionError on any other difference."""
    assert len(ours) == len(ref), f"length {len(ours)} != reference {len(ref)}"
    for step, (a, b) in enumerate(zip(ours, ref)):
        if our_logits is not None:
            tol = logit_rtol * max(1.0, ref_logits[step].abs().max().item())
            diff = (our_logits[step] - ref_logits[step]).abs().max().item()
            assert diff <= tol, f"step {step}: logits differ by {diff:.3g} > {tol:.3g}"
        if a != b:
            top2 = ref_logits[step].topk(2).values
            gap = (top2[0] - top2[1]).item()
            assert not exact, f"step {step}: token {a} != reference {b} (top-2 gap {gap:.3g})"
            assert gap < near_tie, f"step {step}: token {a} != reference {b} and the top-2 gap {gap:.3g} is no tie"
            return "near-tie-divergence"
    return "same"
