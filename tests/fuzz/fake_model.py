"""A deterministic stand-in for the transformer whose output depends on exactly what it reads back through the block
table, and the model directory the fuzzer's engines load it from.

Its "KV" is one layer, one head, one channel: K = token id + 1 and V = position + 1 (0: never written). Every step it
writes each token into its slot, then each query at position p reads the context j = 0..p back through its group's
block table and emits next = finish(sum_j (token_j + 1) * weight(j)). A wrong block, slot, position or table width
changes what it reads, so the greedy output differs from the same function of prompt + outputs, which the oracle
(expect.py) computes in pure Python. A context whose stored positions do not match (a stale or foreign slot) poisons
the token outright. The sum makes every query of a group one cumsum.
"""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

VOCAB = 64  # ids 0..2 are the tokenizer's special tokens (2 = EOS), 3..63 single ASCII chars: text is exact
EOS = 2
MOD = 2**31 - 1
LOGIT = 4.0  # the hash token's logit (others 0): greedy takes it, temperature sampling often does not
MAX_POS = 4096


def weight(j: int) -> int:
    return (j * 2654435761 + 97) % MOD + 1


def finish(h: int) -> int:
    return (h % MOD) * 48271 % MOD % VOCAB


@dataclass(frozen=True)
class FakeDims:
    num_layers: int = 1
    num_kv_heads: int = 1
    head_dim: int = 1
    hidden_size: int = 1
    vocab_size: int = VOCAB


class FakeModel:
    def __init__(self):
        self.dims = FakeDims()
        self.kv_caches: list[torch.Tensor] = []  # set by ModelRunner
        j = torch.arange(MAX_POS + 64, dtype=torch.int64)
        self.weights = (j * 2654435761 + 97) % MOD + 1  # weight(j), for every context index at once

    def pack_for_cpu(self) -> None:
        pass

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
        cache = self.kv_caches[0]
        k, v = cache[0].view(-1), cache[1].view(-1)
        k.index_copy_(0, meta.slot_mapping, (input_ids + 1).to(k.dtype))
        v.index_copy_(0, meta.slot_mapping, (positions + 1).to(v.dtype))
        out = torch.zeros(input_ids.shape[0], 1, dtype=cache.dtype)
        bs = cache.shape[2]
        for g in meta.groups:
            rows, width = g.block_table.shape
            ctx = width * bs
            slots = (g.block_table[:, :, None] * bs + torch.arange(bs)).view(rows, ctx)
            tok, pos = k[slots].long() - 1, v[slots].long() - 1
            idx = torch.arange(ctx)
            h = ((tok + 1) * self.weights[:ctx]).cumsum(1)
            bad = (pos != idx).cumsum(1)
            p = g.positions
            pc = p.clamp(0, ctx - 1)
            nxt = (h.gather(1, pc) % MOD) * 48271 % MOD % VOCAB
            poisoned = (bad.gather(1, pc) > 0) | (p >= ctx) | (p < 0)
            nxt = torch.where(poisoned, (nxt + 1) % VOCAB, nxt)
            out[g.tokens, 0] = nxt.reshape(-1).to(out.dtype)
        return out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = torch.zeros(hidden.shape[0], VOCAB, dtype=torch.float32)
        logits[torch.arange(hidden.shape[0]), hidden[:, 0].long()] = LOGIT
        return logits


def fake_load_model(model_dir, dtype, device, max_positions):
    return FakeModel()


def make_model_dir(src: str, dst: Path) -> Path:
    """The tiny model's tokenizer and generation config, with a config.json the engine reads for the fake: VOCAB ids
    (the rest of the tokenizer is never sampled) and 4096 positions (the tiny model has 2048)."""
    dst.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        if (Path(src) / name).is_file():
            shutil.copy(Path(src) / name, dst / name)
    cfg = json.loads((Path(src) / "config.json").read_text())
    cfg.update(vocab_size=VOCAB, max_position_embeddings=MAX_POS)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst
