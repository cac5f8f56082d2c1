"""The start-up heap is frozen out of the collector's reach (serve/gc_heap.py) in the API server before its first
request, and in the router at start: a full collection then walks only what serving allocated."""
from __future__ import annotations

import gc

import pytest

from pdserve.serve.gc_heap import freeze_startup_heap


@pytest.fixture
def unfrozen():
    gc.unfreeze()  # this process's earlier tests may have frozen their own start-up
    yield
    gc.unfreeze()


def test_freezing_moves_what_lives_out_of_the_collectors_reach(unfrozen):
    kept = [[i] for i in range(1000)]
    n = freeze_startup_heap()
    assert n == gc.get_freeze_count() >= len(kept)
    assert sum(len(gc.get_objects(g)) for g in range(3)) < 1000  # what lives is no longer tracked by any generation


def _tracked(obj) -> bool:
    """In one of the collector's generations: not frozen."""
    return any(o is obj for g in range(3) for o in gc.get_objects(g))


def test_the_api_server_freezes_before_it_serves(unfrozen, qwen3_tiny):
    """What the server built once its engine was up (its OpenAI serving layer) is frozen before it serves (the
    in-process engine froze its own start-up before that: the serving layer did not exist yet)."""
    from tests.serve.test_failure_paths_serving import server
    assert gc.get_freeze_count() == 0
    with server(qwen3_tiny) as c:  # healthy: on_engine_ready has run
        state = c.app_state
        assert state.serving is not None and not _tracked(state.serving)
        assert c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200


def test_the_router_freezes_at_start(unfrozen):
    from tests.router.test_router_collocated import Pool, routed
    assert gc.get_freeze_count() == 0
    with routed(Pool()) as c:
        assert gc.get_freeze_count() > 10_000
        assert c.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 200

