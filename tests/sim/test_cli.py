"""`pdserve sim` on the command line: bad traces and flags refused with one line naming the line and field (exit 2,
no traceback), --help on every flag, and a small run that writes bench pd's files."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pdserve.cli import main

from tests.sim.conftest import LINEAR

GOOD = '{"arrival_time": 0.0, "prompt_len": 40, "output_len": 8}'


@pytest.fixture
def profile(tmp_path):
    f = tmp_path / "profile.json"
    f.write_text(json.dumps(LINEAR))
    return str(f)


def _err(capsys, argv) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1, err
    return err


@pytest.mark.parametrize("line,named", [
    ('{"arrival_time": 0.5, "prompt_len": 0, "output_len": 8}', ":2: prompt_len: must be an integer >= 1, got 0"),
    ('{"arrival_time": -1, "prompt_len": 5, "output_len": 8}', ":2: arrival_time: must be a number of seconds >= 0"),
    ('{"arrival_time": "soon", "prompt_len": 5, "output_len": 8}', ":2: arrival_time: must be a number"),
    ('{"prompt_len": 5, "output_len": 8}', ":2: arrival_time: missing"),
    ('{"arrival_time": 1, "prompt_len": 5}', ":2: output_len: missing"),
    ('{"arrival_time": 1, "prompt_len": 5, "output_len": 2.5}', ":2: output_len: must be an integer >= 1"),
    ('{"arrival_time": 1, "prompt_len": 5, "output_len": 2, "prompt": "hi"}', ":2: prompt: unknown field"),
    ('{"arrival_time": 1, "prompt_len": 5, "output_len": 2, "prefix_group": "a", "prefix_len": 6}',
     ":2: prefix_len: 6 is longer than prompt_len 5"),
    ('{"arrival_time": 1, "prompt_len": 5, "output_len": 2, "prefix_len": 3}', ":2: prefix_len: needs a prefix_group"),
    ('{"arrival_time": 1, "prompt_len": 5, "output_len": 2, "prefix_group": [1]}', ":2: prefix_group: must be"),
    ('{"arrival_time": 1, "prompt_len": 5, "output_len": 2, "request_id": "sim-0"}',
     ":2: request_id: 'sim-0' is used by line 1 too"),
    ('{"arrival_time": 1, "prompt_len": 5', ":2: not JSON"),
    ('[1, 2, 3]', ":2: expected a JSON object, got list"),
])
def test_bad_trace_lines_are_named(tmp_path, capsys, profile, line, named):
    trace = tmp_path / "trace.jsonl"
    trace.write_text(GOOD + "\n" + line + "\n")
    err = _err(capsys, ["sim", "--profile", profile, "--trace", str(trace), "--result-dir", str(tmp_path / "r")])
    assert err.startswith("pdserve sim: error: --trace ") and str(trace) + named in err, err


def test_empty_and_missing_traces(tmp_path, capsys, profile):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    assert "no requests" in _err(capsys, ["sim", "--profile", profile, "--trace", str(empty)])
    assert "No such file" in _err(capsys, ["sim", "--profile", profile, "--trace", str(tmp_path / "nope.jsonl")])
    binary = tmp_path / "bin.jsonl"
    binary.write_bytes(b"\xff\xfe\x00")
    assert "not UTF-8" in _err(capsys, ["sim", "--profile", profile, "--trace", str(binary)])


@pytest.mark.parametrize("argv,named", [
    ([], "--profile is required"),
    (["--deployment", "1p0d"], "--deployment '1p0d'"),
    (["--deployment", "1p1d", "--nodes", "2"], "--nodes is for collocated"),
    (["--request-rate", "0"], "--request-rate: every rate must be > 0"),
    (["--spec-acceptance", "1.5"], "--spec-acceptance must be in [0, 1]"),
    (["--kv-bandwidth-gb-s", "0"], "--kv-bandwidth-gb-s must be a number > 0"),
    (["--kv-load-wait-ms", "1000.5"], "--kv-load-wait-ms must be in [0, 1000]"),
    (["--router-latency-ms", "-1"], "--router-latency-ms must be in [0, 1000]"),
    (["--speculative-config", "{\"method\": \"eagle\"}"], "--speculative-config:"),
    (["--max-num-seqs", "0"], "max_num_seqs must be >= 1"),
    (["--gpu-memory-utilization", "0.9"], "--gpu-memory-utilization: a simulated node's KV cache"),
    (["--cudagraph-metrics"], "--cudagraph-metrics: a simulated run's graph counts"),
    (["--async-scheduling"], "--async-scheduling / --no-async-scheduling: a simulated node steps"),
    (["--no-async-scheduling"], "--async-scheduling / --no-async-scheduling: a simulated node steps"),
    (["--num-gpu-blocks-override", "4", "--max-model-len", "1024"], "cannot hold one max_model_len (1024)"),
])
def test_bad_flags_are_named(tmp_path, capsys, profile, argv, named):
    argv = (["--profile", profile] if argv else []) + argv + ["--result-dir", str(tmp_path / "r")]
    assert named in _err(capsys, ["sim", *argv])


def test_random_flags_with_a_trace_are_refused(tmp_path, capsys, profile):
    trace = tmp_path / "trace.jsonl"
    trace.write_text(GOOD + "\n")
    err = _err(capsys, ["sim", "--profile", profile, "--trace", str(trace), "--request-rate", "4"])
    assert "--request-rate is for the random generator" in err


def test_bad_profile_is_named(tmp_path, capsys):
    bad = tmp_path / "p.json"
    bad.write_text(json.dumps({**LINEAR, "type": "linear", "coefficients": {**LINEAR["coefficients"],
                                                                             "per_row_s": -1}}))
    err = _err(capsys, ["sim", "--profile", str(bad), "--num-prompts", "2"])
    assert "coefficients.per_row_s: must be a number >= 0" in err


def test_help_explains_every_flag():
    out = subprocess.run([sys.executable, "-m", "pdserve.cli", "sim", "--help"], capture_output=True, text=True,
                         check=True).stdout
    for flag in ("--trace", "--profile", "--deployment", "--nodes", "--router-policy", "--kv-bandwidth-gb-s",
                 "--kv-latency-ms", "--request-rate", "--random-input-len", "--full-graph-rule", "--result-dir",
                 "--pd-first-token", "--step-by-step", "calibrate"):
        assert flag in out, flag
    out = subprocess.run([sys.executable, "-m", "pdserve.cli", "sim", "calibrate", "--help"], capture_output=True,
                         text=True, check=True).stdout
    for flag in ("--model", "--rows", "--context-lens", "--decode-steps", "--out"):
        assert flag in out, flag


def test_a_trace_run_writes_bench_pds_files(tmp_path, capsys, profile):
    trace = tmp_path / "trace.jsonl"
    trace.write_text("\n".join(json.dumps({"arrival_time": 0.01 * i, "prompt_len": 30 + i, "output_len": 5 + i % 3,
                                           "prefix_group": "g", "prefix_len": 16}) for i in range(12)) + "\n")
    out = tmp_path / "res"
    assert main(["sim", "--profile", profile, "--trace", str(trace), "--deployment", "1p1d", "--result-dir",
                 str(out), "--quiet"]) == 0
    files = sorted(p.name for p in out.iterdir())
    assert "summary.json" in files and "table.txt" in files and "bench_pd.png" in files
    run = json.loads((out / next(f for f in files if f.startswith("default_rate"))).read_text())
    assert run["completed"] == 12 and run["failed"] == 0 and run["dataset"] == "trace"
    assert run["output_lens"] == [5 + i % 3 for i in range(12)]
    assert len(run["ttfts"]) == len(run["itls"]) == 12 and all(len(itl) == n - 1 for itl, n in
                                                                zip(run["itls"], run["output_lens"]))
    # the graph share is the decode node's, as bench serve reads it from D's /metrics
    assert run["graph"]["full_steps"] + run["graph"]["non_full_steps"] == \
        next(n["steps"] for n in run["sim"]["nodes"] if n["role"] == "decode")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["simulated"] and summary["rows"][0]["arm"] == "default"
    assert "1P1D default" in (out / "table.txt").read_text()


def test_the_load_wait_flag_reaches_d(tmp_path, profile):
    """--kv-load-wait-ms is D's wait for the loads it started early: with a 3 ms pull on a D that is decoding, a 5 ms
    wait takes the load into the step it was started for, none leaves it to a later step (TTFTs move)."""
    trace = tmp_path / "trace.jsonl"
    trace.write_text("\n".join(json.dumps({"arrival_time": 0.004 * i, "prompt_len": 33, "output_len": 30})
                               for i in range(8)) + "\n")
    ttfts = {}
    for wait in ("0", "5"):
        out = tmp_path / f"w{wait}"
        assert main(["sim", "--profile", profile, "--trace", str(trace), "--deployment", "1p1d", "--kv-latency-ms",
                     "3", "--kv-load-wait-ms", wait, "--result-dir", str(out), "--quiet"]) == 0
        run = json.loads(next(out.glob("default_rate*.json")).read_text())
        ttfts[wait] = run["ttfts"]
    assert ttfts["0"][0] == ttfts["5"][0] and ttfts["0"] != ttfts["5"], ttfts  # the first finds D idle
