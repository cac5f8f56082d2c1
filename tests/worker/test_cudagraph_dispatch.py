"""The full-graph rule (pure classification) and the dispatcher's padding and mode choice."""
from __future__ import annotations

import pytest

from pdserve.config import CompilationConfig
from pdserve.worker.cudagraph_dispatch import BatchDescriptor, Classification, CUDAGraphMode, CudagraphDispatcher, \
    classify

DECODE = (1, 140, 100)  # (num_scheduled, num_computed, prompt_len): past its prompt
REPLAY = (1, 128, 129)  # last prompt token over 128 imported tokens
FRESH_ONE = (1, 0, 1)  # a fresh one-token prompt
PREFILL = (64, 0, 300)  # a multi-token prompt chunk


def cls(rows, rule, consumer=True, q=1):
    n, c, p = zip(*rows)
    return classify(n, c, p, q, rule, consumer)


@pytest.mark.parametrize("rule", ["strict", "prompt-tail", "decode-shaped"])
def test_decode_only_batch_is_full_under_every_rule(rule):
    assert cls([DECODE] * 8, rule) == Classification(True, 1, None)


@pytest.mark.parametrize("rule,consumer,full", [
    ("strict", True, False), ("prompt-tail", True, True), ("decode-shaped", True, True),
    ("strict", False, False), ("prompt-tail", False, False), ("decode-shaped", False, True)])
def test_replay_among_decodes(rule, consumer, full):
    c = cls([DECODE, DECODE, REPLAY], rule, consumer)
    assert c.full_eligible is full
    assert c.reason == (None if full else "prefill")


@pytest.mark.parametrize("rule", ["strict", "prompt-tail", "decode-shaped"])
@pytest.mark.parametrize("consumer", [True, False])
def test_fresh_one_token_prompt_never_full(rule, consumer):
    c = cls([DECODE, FRESH_ONE], rule, consumer)
    assert not c.full_eligible and c.reason == "prefill"
    assert not cls([FRESH_ONE], rule, consumer).full_eligible


@pytest.mark.parametrize("rule", ["strict", "prompt-tail", "decode-shaped"])
def test_multi_token_prefill_is_not_full(rule):
    c = cls([DECODE, PREFILL], rule)
    assert not c.full_eligible and c.reason == "prefill" and c.uniform_query_len is None
    # a chunk with prior context (a later chunk of a long prompt) is still a prefill
    assert cls([DECODE, (64, 64, 300)], rule).reason == "prefill"


def test_q3_replay_padded_to_three_tokens():
    spec_decode = (3, 140, 100)
    replay3 = (3, 128, 129)  # last prompt token + 2 padded slots, over prior context
    assert cls([spec_decode, replay3], "decode-shaped", q=3) == Classification(True, 3, None)
    assert cls([spec_decode, replay3], "prompt-tail", q=3).reason == "prefill"  # the seed's fix needs q == 1
    assert cls([spec_decode, replay3], "strict", q=3).reason == "prefill"
    assert cls([spec_decode, (1, 140, 100)], "decode-shaped", q=3).reason == "non_uniform"


def test_max_query_len_2_with_q1():
    two_tail = (2, 127, 129)  # the last two prompt tokens over prior context
    for rule in ("strict", "prompt-tail", "decode-shaped"):
        c = cls([DECODE, two_tail], rule)
        assert not c.full_eligible and c.reason == "prefill"
    assert cls([DECODE, (2, 140, 100)], "decode-shaped").reason == "non_uniform"  # a decode row of 2 with q = 1


def test_unknown_rule_is_an_error():
    with pytest.raises(ValueError, match="full_graph_rule"):
        cls([REPLAY], "nope")


def test_capture_ladder_default():
    sizes = CompilationConfig().capture_sizes(max_num_seqs=128)
    assert sizes[:4] == [1, 2, 4, 8] and all(s % 8 == 0 for s in sizes[3:] if s < 256)
    assert sizes[-1] == 256 and [s for s in sizes if s > 248] == [256]
    assert CompilationConfig().capture_sizes(max_num_seqs=512)[-1] == 512
    assert all(s % 16 == 0 for s in CompilationConfig().capture_sizes(512) if s >= 256)
    assert CompilationConfig(cudagraph_capture_sizes="4,1,2").capture_sizes(8) == [1, 2, 4]
    with pytest.raises(ValueError, match="cudagraph_capture_sizes"):
        CompilationConfig(cudagraph_capture_sizes="a,b").capture_sizes(8)


def test_dispatch_pads_to_smallest_fitting_size():
    d = CudagraphDispatcher([1, 2, 4, 8, 16, 24, 32], CUDAGraphMode.FULL_AND_PIECEWISE, enforce_eager=False)
    assert d.pad[3] == 4 and d.pad[9] == 16 and d.pad[17] == 24 and d.pad[32] == 32
    full = Classification(True, 1, None)
    mode, desc, reason = d.dispatch(5, 5, full)
    assert (mode, desc, reason) == (CUDAGraphMode.FULL, BatchDescriptor(8, 8, 1), None)
    mixed = Classification(False, None, "prefill")
    mode, desc, reason = d.dispatch(20, 3, mixed)
    assert (mode, desc, reason) == (CUDAGraphMode.PIECEWISE, BatchDescriptor(24, 3, 0), "prefill")
    assert d.dispatch(33, 33, full)[0::2] == (CUDAGraphMode.NONE, "over_capture_size")
    assert d.dispatch(40, 3, mixed)[0::2] == (CUDAGraphMode.NONE, "prefill")


def test_dispatch_policies():
    full, mixed = Classification(True, 1, None), Classification(False, None, "prefill")
    eager = CudagraphDispatcher([1, 2, 4], CUDAGraphMode.FULL_AND_PIECEWISE, enforce_eager=True)
    assert eager.dispatch(2, 2, full)[0::2] == (CUDAGraphMode.NONE, "eager_forced")
    assert eager.full_descriptors() == [] and eager.piecewise_descriptors() == []
    decode_only = CudagraphDispatcher([1, 2, 4], CUDAGraphMode.FULL_DECODE_ONLY, enforce_eager=False)
    assert decode_only.dispatch(3, 3, full)[0] == CUDAGraphMode.FULL
    assert decode_only.dispatch(3, 2, mixed)[0::2] == (CUDAGraphMode.NONE, "prefill")
    piecewise = CudagraphDispatcher([1, 2, 4], CUDAGraphMode.PIECEWISE, enforce_eager=False)
    assert piecewise.dispatch(3, 3, full)[0::2] == (CUDAGraphMode.PIECEWISE, "full_disabled")  # was reason None
    assert piecewise.full_descriptors() == []
    assert [d.num_tokens for d in decode_only.full_descriptors()] == [1, 2, 4]
    q2 = CudagraphDispatcher([1, 2, 4, 8], CUDAGraphMode.FULL_AND_PIECEWISE, enforce_eager=False, q=2)
    assert q2.full_descriptors() == [BatchDescriptor(2, 1, 2), BatchDescriptor(4, 2, 2), BatchDescriptor(8, 4, 2)]
    assert q2.dispatch(6, 3, Classification(True, 2, None))[1] == BatchDescriptor(8, 4, 2)
    # 2 rows of q = 2 under the largest capture (5), but no FULL size for q = 2 holds 4: not "over_capture_size"
    k1 = CudagraphDispatcher([2, 3, 5], CUDAGraphMode.FULL_AND_PIECEWISE, enforce_eager=False, q=(1, 2))
    assert k1.dispatch(4, 2, Classification(True, 2, None))[0::2] == (CUDAGraphMode.PIECEWISE, "no_full_size")


def test_full_ladder_stops_at_the_size_that_holds_max_num_seqs():
    """q = 1 and q = 1 + K graphs both end at the first size holding max_num_seqs rows (a batch never has more):
    with speculative decoding the q = 1 ladder does not grow by the q x rows sizes."""
    from pdserve.config import CompilationConfig
    sizes = CompilationConfig().capture_sizes(100)  # 1, 2, 4, 8, ..., 200
    d = CudagraphDispatcher(sizes + [4 * s for s in (1, 2, 4, 8, 96, 104)], CUDAGraphMode.FULL_AND_PIECEWISE,
                            enforce_eager=False, q=[1, 4], max_rows=100)
    assert d.full_sizes[1][-1] == 104 and max(d.full_sizes[4]) == 416
    assert d.dispatch(100, 100, Classification(True, 1, None))[1] == BatchDescriptor(104, 104, 1)
    assert d.dispatch(400, 100, Classification(True, 4, None))[1] == BatchDescriptor(416, 104, 4)
    assert len(d.piecewise_descriptors()) == len(d.sizes)  # PIECEWISE keeps every token count
