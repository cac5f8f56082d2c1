"""A profile's `idle` section (sim/profile.py `Idle`; measured by `sim calibrate`, benchmarks/idle_step.py): a step
after the node sat idle pays an extra read from the gap, and the steps after it a fading share of it, in the
simulator's steps and leaps alike."""
from __future__ import annotations

import pytest

from pdserve.config import EngineConfig
from pdserve.sim.profile import Idle, ProfileError, profile_from_dict
from pdserve.sim.run import parse_deployment, simulate
from pdserve.sim.trace import TraceRequest
from tests.sim.conftest import LINEAR

IDLE = {"gaps_s": [0.005, 0.02, 0.05], "extra_s": [0.0004, 0.0014, 0.0016], "decay": 0.4}


def test_the_extra_is_read_between_the_gaps_and_fades_by_decay():
    idle = Idle.from_dict({"idle": IDLE})
    assert idle.extra(0.0) == 0.0 and idle.extra(-1.0) == 0.0
    assert idle.extra(0.0025) == pytest.approx(0.0002)  # from (0, 0) to the first gap
    assert idle.extra(0.0125) == pytest.approx(0.0009)  # halfway between 5 and 20 ms
    assert idle.extra(0.02) == pytest.approx(0.0014)
    assert idle.extra(10.0) == pytest.approx(0.0016)  # the last beyond the table
    assert idle.extra(0.0, 0.001) == pytest.approx(0.0004)  # no gap: the last step's extra, decayed
    assert idle.extra(0.005, 0.002) == pytest.approx(0.0008)  # a short gap while it fades: the larger
    assert idle.extra(0.05, 0.002) == pytest.approx(0.0016)
    assert Idle().extra(1.0, 0.5) == 0.0  # no section: nothing


@pytest.mark.parametrize("idle,named", [
    ({**IDLE, "gaps_s": [0.02, 0.005, 0.05]}, "idle.gaps_s: must increase"),
    ({**IDLE, "gaps_s": [0.0, 0.02, 0.05]}, "idle.gaps_s[0]"),
    ({**IDLE, "extra_s": [0.001, 0.002]}, "idle.extra_s: must have one number per idle.gaps_s entry"),
    ({**IDLE, "extra_s": [0.001, -0.002, 0.003]}, "idle.extra_s[1]"),
    ({**IDLE, "decay": 1.0}, "idle.decay"),
    ({**IDLE, "gaps_s": []}, "idle.gaps_s: must be a list of 1 to 32"),
    ({**IDLE, "decays": 0.5}, "idle.decays: unknown field"),
    ({k: v for k, v in IDLE.items() if k != "decay"}, "idle.decay: missing"),
    ([1, 2], "idle: must be an object"),
])
def test_bad_idle_fields_are_refused_by_name(idle, named):
    with pytest.raises(ProfileError, match=named.replace("[", r"\[").replace("]", r"\]")):
        profile_from_dict({**LINEAR, "idle": idle})


def _lone(arrival: float, idle: bool) -> dict:
    profile = profile_from_dict({**LINEAR, **({"idle": IDLE} if idle else {})})
    return simulate([TraceRequest("a", arrival, 40, 6)], parse_deployment("collocated"),
                    EngineConfig.from_kwargs("sim", max_num_seqs=4, max_model_len=256), profile)


@pytest.mark.parametrize("arrival", [0.0125, 0.5])
def test_a_request_after_a_pause_pays_the_extra_on_its_prefill_and_a_fading_share_after(arrival):
    """The node's first step follows `arrival` seconds of idle: the prefill pays extra(arrival), each decode step
    after it decay times the step before's."""
    plain, cold = _lone(arrival, False), _lone(arrival, True)
    e = Idle.from_dict({"idle": IDLE}).extra(arrival)
    assert cold["ttfts"][0] - plain["ttfts"][0] == pytest.approx(e, abs=1e-12)
    added = [b - a for a, b in zip(plain["itls"][0], cold["itls"][0])]
    assert added == pytest.approx([e * 0.4 ** (k + 1) for k in range(5)], abs=1e-12)
