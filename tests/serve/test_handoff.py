"""serve/handoff.py's parts without servers: P's key -> params registry (either side may come first, one taker, a
wait that ends, entries dropped after KEEP_SECONDS, a cap on keys P never saw) and the hosts D may ask."""
from __future__ import annotations

import asyncio

import pytest

from pdserve.serve import handoff
from pdserve.serve.handoff import Handoffs, KVEndpoints, dialable, handoff_proof, valid_key

K1, K2 = "a" * 32, "b" * 32


def run(coro):
    return asyncio.run(coro)


def test_a_d_asking_first_waits_for_ps_end():
    async def go():
        h = Handoffs()
        taker = asyncio.ensure_future(h.take(K1, timeout=5))
        await asyncio.sleep(0.01)
        assert not taker.done()
        h.register(K1)
        h.resolve(K1, {"transfer_id": "t"})
        h.resolve(K1, None, "later calls change nothing")
        return await taker, len(h)
    assert run(go()) == (({"transfer_id": "t"}, ""), 0)


def test_p_ending_first_keeps_the_params_for_one_taker():
    async def go():
        h = Handoffs()
        h.register(K1)
        h.resolve(K1, None, "its token ended the request")
        first = await h.take(K1, timeout=1)
        with pytest.raises((asyncio.TimeoutError, TimeoutError)):
            await h.take(K1, timeout=0.05)  # taken already: a second asker waits like one for an unknown key
        return first, len(h)
    assert run(go()) == ((None, "its token ended the request"), 0)


def test_a_wait_that_runs_out_leaves_nothing_behind():
    async def go():
        h = Handoffs()
        with pytest.raises((asyncio.TimeoutError, TimeoutError)):
            await h.take(K1, timeout=0.02)
        return len(h)
    assert run(go()) == 0


def test_a_cancelled_wait_leaves_nothing_behind():
    async def go():
        h = Handoffs()
        t = asyncio.ensure_future(h.take(K1, timeout=5))
        await asyncio.sleep(0.01)
        t.cancel()
        await asyncio.gather(t, return_exceptions=True)
        return len(h)
    assert run(go()) == 0


def test_params_nobody_takes_are_dropped_after_keep_seconds(monkeypatch):
    async def go():
        h = Handoffs()
        h.register(K1)
        h.resolve(K1, {"x": 1})
        monkeypatch.setattr(handoff, "KEEP_SECONDS", 0.0)
        await asyncio.sleep(0.01)
        h.register(K2)  # each registration sweeps what is past its time
        return len(h), K1 in h._entries
    assert run(go()) == (1, False)


def test_keys_p_never_saw_are_capped(monkeypatch):
    monkeypatch.setattr(handoff, "MAX_WAITING", 2)

    async def go():
        h = Handoffs()
        waits = [asyncio.ensure_future(h.take(k, timeout=5)) for k in (K1, K2)]
        await asyncio.sleep(0.01)
        with pytest.raises(LookupError):
            await h.take("c" * 32, timeout=5)
        h.resolve(K1, None)  # an answered key no longer counts
        h.resolve(K2, None)
        await asyncio.gather(*waits)
        return len(h)
    assert run(go()) == 0


@pytest.mark.parametrize("url,peers,ok", [
    ("http://127.0.0.1:8100", (), True), ("http://localhost:8100", (), True), ("http://[::1]:8100", (), True),
    ("http://10.1.2.3:8100", (), False), ("http://10.1.2.3:8100", ("10.1.2.3",), True),
    ("https://p.example:443", ("p.example",), True), ("http://10.1.2.4:8100", ("10.1.2.3",), False),
    ("ftp://127.0.0.1:21", (), False), ("http://127.0.0.1:99999", (), False), ("127.0.0.1:8100", (), False)])
def test_d_asks_only_hosts_of_its_kv_peers(url, peers, ok):
    assert (dialable(url, frozenset(peers)) is None) == ok


def test_keys_and_proofs():
    assert valid_key(K1) and not valid_key("A" * 32) and not valid_key("a" * 31) and not valid_key(None)
    assert handoff_proof("t", K1) != handoff_proof("u", K1) != handoff_proof("t", K2)


def test_kv_endpoints_are_learnt_from_tcp_params_and_expire(monkeypatch):
    eps = KVEndpoints()
    assert eps.get("http://p") is None
    eps.learn("http://p", {"remote_host": "127.0.0.1", "remote_port": 7001})
    eps.learn("http://n", {"remote_host": "127.0.0.1", "remote_port": 7002, "kv_connector": "NixlConnector"})
    eps.learn("http://b", {"remote_host": "127.0.0.1", "remote_port": True})
    assert eps.get("http://p") == ("127.0.0.1", 7001)
    assert eps.get("http://n") is None and eps.get("http://b") is None  # no await on NIXL; a bool is no port
    monkeypatch.setattr(KVEndpoints, "TTL", -1.0)
    eps.learn("http://p", {"remote_host": "127.0.0.1", "remote_port": 7003})
    assert eps.get("http://p") is None  # past its TTL: learnt again the HTTP way
