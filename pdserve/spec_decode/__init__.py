"""Speculative decoding: vLLM's `--speculative-config` (n-gram method), the prompt-lookup proposer, and exact
verification of its drafts. The engine integration (1 + K rows, lookahead slots, metrics) builds on these."""
from pdserve.spec_decode.config import MAX_SPECULATIVE_TOKENS, SpeculativeConfig
from pdserve.spec_decode.rejection_sampler import PLACEHOLDER_TOKEN_ID, RowDraws, rejection_sample, target_tokens
from pdserve.spec_decode.ngram_proposer import NgramProposer, pad_drafts, propose, propose_batch

__all__ = ["MAX_SPECULATIVE_TOKENS", "SpeculativeConfig", "PLACEHOLDER_TOKEN_ID", "RowDraws", "rejection_sample",
           "target_tokens", "NgramProposer", "pad_drafts", "propose", "propose_batch"]
