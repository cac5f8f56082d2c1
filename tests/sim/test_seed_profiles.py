"""The shipped B200 profiles of the seed's setups (pdserve/sim/profiles/): they load by name and by path, a bad field
in a copy is refused by name, and on the seed's workload the strict rule takes D's steps off FULL where the default
rule does not (the seed's before/after, in a few simulated seconds)."""
from __future__ import annotations

import copy
import json
import re
import sys
from pathlib import Path

import pytest

from pdserve.config import EngineConfig
from pdserve.sim.connector import TransferModel
from pdserve.sim.profile import (SHIPPED_DIR, ProfileError, RooflineProfile, load_profile, profile_from_dict,
                                 shipped_profiles)
from pdserve.sim.run import parse_deployment, simulate
from pdserve.sim.trace import random_trace

SHIPPED = ("qwen3-0.6b-b200", "llama-3-8b-b200")


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_profiles_load_by_name_and_by_path(name):
    assert name in shipped_profiles()
    by_name = load_profile(name)
    by_path = load_profile(str(SHIPPED_DIR / f"{name}.json"))
    assert isinstance(by_name, RooflineProfile) and by_name.raw == by_path.raw
    assert by_name.raw["name"] == name and by_name.raw["gpu"]["name"] == "B200"
    # fitted: the achieved bandwidth is a share of the datasheet's, and a FULL step costs least
    assert 0 < by_name.raw["gpu"]["memory_efficiency"] <= 1
    assert by_name.bandwidth == pytest.approx(8000e9 * by_name.raw["gpu"]["memory_efficiency"])
    o = by_name.overhead_s
    assert 0 < o["FULL"] <= o["PIECEWISE"]
    assert by_name.raw["fit"]["residuals_after"], "the fit states its residuals"


def test_the_profiles_are_package_data():
    tomllib = pytest.importorskip("tomllib") if sys.version_info >= (3, 11) else pytest.skip("tomllib: 3.11+")
    root = Path(__file__).resolve().parents[2]
    data = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert "profiles/*.json" in data["pdserve.sim"]


@pytest.mark.parametrize("path,value,named", [
    ("gpu.memory_efficiency", 1.5, "gpu.memory_efficiency"),
    ("gpu.memory_efficiency", 0, "gpu.memory_efficiency"),
    ("gpu.memory_efficiency", "high", "gpu.memory_efficiency"),
    ("step_overhead_s.FULL", -1e-3, "step_overhead_s.FULL"),
    ("model.kv_bytes_per_token", None, "model.kv_bytes_per_token"),
    ("fit", [1], "fit"),
    ("gpu.memory_eficiency", 0.9, "gpu.memory_eficiency"),
])
def test_a_bad_field_in_a_copy_is_refused_by_name(tmp_path, path, value, named):
    d = copy.deepcopy(load_profile("qwen3-0.6b-b200").raw)
    cur = d
    *head, last = path.split(".")
    for k in head:
        cur = cur[k]
    cur[last] = value
    f = tmp_path / "mine.json"
    f.write_text(json.dumps(d))
    with pytest.raises(ProfileError, match=r"mine\.json: " + re.escape(named) + ":"):
        load_profile(str(f))


def test_an_unknown_name_lists_the_shipped_ones():
    with pytest.raises(ProfileError, match=r"qwen3-0\.6b-h100: no such file, nor a shipped profile \(shipped: .*"
                                           r"qwen3-0\.6b-b200"):
        load_profile("qwen3-0.6b-h100")


def test_memory_efficiency_scales_the_bandwidth():
    d = copy.deepcopy(load_profile("llama-3-8b-b200").raw)
    d["gpu"]["memory_efficiency"] = 1.0
    full = profile_from_dict(d)
    d["gpu"]["memory_efficiency"] = 0.5
    half = profile_from_dict(d)
    assert half.bandwidth == pytest.approx(full.bandwidth / 2)


def _seed_point(rule: str) -> dict:
    # the seed's 1024/256 workload on the shipped Qwen3-0.6B profile, 3 s of arrivals at 16 req/s, vLLM's defaults
    # for a B200 (benchmarks/sim_seed_table.py runs the whole table)
    config = EngineConfig.from_kwargs("sim", max_num_seqs=1024, max_num_batched_tokens=8192,
                                      kv_cache_memory_gb=150.0, max_model_len=40960, full_graph_rule=rule)
    trace = random_trace(48, 1024, 256, 16.0, seed=1)
    return simulate(trace, parse_deployment("1p1d"), config, load_profile("qwen3-0.6b-b200"),
                    transfer=TransferModel(20e9, 5e-3), seed=1)


@pytest.mark.timeout(60)
def test_the_seed_workload_leaves_full_graphs_only_under_the_strict_rule():
    strict, default = _seed_point("strict"), _seed_point("decode-shaped")
    assert strict["completed"] == default["completed"] == 48
    # each arrival's one-token replay takes its step off FULL under strict (vLLM MRv2 before the fix)...
    g = strict["graph"]
    assert g["non_full_share"] > 0 and set(g["non_full_reasons"]) == {"prefill"}
    assert 0 < g["non_full_steps"] <= 48
    # ...and rides FULL under the default rule: no step on D leaves FULL (no preemption at this load)
    assert default["graph"]["non_full_steps"] == 0 and default["graph"]["full_steps"] > 0
    # PIECEWISE steps cost more than FULL ones: the strict arm's TPOT is the higher
    assert strict["tpot_ms"]["mean"] > default["tpot_ms"]["mean"]


def test_the_cli_takes_a_shipped_name(tmp_path, capsys):
    from pdserve.cli import main
    rc = main(["sim", "--profile", "llama-3-8b-b200", "--deployment", "1p1d", "--num-prompts", "4",
               "--random-input-len", "64", "--random-output-len", "4", "--request-rate", "4",
               "--kv-cache-memory-gb", "4", "--result-dir", str(tmp_path), "--quiet"])
    assert rc == 0, capsys.readouterr().err
    r = json.loads((tmp_path / "default_rate4.json").read_text())
    assert r["completed"] == 4 and r["sim"]["profile"]["name"] == "llama-3-8b-b200"
