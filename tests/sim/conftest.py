"""Shared by the simulator's tests: a step-time profile that needs no calibration, and the tiny model."""
from __future__ import annotations

import pytest

LINEAR = {"type": "linear", "device": "cpu", "model": {"kv_bytes_per_token": 4096, "max_model_len": 2048},
          "coefficients": {"base_s": {"FULL": 0.001, "PIECEWISE": 0.002, "NONE": 0.003}, "per_token_s": 1e-5,
                           "per_row_s": 1e-5, "per_context_token_s": 1e-7}}


@pytest.fixture
def linear_profile():
    from pdserve.sim.profile import profile_from_dict
    return profile_from_dict(LINEAR)


@pytest.fixture(scope="session")
def qwen3_tiny_dir(pdserve_home):
    from pdserve.model.make_model import ensure_model
    return str(ensure_model("qwen3", "tiny", 0))
