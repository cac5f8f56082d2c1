"""Speculative decoding on a P/D decode node: the replay row (last prompt token + K drafts looked up in the prompt)
is decode-shaped at q = 1 + K, FULL under decode-shaped and off FULL under strict and prompt-tail; tokens equal
collocated (with and without spec decode); both pools whole. Also under a full pool of imports (lookahead slots
come with the load) and with the D-side arrival driver."""
from __future__ import annotations

import pytest

from pdserve import LLM, SamplingParams
from tests.server_harness import free_port
from tests.transfer.test_pd_engine import ENGINE, PROMPTS, assert_whole, drain, prefill_on, producer
from tests.spec_decode.test_spec_decode import spec


def consumer(model, rule, k=3, **engine):
    kv = {"kv_connector": "TcpConnector", "kv_role": "kv_consumer", "kv_auth_token": "secret",
          "kv_transfer_timeout": 1.0}
    return LLM(model, kv_transfer_config=kv, speculative_config=spec(k), full_graph_rule=rule,
               **{**ENGINE, **engine})


def decode(d, params, prompts=PROMPTS, max_tokens=16):
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i, (prompt, kp) in enumerate(zip(prompts, params)):
        d.engine.add_request(prompt, sp, request_id=f"d{i}", kv_transfer_params=kp)
    out = drain(d)
    return [out[f"d{i}"].outputs[0].token_ids for i in range(len(prompts))]


@pytest.fixture(scope="module")
def collocated(qwen3_tiny):
    outs = LLM(qwen3_tiny, **ENGINE).generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16,
                                                                        ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("rule,non_full", [("decode-shaped", {"prefill": 1}), ("strict", None),
                                           ("prompt-tail", None)])
def test_replay_rows_draft_and_ride_full_only_under_decode_shaped(qwen3_tiny, collocated, rule, non_full):
    p = producer(qwen3_tiny, free_port())
    d = consumer(qwen3_tiny, rule)
    rows = []
    execute = d.engine.runner.execute
    d.engine.runner.execute = lambda rs, b: rows.extend(rs) or execute(rs, b)
    try:
        params = prefill_on(p, PROMPTS)
        assert decode(d, params) == collocated
        replays = [r for r in rows if r.num_computed_tokens == r.request.num_prompt_tokens - 1 > 0]
        assert len(replays) == 5 and all(len(r.draft_token_ids) == 3 and r.num_scheduled_tokens == 4
                                         for r in replays)
        assert any(max(r.draft_token_ids) >= 0 for r in replays), "no replay drafted from its prompt"
        stats = d.engine.graph_stats()
        if non_full is not None:
            # the one prefill step is the one-token prompt "x", which has no KV to import
            assert stats["non_full_by_reason"] == non_full, stats
        else:
            assert stats["non_full_by_reason"].get("prefill", 0) > 1, stats
        assert d.engine.spec_decode_stats()["num_accepted_tokens"] > 0
        drain(p)
        assert_whole(p, d)
    finally:
        p.engine.shutdown()
        d.engine.shutdown()


def test_imports_filling_the_pool_still_decode(qwen3_tiny, collocated):
    """D's pool just big enough: every load allocates its replay's lookahead slots with its blocks, so imports
    waiting for a seat can never hold every block and leave a replay without room for its drafts."""
    p = producer(qwen3_tiny, free_port())
    d = consumer(qwen3_tiny, "decode-shaped", k=5, num_gpu_blocks_override=16, block_size=16, max_num_seqs=2,
                 max_model_len=224)
    try:
        params = prefill_on(p, PROMPTS)
        assert decode(d, params) == collocated
        drain(p)
        assert_whole(p, d)
    finally:
        p.engine.shutdown()
        d.engine.shutdown()


def test_arrival_driver_replays_draft(qwen3_tiny, collocated):
    """DecodeBenchConnector's imports (a local prefill standing in for P) replay as drafting rows too."""
    llm = LLM(qwen3_tiny, speculative_config=spec(3), **ENGINE)
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        llm.engine.add_prefilled_request(prompt, sp, request_id=f"r{i}")
    out = drain(llm)
    assert [out[f"r{i}"].outputs[0].token_ids for i in range(len(PROMPTS))] == collocated
    stats = llm.engine.graph_stats()
    assert stats["non_full_by_reason"] == {"prefill": 1}, stats  # "x" again
    llm.engine.check_invariants()
    assert llm.engine.kv.num_free_blocks() == llm.engine.num_blocks - 1


@pytest.mark.parametrize("k", [1, 5])
def test_pd_equals_collocated_for_other_k(qwen3_tiny, collocated, k):
    p = producer(qwen3_tiny, free_port())
    d = consumer(qwen3_tiny, "decode-shaped", k=k)
    try:
        assert decode(d, prefill_on(p, PROMPTS)) == collocated
        assert d.engine.graph_stats()["non_full_by_reason"] == {"prefill": 1}
        drain(p)
        assert_whole(p, d)
    finally:
        p.engine.shutdown()
        d.engine.shutdown()
