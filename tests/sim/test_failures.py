"""What fails in a simulated P/D pair, as on a real one (sim/connector.py): a KV load that fails is recomputed on D
(the engine's own KVTransfers, kv_load_failure_policy recompute) and tells P `done`; a lease that expires before D
reads it is ended on P at its expiry, and a D whose request waited past it prefills the prompt itself. Every
request still completes to its length, and both pools are whole at the end."""
from __future__ import annotations

import pytest

from pdserve.config import EngineConfig
from pdserve.sim.connector import TransferModel
from pdserve.sim.run import build_nodes, parse_deployment, simulate
from pdserve.sim.simulator import Simulator
from pdserve.sim.trace import prompt_token_ids, random_trace
from tests.sim.test_first_token import assert_done_and_whole


def cfg(**kw) -> EngineConfig:
    return EngineConfig.from_kwargs("sim", **{"max_num_seqs": 16, "max_model_len": 1024, **kw})


def run_pair(profile, trace, transfer, mode="replay", **kw):
    prefill, decode, fabric = build_nodes(parse_deployment("1p1d"), cfg(**kw), profile, transfer, 0.0, 7)
    prefill_rows = []
    sim = Simulator(prefill, decode, "round-robin", fabric,
                    lambda n, rec: prefill_rows.extend(r for r in rec.rows if r[1] == 0)
                    if n.name == "decode0" else None, mode)
    results, _ = sim.run(trace, [prompt_token_ids(t, 32000) for t in trace])
    assert_done_and_whole(results, trace, prefill, decode)
    assert prefill[0].connector.open_leases == 0 and not prefill[0].connector.leases
    return fabric, prefill_rows


@pytest.mark.parametrize("mode", ["replay", "prefill"])
@pytest.mark.parametrize("rate", [0.0, 0.3, 1.0])
def test_failed_loads_are_recomputed_on_d(linear_profile, mode, rate):
    trace = random_trace(40, 120, 8, request_rate=20.0, range_ratio=0.5, seed=2)
    fabric, d_prefills = run_pair(linear_profile, trace, TransferModel(1e9, 0.001, load_failure_rate=rate), mode)
    n = len(trace)
    if rate == 0.0:
        assert fabric.failed_loads == 0 and not d_prefills
    elif rate == 1.0:
        assert fabric.failed_loads == n and len({r[0] for r in d_prefills}) == n  # each prefilled on D from 0
    else:
        assert 0 < fabric.failed_loads < n and len({r[0] for r in d_prefills}) == fabric.failed_loads
    assert fabric.expired_leases == 0


def test_leases_that_expire_while_d_is_short_of_blocks(linear_profile):
    """D's pool holds a few loads at a time and its decodes are long; leases of 50 ms run out while requests wait
    for D's blocks: P ends them at expiry (unread), and D prefills those requests itself."""
    trace = random_trace(30, 200, 60, request_rate=200.0, range_ratio=0.2, seed=5)
    fabric, d_prefills = run_pair(linear_profile, trace, TransferModel(1e9, 0.001, lease_seconds=0.05),
                                  num_gpu_blocks_override=60, max_model_len=512)
    assert fabric.expired_leases > 0
    assert len({r[0] for r in d_prefills}) >= fabric.expired_leases  # each expired lease's request, recomputed


def test_the_same_seed_fails_the_same_loads(linear_profile):
    trace = random_trace(30, 100, 4, request_rate=20.0, seed=9)
    runs = [simulate(trace, parse_deployment("1p1d"), cfg(), linear_profile, seed=3,
                     transfer=TransferModel(1e9, 0.001, load_failure_rate=0.5)) for _ in range(2)]
    assert runs[0]["sim"]["kv_failed_loads"] == runs[1]["sim"]["kv_failed_loads"] > 0
    assert runs[0]["ttfts"] == runs[1]["ttfts"]


@pytest.mark.parametrize("kw,flag", [(dict(lease_seconds=0.0), "--kv-lease-seconds"),
                                     (dict(load_failure_rate=1.5), "--kv-load-failure-rate")])
def test_bad_values_name_the_flag(kw, flag):
    with pytest.raises(ValueError, match=flag):
        TransferModel(1e9, 0.0, **kw)
