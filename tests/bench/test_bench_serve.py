"""bench serve: the client keeps up with its schedule against a null endpoint; flag errors name the flag."""
import json
import subprocess
import sys
import time

import httpx
import pytest

from tests.server_harness import REPO, free_port


@pytest.fixture(scope="module")
def null_server():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tests.null_server", str(port)], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                if time.monotonic() > deadline:
                    raise
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


def bench(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "pdserve.cli", "bench", "serve", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


def test_client_keeps_up_at_200_req_per_s(null_server, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"p{i}"}) + "\n" for i in range(50)))
    out = tmp_path / "r.json"
    r = bench("--base-url", null_server, "--model", "null", "--dataset", "jsonl", "--dataset-path", str(prompts),
              "--num-prompts", "1000", "--request-rate", "200", "--seed", "0", "--warmup", "20", "--disable-tqdm",
              "--save-result", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["completed"] == 1000 and res["failed"] == 0
    assert res["total_output_tokens"] == 2000  # from the usage chunk
    assert res["max_output_tokens_per_s"] >= 200 and res["max_concurrent_requests"] >= 1  # vLLM's peak keys
    assert res["request_throughput"] == pytest.approx(200, rel=0.05), res["request_throughput"]
    # p90, not p99: one stall of this 2-core VM (100+ ms seen under a test suite) holds ~20 of the 1000 requests
    # (2%), while a client that cannot keep up lags on most of them (and misses the rate above).
    assert res["ttft_ms"]["p90"] < 5.0, res["ttft_ms"]
    assert res["send_lag_ms"]["p90"] < 5.0, res["send_lag_ms"]  # requests left on schedule
    assert "Serving Benchmark Result" in r.stdout and "Successful requests:" in r.stdout
    assert res["graph"] is None and "Decode graph steps" not in r.stdout  # a target without pdserve's counters


def test_chat_endpoint_skips_the_role_chunk(null_server, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "hi"}) + "\n")
    out = tmp_path / "r.json"
    r = bench("--base-url", null_server, "--model", "null", "--endpoint", "/v1/chat/completions", "--dataset",
              "jsonl", "--dataset-path", str(prompts), "--num-prompts", "20", "--request-rate", "100",
              "--disable-tqdm", "--save-result", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["completed"] == 20 and res["total_output_tokens"] == 40
    assert all(len(gaps) == 1 for gaps in res["itls"])  # 2 content chunks: 1 gap, role chunk skipped


@pytest.mark.parametrize("args, flag", [
    (["--dataset", "jsonl"], "--dataset-path"),
    (["--num-prompts", "0"], "--num-prompts"),
    (["--goodput", "foo:1"], "--goodput"),
    (["--dataset", "random"], "--tokenizer"),
    (["--tokenizer", "/nonexistent"], "--tokenizer"),
    (["--random-prefix-len", "-1"], "--random-prefix-len"),
    (["--dataset", "jsonl", "--dataset-path", "p.jsonl", "--random-prefix-len", "8"], "--random-prefix-len"),
])
def test_bad_flags_name_the_flag(args, flag):
    r = bench("--base-url", "http://127.0.0.1:9", "--model", "m", *args, timeout=60)
    assert r.returncode == 2 and flag in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_unreachable_target_counts_failures(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "x"}) + "\n")
    r = bench("--base-url", f"http://127.0.0.1:{free_port()}", "--model", "m", "--dataset", "jsonl",
              "--dataset-path", str(prompts), "--num-prompts", "3", "--disable-tqdm", timeout=60)
    assert r.returncode == 1 and "Failed requests:" in r.stdout and "Traceback" not in r.stderr
    assert "ClientConnectorError" in r.stdout or "Connect" in r.stdout


def test_signals_held_through_the_tokenizer_import():
    """SIGTERM sent while the client's tokenizer loads runs its handler only once the load is over (an interrupt
    inside transformers' first import can leave numpy half-imported, or be swallowed), also with another thread
    alive (which a masked signal would be delivered to)."""
    import os
    import signal
    import threading

    from pdserve.bench import serve

    seen = []
    old = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    done = threading.Event()
    other = threading.Thread(target=done.wait)
    other.start()
    try:
        with serve._signals_deferred():
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(100_000):  # bytecode boundaries at which a pending handler would run
                pass
            assert seen == []
        for _ in range(1000):
            if seen:
                break
        assert seen == [signal.SIGTERM]
        assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL  # the handler in place before, back
    finally:
        done.set()
        other.join()
        signal.signal(signal.SIGTERM, old)
