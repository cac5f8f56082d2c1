"""Shared fixtures: tiny models of both architectures, built once per session in a private PDSERVE_HOME."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Thread counts stay as started: the CPU thread governor (worker/cpu_threads.py) would drop threads while the
# tests' own servers are busy, and a GEMM's float32 rounding may change with its thread count, which tests that
# compare two runs token for token must not see. tests/worker/test_cpu_threads.py covers the governor.
os.environ.setdefault("PDSERVE_ADAPTIVE_THREADS", "0")


def pytest_sessionstart(session):
    # before any test's transformers oracle: MKL's first threaded vector-math call can be ~1e-4 off (layers.py)
    from pdserve.model.layers import _warm_vml
    _warm_vml()


@pytest.fixture(scope="session")
def pdserve_home(tmp_path_factory):
    home = os.environ.get("PDSERVE_TEST_HOME") or str(tmp_path_factory.mktemp("pdserve_home"))
    old = os.environ.get("PDSERVE_HOME")
    os.environ["PDSERVE_HOME"] = home
    yield home
    if old is None:
        os.environ.pop("PDSERVE_HOME", None)
    else:
        os.environ["PDSERVE_HOME"] = old


@pytest.fixture(scope="session")
def tiny_models(pdserve_home):
    """{"qwen3": dir, "llama": dir}: tiny random models (llama with Llama-3 rope scaling, qwen3 with tied
    embeddings)."""
    from pdserve.model.make_model import ensure_model
    return {arch: str(ensure_model(arch, "tiny", 0)) for arch in ("qwen3", "llama")}


@pytest.fixture(scope="session")
def qwen3_tiny(tiny_models):
    return tiny_models["qwen3"]


@pytest.fixture(scope="session")
def reference_f64(qwen3_tiny):
    """The collocated float64 server the P/D files compare their outputs against (their P and D carry F64_COMMON and
    more). One for the session: each file started its own, ~4 s of CPU each on 2 cores, and only reads it. Started,
    not yet waited for: a file's fixture waits for it beside its own servers, which start meanwhile."""
    from tests.server_harness import F64_COMMON, ServerProcess
    srv = ServerProcess(qwen3_tiny, *F64_COMMON)
    try:
        yield srv
    finally:
        srv.cleanup()
