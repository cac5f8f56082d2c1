"""Step-time profiles: both types load and compute what their formula says; bad fields are refused by name; the
calibration's fit recovers known coefficients and a tiny real calibration writes a profile that loads."""
from __future__ import annotations

import copy
import json
import random
import re

import pytest

from pdserve.sim.calibrate import ARRIVAL_PROBES, LONE_PROBES, calibrate, fit, fit_served
from pdserve.sim.profile import ProfileError, StepShape, load_profile, profile_from_dict

from tests.sim.conftest import LINEAR

ROOFLINE = {"type": "roofline", "device": "cuda", "gpu": {"name": "H100", "memory_bandwidth_gb_s": 3350,
                                                          "peak_tflops": 989},
            "model": {"kv_bytes_per_token": 114688, "weight_bytes": 1.2e9, "flops_per_token": 1.2e9,
                      "attention_flops_per_pair": 114688},
            "step_overhead_s": {"FULL": 2e-5, "PIECEWISE": 4e-4, "NONE": 1.5e-3}}


def test_linear_profile_is_its_formula():
    p = profile_from_dict(LINEAR)
    s = StepShape("PIECEWISE", num_tokens=10, padded_tokens=16, num_reqs=3, context_tokens=500, attention_pairs=0)
    assert p.step_time(s) == pytest.approx(0.002 + 16e-5 + 3e-5 + 500e-7)


def test_roofline_profile_is_memory_or_compute_bound():
    p = profile_from_dict(ROOFLINE)
    decode = StepShape("FULL", 8, 8, 8, 8 * 1000, 8 * 1000)
    # a decode step reads the weights and the KV: memory-bound
    assert p.step_time(decode) == pytest.approx(2e-5 + (1.2e9 + 114688 * 8000) / 3350e9)
    prefill = StepShape("NONE", 8192, 8192, 1, 8192, 8192 * 8193 // 2)
    flops = 1.2e9 * 8192 + 114688 * (8192 * 8193 // 2)
    assert p.step_time(prefill) == pytest.approx(1.5e-3 + flops / 989e12)
    assert flops / 989e12 > (1.2e9 + 114688 * 8192) / 3350e9  # compute-bound indeed


def _set(d: dict, path: str, value) -> dict:
    d = copy.deepcopy(d)
    cur = d
    *head, last = path.split(".")
    for k in head:
        cur = cur[k]
    cur[last] = value
    return d


@pytest.mark.parametrize("base,path,value,named", [
    (LINEAR, "coefficients.per_token_s", -1.0, "coefficients.per_token_s"),
    (LINEAR, "coefficients.per_row_s", "fast", "coefficients.per_row_s"),
    (LINEAR, "coefficients.base_s.FULL", float("nan"), "coefficients.base_s.FULL"),
    (LINEAR, "coefficients.base_s.EAGER", 0.1, "coefficients.base_s.EAGER"),
    (LINEAR, "coefficients.per_tokn_s", 0.1, "coefficients.per_tokn_s"),
    (LINEAR, "model.kv_bytes_per_token", 0, "model.kv_bytes_per_token"),
    (LINEAR, "model.max_model_len", 1.5, "model.max_model_len"),
    (LINEAR, "type", "quadratic", "type"),
    (LINEAR, "coefficient", {}, "coefficient"),
    (ROOFLINE, "gpu.memory_bandwidth_gb_s", 0, "gpu.memory_bandwidth_gb_s"),
    (ROOFLINE, "gpu.peak_tflop", 1, "gpu.peak_tflop"),
    (ROOFLINE, "step_overhead_s", [1, 2, 3], "step_overhead_s"),
    (ROOFLINE, "model.weight_bytes", True, "model.weight_bytes"),
])
def test_bad_fields_are_refused_by_name(base, path, value, named):
    with pytest.raises(ProfileError, match=r"(^|\s)" + re.escape(named) + ":"):
        profile_from_dict(_set(base, path, value))


@pytest.mark.parametrize("base,path", [(LINEAR, "coefficients.per_context_token_s"), (LINEAR, "model"),
                                       (LINEAR, "coefficients.base_s.NONE"), (ROOFLINE, "model.flops_per_token"),
                                       (ROOFLINE, "gpu")])
def test_missing_fields_are_named(base, path):
    d = copy.deepcopy(base)
    cur = d
    *head, last = path.split(".")
    for k in head:
        cur = cur[k]
    del cur[last]
    with pytest.raises(ProfileError, match=re.escape(path) + ": missing"):
        profile_from_dict(d)


def test_load_profile_names_the_file(tmp_path):
    f = tmp_path / "p.json"
    f.write_text("{not json")
    with pytest.raises(ProfileError, match=r"--profile .*p\.json: not JSON"):
        load_profile(f)
    f.write_text(json.dumps(_set(LINEAR, "coefficients.per_row_s", -2)))
    with pytest.raises(ProfileError, match=r"p\.json: coefficients\.per_row_s: must be a number >= 0"):
        load_profile(f)
    with pytest.raises(ProfileError, match="No such file"):
        load_profile(tmp_path / "missing.json")


def test_fit_recovers_known_coefficients_despite_outliers():
    true = profile_from_dict(_set(LINEAR, "coefficients.base_s", {"FULL": 0.0005, "PIECEWISE": 0.003,
                                                                  "NONE": 0.004}))
    rng = random.Random(0)
    samples = []
    for _ in range(300):
        mode = rng.choice(("FULL", "PIECEWISE", "NONE"))
        s = StepShape(mode, 0, rng.randint(1, 512), rng.randint(1, 64), rng.randint(1, 20000), 0)
        t = true.step_time(s) * rng.uniform(0.98, 1.02)
        samples.append((s, t * 10 if rng.random() < 0.1 else t))  # another process took the core now and then
    coefs, report = fit(samples)
    assert coefs["base_s"] == pytest.approx(true.base_s, rel=0.05)
    for k in ("per_token_s", "per_row_s", "per_context_token_s"):
        assert coefs[k] == pytest.approx(getattr(true, k), rel=0.05), k
    assert report["median_rel_error"] < 0.02 and report["modes_not_measured"] == []


def test_fit_keeps_coefficients_non_negative():
    samples = [(StepShape("NONE", 0, n, 1, 0, 0), 0.01 - 1e-6 * n) for n in range(1, 50)]  # time falls with tokens
    coefs, report = fit(samples)
    assert all(v >= 0 for v in coefs["base_s"].values()) and coefs["per_token_s"] == 0.0
    assert report["modes_not_measured"] == ["FULL", "PIECEWISE"]


@pytest.mark.timeout(120)
def test_a_tiny_calibration_writes_a_profile_that_loads(qwen3_tiny_dir):
    d = calibrate(qwen3_tiny_dir, rows=[1, 2], contexts=[8, 24], decode_steps=3)
    p = profile_from_dict(json.loads(json.dumps(d)))
    assert d["model"]["kv_bytes_per_token"] == 2 * 4 * 2 * 64 * 4  # K and V, 4 layers, 2 KV heads of 64, float32
    assert set(d["fit"]["steps_by_mode"]) == {"FULL", "PIECEWISE", "NONE"}
    assert d["fit"]["steps_by_mode"]["FULL"] > 0 and d["fit"]["steps_by_mode"]["NONE"] > 0
    assert p.step_time(StepShape("FULL", 1, 1, 1, 10, 10)) > 0


def test_a_served_section_scales_the_step_and_is_checked_by_name():
    p = profile_from_dict({**LINEAR, "served": {"step_scale": 1.5, "step_overhead_s": 0.001,
                                                "request_latency_s": 0.004}})
    s = StepShape("FULL", 16, 16, 16, 500, 500)
    assert p.step_time(s) == pytest.approx(1.5 * p.bare_step_time(s) + 0.001)
    assert p.served.request_latency_s == 0.004
    assert profile_from_dict(LINEAR).step_time(s) == profile_from_dict(LINEAR).bare_step_time(s)
    assert p.served.neighbour_scale == 0.0 and p.served.chunk_delay(0.99) == 0.0
    late = profile_from_dict({**LINEAR, "served": {"chunk_delay_quantiles_s": [0, 0.001, 0.011]}}).served
    assert [late.chunk_delay(u) for u in (0.0, 0.25, 0.5, 0.75)] == pytest.approx([0, 0.0005, 0.001, 0.006])
    assert profile_from_dict({**LINEAR, "served": {"neighbour_scale": 0.75}}).served.neighbour_scale == 0.75
    assert p.served.arrival_delay_s == 0.0
    assert profile_from_dict({**LINEAR, "served": {"arrival_delay_s": 0.002}}).served.arrival_delay_s == 0.002
    for field, value, named in (("step_scale", 0, "served.step_scale: must be a number > 0"),
                                ("request_latency_s", -1, "served.request_latency_s: must be a number >= 0"),
                                ("neighbour_scale", -0.1, "served.neighbour_scale: must be a number >= 0"),
                                ("arrival_delay_s", -0.001, "served.arrival_delay_s: must be a number >= 0"),
                                ("arrival_delay_s", "1ms", "served.arrival_delay_s: must be a number >= 0"),
                                ("chunk_delay_quantiles_s", [0.002, 0.001], "must not decrease"),
                                ("chunk_delay_quantiles_s", [0, -1], "served.chunk_delay_quantiles_s[1]: must be a "
                                                                    "number >= 0"),
                                ("chunk_delay_quantiles_s", [0.001], "must be a list of 2 to 101 numbers"),
                                ("chunk_delay_by_rows", [[1, [0, 1]]], "served.chunk_delay_by_rows: must be an "
                                                                       "object"),
                                ("chunk_delay_by_rows", {"0": [0, 1]}, "served.chunk_delay_by_rows.0: keys must be "
                                                                       "row counts >= 1"),
                                ("chunk_delay_by_rows", {"two": [0, 1]}, "chunk_delay_by_rows.two: keys must be"),
                                ("chunk_delay_by_rows", {"4": [0.002, 0.001]}, "served.chunk_delay_by_rows.4: must "
                                                                               "not decrease"),
                                ("chunk_delay_by_rows", {"4": [0, -1]}, "served.chunk_delay_by_rows.4[1]: must be"),
                                ("neighbour_chunk_delay_by_rows", {"x": [0, 1]},
                                 "served.neighbour_chunk_delay_by_rows.x: keys must be"),
                                ("neighbour_chunk_delay_quantiles_s", [1, 0],
                                 "served.neighbour_chunk_delay_quantiles_s: must not decrease"),
                                ("step_offset_s", 1, "served.step_offset_s: unknown field")):
        with pytest.raises(ProfileError, match=re.escape(named)):
            profile_from_dict({**LINEAR, "served": {field: value}})


def test_fit_served_reads_lockstep_decode_gaps_and_the_lone_first_chunk():
    """Synthetic served batches made by a known rule (served step = 1.4 x bare + 0.7 ms, 5 ms outside the steps):
    the fit finds it; the gaps before every request of a batch streams (its prefills ran apart) are left out, and
    chunks that reach the client in a burst (its process waited for a core) do not move it."""
    bare_p = profile_from_dict(LINEAR)
    bare = [(StepShape("FULL", r, r, r, r * 65, r * 65), 0.0) for r in (1, 4)] + \
        [(StepShape("PIECEWISE", c, c, 1, c, c), 0.0) for c in (64, 200)]
    rule = lambda s: 1.4 * bare_p.bare_step_time(s) + 0.0007  # noqa: E731
    served, report = fit_served(synthetic_batches(rule), bare, bare_p.bare_step_time)
    assert served["step_scale"] == pytest.approx(1.4, rel=0.02)
    assert served["step_overhead_s"] == pytest.approx(0.0007, rel=0.05)
    assert served["request_latency_s"] == pytest.approx(0.005, rel=0.02)
    assert report["first_chunks"] == 2 and report["median_rel_error"] < 0.01
    assert "neighbour_scale" not in served
    # the burst: tokens 5-7 of each stream late by up to three steps, the rest on pace (microseconds off it: the
    # steps grow with the context)
    q = served["chunk_delay_quantiles_s"]
    assert len(q) == 101 and q[0] == 0.0 and q == sorted(q) and q[-1] > 0.002 and q[50] < 1e-4
    # the grid run three times (--served-repeats), one of them on a stalled machine: each batch's median run
    repeated = synthetic_batches(rule) + synthetic_batches(lambda s: 3 * rule(s)) + synthetic_batches(rule)
    again, report = fit_served(repeated, bare, bare_p.bare_step_time)
    assert again["step_scale"] == pytest.approx(1.4, rel=0.02) and report["decode_runs"] == 4
    assert again["request_latency_s"] == pytest.approx(0.005, rel=0.02) and report["first_chunks"] == 6


def test_fit_served_takes_the_idle_extra_out_of_the_request_latency():
    """The same batches sent one after another, each 30 ms after the last one's final chunk: a lone request's
    prefill then pays the idle extra at 35 ms (the pause and its 5 ms way in), which the simulator adds apart, so the
    request latency is fitted without it; without an idle section it stays in."""
    from pdserve.sim.profile import Idle
    bare_p = profile_from_dict(LINEAR)
    bare = [(StepShape("FULL", r, r, r, r * 65, r * 65), 0.0) for r in (1, 4)] + \
        [(StepShape("PIECEWISE", c, c, 1, c, c), 0.0) for c in (64, 200)]
    rule = lambda s: 1.4 * bare_p.bare_step_time(s) + 0.0007  # noqa: E731
    idle = Idle.from_dict({"idle": {"gaps_s": [0.01, 0.05], "extra_s": [0.001, 0.003], "decay": 0.3}})
    cold = idle.extra(0.035)
    batches, end = [], 0.0
    for r, c, _, streams in sorted(synthetic_batches(rule), key=lambda b: -b[0]):  # a lone batch follows another
        t0 = end + 0.03
        extra = cold if r == 1 else 0.0  # a lone prefill is the step after the pause
        streams = [[t0 + extra + x for x in st] for st in streams]
        batches.append((r, c, t0, streams))
        end = max(st[-1] for st in streams)
    with_idle, report = fit_served(batches, bare, bare_p.bare_step_time, idle=idle)
    assert with_idle["request_latency_s"] == pytest.approx(0.005, rel=0.02)
    assert report["request_latency_s_with_idle_extra"] == pytest.approx(0.005 + cold, rel=0.02)
    assert fit_served(batches, bare, bare_p.bare_step_time)[0]["request_latency_s"] == \
        pytest.approx(0.005 + cold, rel=0.02)


def test_fit_served_reads_what_a_newcomer_costs_a_stream_beyond_its_prefill_step():
    """Arrival probes made by a known rule: a stream's 2 ms gaps, except the one ending with the chunk of the step
    that also answered the newcomer, which takes that context's served prefill step plus 1.5 ms (or, on one probe
    of five, 6 ms: the median does not move). The newcomer's first chunk reaches the client just before or just
    after the stream's chunk of that step: the same gap either way. A context the bare grid never prefilled is left
    out, and a probe that ran faster than its prefill step counts as 0 delay, never a gain."""
    from pdserve.sim.calibrate import arrival_delays
    bare_p = profile_from_dict(LINEAR)
    bare = [(StepShape("FULL", r, r, r, r * 65, r * 65), 0.0) for r in (1, 4)] + \
        [(StepShape("PIECEWISE", c, c, 1, c, c), 0.0) for c in (64, 200)]
    rule = lambda s: 1.4 * bare_p.bare_step_time(s) + 0.0007  # noqa: E731
    prefill = {c: rule(s) for s, _ in bare for c in (s.num_tokens,) if s.num_reqs == 1 and s.num_tokens > 1}

    def probe(c, extra, before):
        step = prefill.get(c, 0.005) + extra
        times = [1.0 + 0.002 * i for i in range(9)]
        times += [times[-1] + step + 0.002 * i for i in (0, 1, 2, 3)]
        return c, times, times[9] + (-0.0003 if before else 0.0004)

    probes = [probe(64, 0.0015, True), probe(200, 0.0015, False), probe(64, 0.006, False),
              probe(200, 0.0015, True), probe(64, 0.0015, False), probe(33, 0.009, False)]
    served, report = fit_served(synthetic_batches(rule), bare, bare_p.bare_step_time, arrivals=probes)
    assert served["arrival_delay_s"] == pytest.approx(0.0015, rel=0.02)
    assert report["arrival_probes"] == 5  # the 33-token one has no prefill shape
    got = arrival_delays(probes, lambda c: prefill.get(c))
    assert sorted(got) == pytest.approx(sorted([0.0015, 0.0015, 0.006, 0.0015, 0.0015]), rel=0.02)
    fast = [probe(64, -0.001, False)] * 3
    assert fit_served(synthetic_batches(rule), bare, bare_p.bare_step_time, arrivals=fast)[0]["arrival_delay_s"] == 0
    assert "arrival_delay_s" not in fit_served(synthetic_batches(rule), bare, bare_p.bare_step_time)[0]


@pytest.mark.parametrize("neighbours", [1, 2])
def test_fit_served_reads_the_slowdown_beside_busy_neighbours(neighbours):
    """The same synthetic batches run 1.6x slower beside `neighbours` busy servers: neighbour_scale is the ratio
    less 1, per neighbour; the lone fit is unchanged by them."""
    bare_p = profile_from_dict(LINEAR)
    bare = [(StepShape("FULL", r, r, r, r * 65, r * 65), 0.0) for r in (1, 4)] + \
        [(StepShape("PIECEWISE", c, c, 1, c, c), 0.0) for c in (64, 200)]
    rule = lambda s: 1.4 * bare_p.bare_step_time(s) + 0.0007  # noqa: E731
    lone = synthetic_batches(rule)
    served, report = fit_served(lone, bare, bare_p.bare_step_time, synthetic_batches(lambda s: 1.6 * rule(s)),
                                neighbours)
    assert served["neighbour_scale"] == pytest.approx(0.6 / neighbours, rel=0.02)
    assert report["neighbour_runs"] == 4 and report["neighbours"] == neighbours
    assert served["step_scale"] == pytest.approx(1.4, rel=0.02)
    assert fit_served(lone, bare, bare_p.bare_step_time, synthetic_batches(lambda s: 0.9 * rule(s)))[0][
        "neighbour_scale"] == 0.0  # faster beside a neighbour (noise): no slowdown, never a speed-up


def synthetic_batches(rule) -> list:
    """Served batches whose steps follow `rule` (a served step's time by shape), 5 ms outside the steps, the
    requests of a batch prefilled apart, then in lockstep, with one burst per stream."""
    batches = []
    for r in (1, 4):
        for c in (64, 200):
            streams = []
            for i in range(r):
                t = 0.005 + rule(StepShape("PIECEWISE", c, c, 1, c, c)) + 0.05 * i  # staggered prefills
                times = [t]
                for k in range(1, 12):
                    shape = StepShape("FULL", r, r, r, r * (c + k), r * (c + k))
                    t = max(t, 0.05 * (r - 1) + 0.005) + rule(shape)  # lockstep once all stream
                    times.append(t)
                times[5:8] = [times[8]] * 3  # a burst: tokens 5-7 reach the client with token 8
                streams.append(times)
            batches.append((r, c, 0.0, streams))
    return batches


@pytest.mark.timeout(180)
def test_a_served_calibration_fits_from_a_real_server(qwen3_tiny_dir, tmp_path, monkeypatch):
    """`calibrate --served` end to end: a real `pdserve serve` started and stopped, its streams fitted into a
    `served` section that loads and says how many decode runs and lone first chunks it read; the servers' log
    folder is gone after a calibration that worked (each run left one behind)."""
    import tempfile
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    d = calibrate(qwen3_tiny_dir, rows=[1, 2], contexts=[8, 24], decode_steps=8, served=True, neighbours=1,
                  served_repeats=1)
    assert not list(tmp_path.glob("pdserve-calibrate-*"))
    p = profile_from_dict(json.loads(json.dumps(d)))
    s, f = d["served"], d["fit"]["served"]
    assert s["step_scale"] > 0 and s["step_overhead_s"] >= 0 and s["request_latency_s"] >= 0
    # the grid again beside a second server running it too: compared batch by batch with the lone runs
    assert s["neighbour_scale"] >= 0 and 1 <= f["neighbour_runs"] <= 4 and f["neighbours"] == 1
    assert p.served.neighbour_scale == s["neighbour_scale"]
    # the grid's 4 batches (the 2-row ones only when their requests reached the server close enough to decode
    # together), and both lone requests' first chunks
    # the grid's 2 lone requests and LONE_PROBES more per context (repeats: the synthetic test)
    assert 2 <= f["decode_runs"] <= 4 and f["first_chunks"] == 2 + 2 * LONE_PROBES
    # the idle section, measured on the graphs engine: an extra per probed pause, never falling as pauses grow
    from pdserve.sim.calibrate import IDLE_GAPS_S
    idle = d["idle"]
    assert idle["gaps_s"] == list(IDLE_GAPS_S) and p.idle.gaps_s == IDLE_GAPS_S
    assert all(0 <= a <= b for a, b in zip(idle["extra_s"], idle["extra_s"][1:])) and 0 <= idle["decay"] <= 0.9
    assert len(s["chunk_delay_quantiles_s"]) == 101 and f["chunks"] > 0
    assert len(s["neighbour_chunk_delay_quantiles_s"]) == 101  # the same grid's chunks beside the busy server
    # a newcomer of each context into ARRIVAL_PROBES streams: every probe read (both contexts were prefilled bare)
    assert f["arrival_probes"] == 2 * ARRIVAL_PROBES and s["arrival_delay_s"] >= 0
    assert p.served.arrival_delay_s == s["arrival_delay_s"]
    shape = StepShape("FULL", 2, 2, 2, 40, 40)
    assert p.step_time(shape) == pytest.approx(s["step_scale"] * p.bare_step_time(shape) + s["step_overhead_s"])
    with pytest.raises(ValueError, match="--served needs 1 in --rows"):
        calibrate(qwen3_tiny_dir, rows=[2], contexts=[8], decode_steps=3, served=True)
    with pytest.raises(ValueError, match="--served-neighbours needs --served"):
        calibrate(qwen3_tiny_dir, rows=[1], contexts=[8], decode_steps=3, neighbours=1)


def test_chunk_delays_count_only_what_is_later_than_a_streams_typical_chunk():
    """A stream on a steady pace with +-0.5 ms of jitter and one chunk 8 ms late: no chunk but that one is late
    (the typical chunk is the jitter's later half: the steps hold the typical gap), and it by 7 ms past it (counted
    from the least late chunk, half the chunks would be 1 ms late)."""
    from pdserve.sim.calibrate import _decode_runs
    bare = [(StepShape("FULL", 1, 1, 1, 65, 65), 0.0)]
    times = [0.01 + 0.004 * k + (0.0005 if k % 2 else -0.0005) for k in range(21)]
    times[10] += 0.008
    delays = _decode_runs([(1, 64, 0.0, [times])], bare)[2][1]
    # the pace is a quadratic fitted to the chunks: the jitter bends it by ~0.2 ms at the ends, far below the 1 ms
    # that counting from the least late chunk would give half of them
    assert len(delays) == 21 and sorted(delays)[-2] < 3e-4 and max(delays) == pytest.approx(0.007, abs=1e-5)


def test_chunk_delays_follow_a_pace_that_slows_with_context():
    """Steps that grow with the context they read (4 ms to 8 ms over 30 chunks, no stall): no chunk is late. Against
    the run's mean gap the first and last chunks read late by ~7 ms (the line through a convex run lies above its
    middle); one stalled chunk is still found, by what it was stalled."""
    from pdserve.sim.calibrate import _decode_runs
    bare = [(StepShape("FULL", 1, 1, 1, 65, 65), 0.0)]
    times, t = [], 0.01
    for k in range(31):
        times.append(t)
        t += 0.004 + 0.004 * k / 30
    delays = _decode_runs([(1, 64, 0.0, [times])], bare)[2][1]
    assert len(delays) == 31 and max(delays) < 1e-6
    times[20] += 0.01
    delays = _decode_runs([(1, 64, 0.0, [times])], bare)[2][1]
    assert max(delays) == pytest.approx(0.01, abs=3e-4) and sorted(delays)[-2] < 1e-4


def test_chunk_delays_are_drawn_by_the_rows_in_flight():
    """chunk_delay_by_rows: a chunk from a step of r rows draws from the quantiles measured at the most streams not
    above r (the fewest measured where r is below them all); rows 0 (not known) and a profile without the section
    draw from the pooled quantiles."""
    served = profile_from_dict({**LINEAR, "served": {"chunk_delay_quantiles_s": [0, 0.1],
                                                     "chunk_delay_by_rows": {"16": [0, 0.016], "4": [0, 0.004],
                                                                             "2": [0, 0.002]}}}).served
    assert [served.chunk_delay(0.5, r) for r in (1, 2, 3, 4, 15, 16, 200)] == \
        pytest.approx([0.001, 0.001, 0.001, 0.002, 0.002, 0.008, 0.008])
    assert served.chunk_delay(0.5) == pytest.approx(0.05)
    # beside busy neighbours: their quantiles where the profile has them, else the lone ones stand in
    assert served.chunk_delay(0.5, 4, beside=True) == pytest.approx(0.002)
    near = profile_from_dict({**LINEAR, "served": {"chunk_delay_quantiles_s": [0, 0.1],
                                                   "chunk_delay_by_rows": {"1": [0, 0.001]},
                                                   "neighbour_chunk_delay_quantiles_s": [0, 0.3],
                                                   "neighbour_chunk_delay_by_rows": {"1": [0, 0.03]}}}).served
    assert [near.chunk_delay(0.5, 1, b) for b in (False, True)] == pytest.approx([0.0005, 0.015])
    assert near.chunk_delay(0.5, 0, True) == pytest.approx(0.15)
    assert profile_from_dict({**LINEAR, "served": {"chunk_delay_quantiles_s": [0, 0.1]}}).served.chunk_delay(
        0.5, 4) == pytest.approx(0.05)


def test_fit_served_keeps_delay_quantiles_per_batch_size_with_enough_chunks():
    """Streams of 1-row batches on pace, 3-row batches' streams each with a stall: the 1-row quantiles are all 0,
    the 3-row ones hold the stall, the pooled ones both; a batch size with fewer than DELAY_MIN_CHUNKS chunks
    (2 rows, one batch) gets none of its own."""
    from pdserve.sim.calibrate import DELAY_MIN_CHUNKS, fit_served
    bare_p = profile_from_dict(LINEAR)
    bare = [(StepShape("FULL", r, r, r, r * 65, r * 65), 0.0) for r in (1, 2, 3)] + \
        [(StepShape("PIECEWISE", 64, 64, 1, 64, 64), 0.0)]
    batches = []
    for r, count in ((1, 8), (3, 4), (2, 1)):
        for _ in range(count):
            streams = []
            for i in range(r):
                times = [0.01 + 0.004 * k for k in range(17)]
                if r == 3:
                    times[8 + i] += 0.02
                streams.append(times)
            batches.append((r, 64, 0.0, streams))
    served, report = fit_served(batches, bare, bare_p.bare_step_time)
    by = served["chunk_delay_by_rows"]
    assert sorted(by) == ["1", "3"] and 8 * 17 >= DELAY_MIN_CHUNKS > 17
    assert max(by["1"]) < 1e-9 and by["3"][-1] == pytest.approx(0.02, abs=1e-3)
    assert served["chunk_delay_quantiles_s"][-1] == pytest.approx(0.02, abs=1e-3)
    assert report["chunks"] == 17 * (8 + 12 + 2)
    assert profile_from_dict({**LINEAR, "served": served}).served.chunk_delay(0.999, 1) < 1e-9


def test_fit_served_reads_chunk_delays_beside_busy_neighbours_apart():
    """The grid's streams alone on pace, beside a busy neighbour each with a 20 ms stall: the lone delays are 0,
    the neighbour ones hold the stall (pooled and per batch size)."""
    from pdserve.sim.calibrate import fit_served
    bare_p = profile_from_dict(LINEAR)
    bare = [(StepShape("FULL", 1, 1, 1, 65, 65), 0.0), (StepShape("PIECEWISE", 64, 64, 1, 64, 64), 0.0)]

    def batches(stall: float) -> list:
        out = []
        for n in range(8):
            times = [0.01 + 0.004 * k for k in range(17)]
            times[4 + n] += stall
            out.append((1, 64 if n % 2 else 128, 0.0, [times]))
        return out
    served, _ = fit_served(batches(0.0), bare, bare_p.bare_step_time, batches(0.02), 1)
    assert max(served["chunk_delay_quantiles_s"]) < 1e-9 and max(served["chunk_delay_by_rows"]["1"]) < 1e-9
    assert served["neighbour_chunk_delay_quantiles_s"][-1] == pytest.approx(0.02, abs=1e-3)
    assert served["neighbour_chunk_delay_by_rows"]["1"][-1] == pytest.approx(0.02, abs=1e-3)
    assert "neighbour_chunk_delay_quantiles_s" not in fit_served(batches(0.0), bare, bare_p.bare_step_time)[0]


def test_a_batch_size_gets_quantiles_of_its_own_from_exactly_delay_min_chunks():
    """DELAY_MIN_CHUNKS is the edge both ways: that many chunks give a batch size its own quantiles, one fewer
    leaves it to the pooled ones, which every chunk is in."""
    from pdserve.sim.calibrate import DELAY_MIN_CHUNKS, DELAY_QUANTILES, _delay_fields
    got = _delay_fields({3: [0.001] * DELAY_MIN_CHUNKS, 5: [0.002] * (DELAY_MIN_CHUNKS - 1)}, "neighbour_")
    assert sorted(got) == ["neighbour_chunk_delay_by_rows", "neighbour_chunk_delay_quantiles_s"]
    assert list(got["neighbour_chunk_delay_by_rows"]) == ["3"]
    assert got["neighbour_chunk_delay_by_rows"]["3"] == pytest.approx([0.001] * DELAY_QUANTILES)
    pooled = got["neighbour_chunk_delay_quantiles_s"]
    assert len(pooled) == DELAY_QUANTILES and pooled[0] == pytest.approx(0.001) and pooled[-1] == pytest.approx(0.002)
    assert _delay_fields({}, "") == {"chunk_delay_quantiles_s": [], "chunk_delay_by_rows": {}}


@pytest.mark.timeout(120)
def test_the_calibration_keeps_each_prefill_steps_median_over_repeats(qwen3_tiny_dir):
    """A grid batch's prefill steps are timed PREFILL_REPEATS times and each step's median kept (calibrate.py
    `_prefills`): one slow reading (here every step of the first run holds 0.2 s more, as a cold first replay is
    slow) is not what the profile learns; and `measure` keeps those medians in place of the grid's one timing of
    each prefill step, so no prefill shape is fitted twice."""
    import time

    from pdserve.config import EngineConfig
    from pdserve.core.engine import LLMEngine
    from pdserve.sim.calibrate import PREFILL_REPEATS, _prefills, measure, spy_steps
    assert PREFILL_REPEATS == 3
    engine = LLMEngine(EngineConfig.from_kwargs(qwen3_tiny_dir, device="cpu", max_model_len=64,
                                                max_num_batched_tokens=32, max_num_seqs=4))
    seen, step, add = spy_steps(engine), engine.step, engine.add_request
    adds, first_run = [0], [0]

    def counting_add(*a, **kw):
        adds[0] += 1
        return add(*a, **kw)

    def first_run_slow():
        out = step()
        if adds[0] <= first_run[0]:  # the first run's requests only
            time.sleep(0.2)
        return out
    engine.add_request, engine.step = counting_add, first_run_slow
    shapes = []
    for r, c in [(1, 9), (2, 24), (1, 33)]:  # 33 tokens: two chunks of a 32-token budget; 2 x 24: 32 + 16
        adds[0], first_run[0] = 0, r
        got = _prefills(engine, [(r, c)], seen, PREFILL_REPEATS)
        assert all(t < 0.1 for _, t in got), got
        shapes += [(s.num_tokens, s.num_reqs) for s, _ in got]
    assert shapes == [(9, 1), (32, 2), (16, 1), (32, 1), (1, 1)], shapes
    engine.shutdown()

    samples, _ = measure(qwen3_tiny_dir, [1, 2], [8, 24], 3, eager=True)
    prefill = [(s.num_tokens, s.num_reqs) for s, _ in samples if s.num_tokens > s.num_reqs]
    assert sorted(prefill) == sorted(set(prefill)) and len(prefill) >= 4, prefill
