"""D's network work per P (transfer/peer_workers.py): a P that accepts and never answers holds only its own
requests' workers, so loads from every other P go on at once (before, four shared workers: N requests for a hung P
held everyone else up for about N / 4 x kv_transfer_timeout)."""
from __future__ import annotations

import threading
import time

import pytest

from pdserve.transfer.channel.peer_workers import PeerWorkers, peer_of

HUNG = {"remote_host": "10.0.0.9", "remote_port": 7001}
HEALTHY = {"remote_host": "10.0.0.8", "remote_port": 7001}


def test_work_for_a_healthy_p_passes_that_stuck_on_a_hung_one():
    gate = threading.Event()
    w = PeerWorkers(4, "t")
    try:
        hung = [w.submit(peer_of(HUNG), gate.wait, 10) for _ in range(12)]  # a P that never answers (until let go)
        t0 = time.monotonic()
        assert w.submit(peer_of(HEALTHY), lambda: "pulled").result(2.0) == "pulled"
        assert time.monotonic() - t0 < 1.0 and not any(f.done() for f in hung)
        gate.set()
        assert all(f.result(10) for f in hung)
    finally:
        gate.set()
        w.shutdown()


def test_peer_workers_run_each_peer_on_its_own_threads_and_refuse_after_shutdown():
    w = PeerWorkers(2, "t")
    assert peer_of(HUNG) == "10.0.0.9:7001" and peer_of(None) == "None:None"
    threads = [w.submit(peer_of(p), threading.current_thread).result(5) for p in (HUNG, HEALTHY, HUNG)]
    assert all(t.name.startswith("t") for t in threads) and threads[0] is not threads[1]
    w.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        w.submit("x:1", lambda: None)


def test_peers_past_the_cap_share_one_pool_and_idle_pools_are_shut(monkeypatch):
    """A P restarting on new ports (loopback) names new peers each time: past MAX_PEERS they share one pool, and a
    pool idle past IDLE_SECONDS is shut, so threads stay bounded."""
    import pdserve.transfer.channel.peer_workers as pw
    monkeypatch.setattr(pw, "MAX_PEERS", 2)
    w = PeerWorkers(1, "t")
    try:
        for port in range(5):
            w.submit(f"h:{port}", lambda: None).result(5)
        assert set(w._pools) == {"h:0", "h:1", pw.SHARED}
        monkeypatch.setattr(pw, "IDLE_SECONDS", 0.0)
        gate = threading.Event()
        busy = w.submit("h:0", gate.wait, 5)  # a pool with work in it is never shut
        time.sleep(0.01)
        w.submit("h:9", lambda: None).result(5)
        assert "h:0" in w._pools and "h:1" not in w._pools
        gate.set()
        busy.result(5)
    finally:
        w.shutdown()


def test_shutdown_gives_submitted_work_its_grace_then_drops_the_rest():
    """A stopping D's last `done`s (queued by its aborts) get `grace` to reach P; what still waits after it is
    dropped, so a hung P cannot hold the shutdown up."""
    w = PeerWorkers(1, "t")
    ran = []
    w.submit("a", time.sleep, 0.1)
    w.submit("a", ran.append, "done after the sleep")  # queued behind it on the peer's one worker
    t0 = time.monotonic()
    w.shutdown(grace=2.0)
    assert ran == ["done after the sleep"] and time.monotonic() - t0 < 1.5
    with pytest.raises(RuntimeError):
        w.submit("a", ran.append, "late")
    gate = threading.Event()
    w = PeerWorkers(1, "t")
    w.submit("hung", gate.wait, 10)
    w.submit("hung", ran.append, "never")
    t0 = time.monotonic()
    w.shutdown(grace=0.3)
    assert 0.3 <= time.monotonic() - t0 < 2.0
    gate.set()
    time.sleep(0.1)
    assert "never" not in ran
