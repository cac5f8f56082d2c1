"""`--pd-first-token prefill` in the simulator (docs/pd.md, "The first token from P"): P samples the first token and
stops, the client has it at P's step end (no transfer in TTFT), D imports all n prompt tokens and decodes the token
as a plain row, so under the strict rule D never leaves FULL graphs, where the replay arm does at every arrival."""
from __future__ import annotations

import pytest

from pdserve.config import EngineConfig
from pdserve.sim.connector import TransferModel
from pdserve.sim.run import build_nodes, parse_deployment, simulate
from pdserve.sim.simulator import Simulator
from pdserve.sim.trace import TraceRequest, prompt_token_ids, random_trace

FAST = TransferModel(1e12, 0.0)


def cfg(**kw) -> EngineConfig:
    return EngineConfig.from_kwargs("sim", **{"max_num_seqs": 16, "max_model_len": 1024, **kw})


def assert_done_and_whole(results, trace, prefill, decode) -> None:
    """Every request served to its length, and every node idle with its pool whole and its invariants held."""
    assert all(r.success for r in results) and [r.output_tokens for r in results] == [t.output_len for t in trace]
    for node in prefill + decode:
        node.scheduler.check_invariants()
        assert not node.scheduler.requests and not node.scheduler.transfers.leased
        assert node.kv.num_free_blocks() == node.kv.pool.num_blocks - 1, node.name


def test_strict_rule_d_stays_on_full_graphs_only_with_the_first_token_from_p(linear_profile):
    trace = random_trace(50, 200, 40, request_rate=10.0, range_ratio=0.5, seed=4)
    arms = {mode: simulate(trace, parse_deployment("1p1d"), cfg(full_graph_rule="strict"), linear_profile,
                           transfer=FAST, pd_first_token=mode) for mode in ("replay", "prefill")}
    replay, first = arms["replay"], arms["prefill"]
    for r in arms.values():
        assert r["completed"] == 50 and r["output_lens"] == [t.output_len for t in trace]
    # replay: each arrival's one-token replay is a prefill row, off FULL under strict; from P: a plain decode row
    assert replay["graph"]["non_full_steps"] >= 40 and set(replay["graph"]["non_full_reasons"]) == {"prefill"}
    assert first["graph"]["non_full_steps"] == 0 and first["graph"]["full_steps"] > 0
    assert first["sim"]["pd_first_token"] == "prefill"


def test_ttft_ends_at_ps_step_and_holds_no_transfer(linear_profile):
    trace = [TraceRequest("a", 0.0, 512, 4)]
    runs = {(mode, latency): simulate(trace, parse_deployment("1p1d"), cfg(), linear_profile,
                                      transfer=TransferModel(1e9, latency), pd_first_token=mode)
            for mode in ("replay", "prefill") for latency in (0.0, 0.5)}
    assert runs["replay", 0.5]["ttfts"][0] - runs["replay", 0.0]["ttfts"][0] == pytest.approx(0.5)
    quick, slow = runs["prefill", 0.0], runs["prefill", 0.5]
    assert slow["ttfts"][0] == quick["ttfts"][0] < runs["replay", 0.0]["ttfts"][0]
    # the transfer is paid after the first token: by the second (and the whole request)
    assert slow["latencies"][0] - quick["latencies"][0] == pytest.approx(0.5)
    assert slow["itls"][0][0] - quick["itls"][0][0] == pytest.approx(0.5)
    split = slow["router_ttft_split_ms"]
    assert set(split) == {"router_to_prefill", "prefill", "first_token_from_prefill", "total"}
    assert split["total"] == pytest.approx(1000 * slow["ttfts"][0])
    assert split["router_to_prefill"] + split["prefill"] + split["first_token_from_prefill"] == \
        pytest.approx(split["total"])


def test_d_imports_n_tokens_and_decodes_ps_token_as_a_plain_row(linear_profile):
    """n = 513: replay imports n - 1 = 512 tokens (32 blocks of 16) and replays the 513th; with P's token, D imports
    all 513 (33 blocks) and its first row is the token at position 513, one token over 513 computed."""
    trace = [TraceRequest("a", 0.0, 513, 3)]
    first_rows = {}
    for mode in ("replay", "prefill"):
        prefill, decode, fabric = build_nodes(parse_deployment("1p1d"), cfg(), linear_profile, FAST, 0.0, 0)
        rows = []
        sim = Simulator(prefill, decode, "round-robin", fabric,
                        lambda n, rec: rows.append(rec.rows[0]) if n.name == "decode0" else None, mode)
        results, _ = sim.run(trace, [prompt_token_ids(t, 32000) for t in trace])
        assert results[0].success and results[0].output_tokens == 3
        assert fabric.bytes_moved == {"replay": 32, "prefill": 33}[mode] * 16 * linear_profile.model.kv_bytes_per_token
        first_rows[mode] = rows[0]
        # D ran the rest: two decode steps from P's token on, three (the replay's included) without it
        assert len(rows) == {"replay": 3, "prefill": 2}[mode]
    assert first_rows == {"replay": ("a", 512, 1), "prefill": ("a", 513, 1)}


def test_a_first_token_that_ends_the_request_never_reaches_d(linear_profile):
    trace = [TraceRequest("one", 0.0, 100, 1), TraceRequest("two", 0.0, 100, 5)]
    prefill, decode, fabric = build_nodes(parse_deployment("1p1d"), cfg(), linear_profile, FAST, 0.0, 0)
    sim = Simulator(prefill, decode, "round-robin", fabric, pd_first_token="prefill")
    results, _ = sim.run(trace, [prompt_token_ids(t, 32000) for t in trace])
    assert [r.output_tokens for r in results] == [1, 5] and all(r.success for r in results)
    assert set(decode[0].connector.load_times) == {"two"}  # D never saw `one`
    for node in prefill + decode:  # P's leases ended (the one that ended at P at once), both pools whole
        node.scheduler.check_invariants()
        assert not node.scheduler.requests and not node.scheduler.transfers.leased
        assert node.kv.num_free_blocks() == node.kv.pool.num_blocks - 1, node.name
    assert prefill[0].connector.open_leases == 0


@pytest.mark.parametrize("early", [False, True])
def test_first_token_mode_under_pressure_ends_every_lease(linear_profile, early):
    """Tight blocks on both sides (loads wait for blocks, leases pile up on P) and a prompt D has cached whole:
    every request runs to its length, P's leases all end and both pools are whole."""
    trace = random_trace(30, 150, 10, request_rate=50.0, seed=3) + [
        TraceRequest(f"same{i}", 1.0 + i, 48, 4, "same", 48) for i in range(4)]
    prefill, decode, fabric = build_nodes(parse_deployment("1p1d"), cfg(num_gpu_blocks_override=80), linear_profile,
                                          TransferModel(1e8, 0.002), 0.0, 0)
    sim = Simulator(prefill, decode, "round-robin", fabric, pd_first_token="prefill", early_decode=early)
    results, _ = sim.run(trace, [prompt_token_ids(t, 32000) for t in trace])
    assert_done_and_whole(results, trace, prefill, decode)
    assert prefill[0].connector.open_leases == 0 and not fabric.awaits
    loads = [f"same{i}" in decode[0].connector.load_times for i in range(4)]
    if early:  # D takes it before P's token exists: its prefix hit leaves the last prompt token, so it awaits the
        assert loads == [True] * 4 and not fabric.board  # last block each time (the engine's hit, n - 1 at most)
    else:  # 48 tokens = 3 whole blocks: once D holds them all from the first load, later ones load nothing
        assert loads == [True, False, False, False]


def test_collocated_has_no_first_token_from_p(linear_profile):
    with pytest.raises(ValueError, match="--pd-first-token prefill is for XpYd"):
        simulate([TraceRequest("a", 0.0, 10, 2)], parse_deployment("collocated"), cfg(), linear_profile,
                 pd_first_token="prefill")


def test_a_prompt_d_holds_but_its_last_token_still_loads_that_block(linear_profile):
    """49 tokens, the second time D sees them: its prefix cache holds the first 48 (three whole blocks), which is
    all a replay needs (n - 1); with P's token D needs all n, so it loads the last token's block (as TcpConnector
    offers num_importable_tokens) instead of computing that token itself in a prefill row."""
    trace = [TraceRequest("a", 0.0, 49, 3, "g", 49), TraceRequest("b", 1.0, 49, 3, "g", 49)]
    prefill, decode, fabric = build_nodes(parse_deployment("1p1d"), cfg(full_graph_rule="strict"), linear_profile,
                                          FAST, 0.0, 0)
    rows = []
    sim = Simulator(prefill, decode, "round-robin", fabric,
                    lambda n, rec: rows.extend(rec.rows) if n.name == "decode0" else None, "prefill")
    results, _ = sim.run(trace, [prompt_token_ids(t, 32000) for t in trace])
    assert all(r.success for r in results)
    assert set(decode[0].connector.load_times) == {"a", "b"}
    assert decode[0].graph_stats.snapshot() == {**decode[0].graph_stats.snapshot(), "non_full_steps": 0}
    assert [r for r in rows if r[0] == "b"][0] == ("b", 49, 1)


def test_the_cli_flag_names_the_arm_and_is_refused_collocated(tmp_path, capsys):
    import json

    from pdserve.cli import main
    from tests.sim.conftest import LINEAR
    from tests.sim.test_cli import _err
    profile = tmp_path / "p.json"
    profile.write_text(json.dumps(LINEAR))
    base = ["sim", "--profile", str(profile), "--num-prompts", "6", "--result-dir", str(tmp_path / "r"), "--quiet",
            "--pd-first-token", "prefill"]
    assert "--pd-first-token prefill is for XpYd" in _err(capsys, base)
    assert main(base + ["--deployment", "1p1d"]) == 0
    run = json.loads((tmp_path / "r" / "first-token_rate1.json").read_text())
    assert run["completed"] == 6 and run["sim"]["pd_first_token"] == "prefill"
    assert json.loads((tmp_path / "r" / "summary.json").read_text())["arms"] == ["first-token"]
    assert run["sim"]["pd_early_decode"] is True
    assert main(base + ["--deployment", "1p1d", "--no-pd-early-decode", "--result-dir", str(tmp_path / "late")]) == 0
    late = json.loads((tmp_path / "late" / "first-token-late_rate1.json").read_text())
    assert late["completed"] == 6 and late["sim"]["pd_early_decode"] is False


def test_speculative_decoding_on_d_after_ps_token(linear_profile):
    """D drafts from the first token on (the n-gram proposer reads P's token as the request's own): every request
    runs to its length, drafts are taken, and both pools end whole."""
    from pdserve.spec_decode.config import SpeculativeConfig
    spec = SpeculativeConfig.from_json('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, '
                                       '"prompt_lookup_max": 2}')
    trace = random_trace(12, 64, 40, request_rate=6.0, seed=8)
    prefill, decode, fabric = build_nodes(parse_deployment("1p1d"), cfg(speculative_config=spec,
                                                                        full_graph_rule="strict"),
                                          linear_profile, FAST, 0.7, 0)
    sim = Simulator(prefill, decode, "round-robin", fabric, pd_first_token="prefill")
    results, _ = sim.run(trace, lambda t: prompt_token_ids(t, 32000))
    assert [r.output_tokens for r in results] == [40] * 12
    assert decode[0].spec_counts["num_accepted_tokens"] > 0
    assert decode[0].graph_stats.snapshot()["non_full_steps"] == 0  # q = 1 + K rows over imported KV: FULL
    for node in prefill + decode:
        node.scheduler.check_invariants()
        assert node.kv.num_free_blocks() == node.kv.pool.num_blocks - 1, node.name
