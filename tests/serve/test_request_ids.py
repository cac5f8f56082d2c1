"""AsyncEngine.unique_id: a repeated X-Request-Id gets a suffix, and the cost of a repeat does not grow with how
often the id was sent before (it did: ~30 ms of event loop per request after 10-20k repeats)."""
import time

from pdserve.serve.async_engine import RECENT_IDS, AsyncEngine


def test_repeats_get_the_next_free_suffix_including_ids_a_client_chose():
    eng = AsyncEngine(None)
    assert [eng.unique_id("a") for _ in range(3)] == ["a", "a-1", "a-2"]
    assert eng.unique_id("a-4") == "a-4"  # a client's own suffixed id
    assert [eng.unique_id("a") for _ in range(2)] == ["a-3", "a-5"]  # a-4 is taken: skipped
    assert eng.unique_id("b") == "b"


def test_twenty_thousand_repeats_cost_linear_time():
    eng = AsyncEngine(None)
    t = time.perf_counter()
    ids = [eng.unique_id("same") for _ in range(20_000)]
    took = time.perf_counter() - t
    assert len(set(ids)) == len(ids)
    # counting from 1 each time walks 2 * 10^8 taken ids here (minutes); remembering where it stopped, ~0.05 s
    assert took < 2.0, took


def test_the_memory_of_ids_stays_bounded():
    eng = AsyncEngine(None)
    for i in range(RECENT_IDS + 50):
        eng.unique_id(f"id{i}")
        eng.unique_id(f"id{i}")
    assert len(eng._recent_ids) <= RECENT_IDS and len(eng._next_suffix) <= RECENT_IDS
