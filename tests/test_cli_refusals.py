"""Bad command lines: each is a one-line `pdserve <command>: error:` naming the flag or file, exit code 2, before a
port opens or a weight loads; never a traceback, a server that starts on a wrong value, or one that listens on
every interface. In process, with the server's start replaced by a failure (a case that got through would serve)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pdserve.cli import main

TCP = {"kv_connector": "TcpConnector", "kv_role": "kv_consumer"}


@pytest.fixture(autouse=True)
def no_server(monkeypatch):
    """What passed every check would start serving: fail the test instead of hanging it."""
    import uvicorn

    from pdserve.serve import api_server

    def started(*a, **kw):
        raise AssertionError("the command line was accepted: a server would start")
    monkeypatch.setattr(api_server._Server, "make", started)
    monkeypatch.setattr(uvicorn, "run", started)


def refused(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


def kv(**fields) -> list[str]:
    return ["--kv-transfer-config", json.dumps({**TCP, **fields})]


SERVE = [
    (["--host", ""], "host must not be empty"),
    (["--api-key", " "], "api_key is empty"),
    (["--served-model-name", ""], "served_model_name"),
    (["--shutdown-timeout", "nan"], "shutdown_timeout"),
    (["--max-prompt-chars", "0"], "max_prompt_chars must be >= 1"),
    (kv(kv_connector_extra_config={"max_connections": 0}), "max_connections must be an integer >= 1"),
    (["--device", "bogus"], "device must be"),
    (["--device", ""], "device must be"),
    (["--device", "cuda"], "device 'cuda'"),  # a CPU-only torch here; on a GPU machine: past the device count
    (["--kv-cache-memory-gb", "inf"], "kv_cache_memory_gb"),
    (["--kv-transfer-config", "[]"], "must be a JSON object"),
    (["--kv-transfer-config", "null"], "must be a JSON object"),
    (kv(kv_peers="127.0.0.1:14579"), "kv_peers must be a list"),  # was a tuple of characters: every load refused
    (kv(kv_peers=["nonsense"]), "kv_peers must be a list"),
    (kv(kv_peers=["127.0.0.1:0"]), "kv_peers must be a list"),
    (kv(kv_peers=[" 127.0.0.1:5"]), "kv_peers must be a list"),
    (kv(kv_auth_token=5), "kv_auth_token must be a string"),
    (kv(kv_advertise_host=5), "kv_advertise_host must be a string"),
    (kv(kv_server_nice="x"), "kv_server_nice must be an integer"),
    (kv(kv_connector_extra_config="x"), "kv_connector_extra_config must be an object"),
    (["--kv-transfer-config", json.dumps({"kv_connector": "MultiConnector", "kv_role": "kv_consumer",
                                          "connectors": [1]})], "connectors must be a list of connector objects"),
]


@pytest.mark.parametrize("flags,why", SERVE, ids=[f"{' '.join(f)[:40]}" for f, _ in SERVE])
def test_serve_refuses(qwen3_tiny, capsys, flags, why):
    if flags[:2] == ["--device", "cuda"]:
        import torch
        if torch.cuda.is_available():
            flags = ["--device", f"cuda:{torch.cuda.device_count()}"]
            why = "CUDA device(s) are visible"
    err = refused(["serve", str(qwen3_tiny), "--port", "0", *flags], capsys)
    assert err.startswith("pdserve serve: error:") and why in err, err


def test_serve_checks_the_model_directory_first(qwen3_tiny, tmp_path, capsys):
    """Before: four chained tracebacks (a missing path read as a hub repo id), or transformers' tokenizer text."""
    qwen3_tiny = Path(qwen3_tiny)
    assert "does not exist" in refused(["serve", str(tmp_path / "nope")], capsys)
    assert "has no config.json" in refused(["serve", str(tmp_path)], capsys)
    shutil.copy(qwen3_tiny / "config.json", tmp_path / "config.json")
    assert "has no tokenizer" in refused(["serve", str(tmp_path)], capsys)
    bad = tmp_path / "bad"
    shutil.copytree(qwen3_tiny, bad)
    (bad / "generation_config.json").write_text("{oops")
    err = refused(["serve", str(bad)], capsys)
    assert "generation_config.json: not valid JSON" in err, err
    cfg = json.loads((qwen3_tiny / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": -1}))
    assert "max_position_embeddings must be a positive integer" in refused(["serve", str(bad)], capsys)


def test_generate_names_the_weights_file_it_cannot_read(qwen3_tiny, tmp_path, capsys):
    qwen3_tiny = Path(qwen3_tiny)
    bad = tmp_path / "bad"
    shutil.copytree(qwen3_tiny, bad)
    (bad / "model.safetensors").write_bytes((qwen3_tiny / "model.safetensors").read_bytes()[:4])
    err = refused(["generate", "--model", str(bad), "--prompt", "x"], capsys)
    assert "model.safetensors: cannot read the weights" in err, err


SIZES = [
    (["--num-gpu-blocks-override", "100000000000"], "num_gpu_blocks_override: a KV cache of 100000000000 blocks"),
    (["--kv-cache-memory-gb", "100000", "--max-num-seqs", "100000"], "kv_cache_memory_gb: a KV cache of"),
    (["--max-num-seqs", "1000000000"], "does not fit in the cpu device's free memory"),
    (["--seed", "99999999999999999999"], "seed must be in"),  # was "Overflow when unpacking long long"
]


@pytest.mark.parametrize("flags, why", SIZES, ids=[" ".join(f) for f, _ in SIZES])
def test_sizes_beyond_the_machine_are_refused_naming_the_flag(qwen3_tiny, capsys, flags, why):
    """Was the allocator's traceback (a 1.6 PB tensor, a 954 GiB int64 array)."""
    err = refused(["generate", "--model", str(qwen3_tiny), "--prompt", "x", "--max-tokens", "1", *flags], capsys)
    assert why in err, err


ROUTER = [
    (["--port", "70000"], "--port must be in [0, 65535]"),  # uvicorn bound 70000 - 65536 = 4464
    (["--port", "-1"], "--port must be in [0, 65535]"),
    (["--health-interval", "0"], "--health-interval must be a positive"),  # a busy loop
    (["--health-interval", "nan"], "--health-interval must be a positive"),
    (["--host", ""], "--host must not be empty"),
    (["--max-body-bytes", "0"], "--max-body-bytes must be >= 1"),
    (["--prefill", "notaurl"], "--prefill: 'notaurl' is not a node URL (the scheme"),
    (["--decode", "ftp://x"], "--decode: 'ftp://x' is not a node URL"),
    (["--decode", "http://127.0.0.1:99999"], "the port must be in 1..65535"),
    (["--prefill", "http://127.0.0.1:8100/v1"], "without /v1"),  # would post to /v1/v1/completions
    (["--prefill", "http://127.0.0.1:8100/v1/"], "without /v1"),
    (["--decode", "http://127.0.0.1:8200#x"], "no query or fragment"),  # /health would go into the fragment
    (["--decode", "http://127.0.0.1:8200?a=1"], "no query or fragment"),
]


def test_router_takes_a_node_behind_a_path_prefix():
    from types import SimpleNamespace

    from pdserve.router.cli import check_router_args
    check_router_args(SimpleNamespace(host="127.0.0.1", port=8000, health_interval=2.0, max_body_bytes=1,
                                      max_migrations=0, pd_first_token="replay",
                                      prefill=["http://gw:80/node1/", "http://[::1]:8100"],
                                      decode=["https://gw/pool/d1"]))


@pytest.mark.parametrize("flags,why", ROUTER, ids=[" ".join(f) for f, _ in ROUTER])
def test_router_refuses(capsys, flags, why):
    base = {"--prefill": ["http://127.0.0.1:8100"], "--decode": ["http://127.0.0.1:8200"]}
    argv = ["router"]
    for flag, value in base.items():
        argv += [flag, *(flags[1:] if flags[0] == flag else value)]
    argv += [] if flags[0] in base else flags
    err = refused(argv, capsys)
    assert err.startswith("pdserve router: error:") and why in err, err


def test_router_log_level_is_a_choice(capsys):
    with pytest.raises(SystemExit) as e:
        main(["router", "--prefill", "http://a:1", "--decode", "http://b:2", "--log-level", "verbose"])
    assert e.value.code == 2 and "invalid choice: 'verbose'" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_help_states_each_default_once(command, capsys):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    out = " ".join(capsys.readouterr().out.split())
    flags = out.split(" --")[1:]
    assert len(flags) > 20
    for text in flags:
        assert text.lower().count("(default:") <= 1, text
    assert "(default: None)" not in out


BENCH_SERVE = [
    (["--request-rate", "nan"], "--request-rate must be > 0"),  # was sent all at once, as inf
    (["--burstiness", "nan"], "--burstiness must be"),
    (["--seed", "-1"], "--seed must be in"),  # was numpy's "expected non-negative integer"
    (["--request-timeout", "0"], "--request-timeout must be"),  # was every request failing at once
    (["--request-timeout", "nan"], "--request-timeout must be"),
    (["--temperature", "-1"], "--temperature must be"),  # was every request a 400
    (["--metric-percentiles", "0"], "--metric-percentiles"),
    (["--percentile-metrics", "ttft,goodput"], "--percentile-metrics"),
    (["--dataset-path", "/tmp/prompts.jsonl"], "--dataset-path is read only with --dataset jsonl"),  # was ignored
    (["--save-result", "."], "is a directory"),  # was found only after the whole run
]


@pytest.mark.parametrize("flags, why", BENCH_SERVE, ids=[" ".join(f) for f, _ in BENCH_SERVE])
def test_bench_serve_refuses_before_any_request(qwen3_tiny, capsys, flags, why):
    # an unreachable target: a case that got through would fail its requests with exit 1, not refuse with 2
    err = refused(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--model", "m", "--tokenizer",
                   str(qwen3_tiny), "--num-prompts", "2", "--disable-tqdm", *flags], capsys)
    assert err.startswith("pdserve bench serve: error:") and why in err, err


def test_bench_save_result_under_a_file_is_refused_up_front(qwen3_tiny, tmp_path, capsys):
    (tmp_path / "f").write_text("")
    err = refused(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--model", "m", "--tokenizer",
                   str(qwen3_tiny), "--num-prompts", "2", "--disable-tqdm", "--save-result",
                   str(tmp_path / "f" / "r.json")], capsys)
    assert "is a file, not a directory" in err, err


@pytest.mark.parametrize("flags, why", [
    (["--ready-timeout", "0"], "--ready-timeout must be"),
    (["--ready-timeout", "nan"], "--ready-timeout must be"),
    (["--seed", "-1"], "--seed must be in"),
    (["--burstiness", "nan"], "--burstiness must be"),
    (["--kv-transfer-extra", "{nope"], "--kv-transfer-extra: not valid JSON"),
    (["--kv-transfer-extra", "[1]"], "--kv-transfer-extra must be a JSON object"),
    (["--kv-transfer-extra", '{"kv_load_wait_ms": -1}'], "--kv-transfer-extra: kv_transfer_config.kv_load_wait_ms"),
    (["--kv-transfer-extra", '{"kv_nope": 1}'], "--kv-transfer-extra: kv_transfer_config: unknown field"),
    (["--arms", "default,first-token-early", "--router", "vllm-router"], "first-token-early needs --router pdserve"),
    (["--arms", "first-token-late", "--router", "vllm-router"], "first-token-late needs --router pdserve"),
    (["--arms", "first-token-later"], "unknown arm 'first-token-later'"),
], ids=lambda x: " ".join(x) if isinstance(x, list) else None)
def test_bench_pd_refuses_before_any_arm_starts(qwen3_tiny, capsys, flags, why):
    err = refused(["bench", "pd", "--model", str(qwen3_tiny), *flags], capsys)
    assert why in err, err


def test_bench_pd_result_dir_that_is_a_file(qwen3_tiny, tmp_path, capsys):
    (tmp_path / "f").write_text("")
    err = refused(["bench", "pd", "--model", str(qwen3_tiny), "--result-dir", str(tmp_path / "f")], capsys)
    assert "--result-dir" in err, err


def test_null_kv_fields_are_their_defaults():
    """A config dumped with every field (nulls included) is read as if the nulls were left out."""
    from pdserve.kv_transfer_config import KVTransferConfig
    nulls = {k: None for k in ("kv_peers", "kv_server_nice", "kv_connector_extra_config", "kv_port", "connectors")}
    c = KVTransferConfig.from_dict({**TCP, **nulls})
    assert (c.kv_peers, c.kv_server_nice, c.kv_connector_extra_config, c.kv_port) == ((), 12, {}, 14579)
    with pytest.raises(ValueError, match="missing field 'kv_role'"):
        KVTransferConfig.from_dict({**TCP, "kv_role": None})


def test_a_config_without_max_position_embeddings_loads(qwen3_tiny, tmp_path):
    from pdserve.model.hf_config import read_hf_config
    cfg = json.loads((Path(qwen3_tiny) / "config.json").read_text())
    cfg.pop("max_position_embeddings")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert "max_position_embeddings" not in read_hf_config(tmp_path)


def test_an_allocation_failure_without_a_message_is_still_one_line(qwen3_tiny, capsys, monkeypatch):
    from pdserve.core import engine

    def bare(*a, **kw):
        raise MemoryError()
    monkeypatch.setattr(engine, "ModelRunner", bare)
    err = refused(["generate", "--model", str(qwen3_tiny), "--prompt", "x"], capsys)
    assert "does not fit in the cpu device's free memory (MemoryError)" in err and "kv_cache_memory_gb" in err, err


def test_bench_pd_seed_leaves_room_for_every_rate(qwen3_tiny, capsys):
    err = refused(["bench", "pd", "--model", str(qwen3_tiny), "--rates", "1,2,4", "--seed", str(2 ** 32 - 2000)],
                  capsys)
    assert "--seed must be in [0, 2**32 - 1000 x 3 rates)" in err, err


def test_only_the_named_command_is_built_and_help_lists_them_all():
    """`pdserve serve` builds its own parser alone: the router's and the bench's would import their modules into
    every server process (~0.5 s a start). `pdserve --help` still lists every command with its help line."""
    import subprocess
    import sys
    probe = ("import sys; from pdserve.cli import build_parser; build_parser(['serve', 'm']); "
             "print(sorted(m for m in sys.modules if m.startswith(('pdserve.router', 'pdserve.bench', "
             "'pdserve.sim'))))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out
    helped = subprocess.run([sys.executable, "-m", "pdserve.cli", "--help"], capture_output=True, text=True).stdout
    from pdserve.cli import COMMANDS
    for name, (help_, *_rest) in COMMANDS.items():
        assert name in helped and help_.split()[0] in helped, (name, helped)
