"""pdserve.transfer.nixl.agent between two processes (NIXL over UCX tcp, CPU memory); skipped without nixl.

P runs in a spawned child that owns its blocks; D (this process) reads them. Children are killed in teardown."""
import multiprocessing as mp
import os
import resource
import signal
import time

import pytest
import torch

from pdserve.transfer.nixl.agent import NixlAgent, NixlError, available

pytestmark = pytest.mark.skipif(not available(), reason="nixl is not installed")

LAYERS, BLOCKS, SHAPE = 2, 32, (4, 2, 16)  # 512-byte chunks: a layer's K or V of one block


def caches(seed=None) -> list[torch.Tensor]:
    if seed is None:
        return [torch.zeros(2, BLOCKS, *SHAPE) for _ in range(LAYERS)]
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, BLOCKS, *SHAPE, generator=g) for _ in range(LAYERS)]


def _producer(conn, name: str, progress_thread: bool) -> None:
    """P: registers seeded blocks, answers `notifs` (polls until some arrive) until `stop`. Without a progress
    thread it is progressed only while it polls, so a read posted meanwhile stays in flight."""
    a = NixlAgent(name, caches(seed=7), progress_thread=progress_thread)
    conn.send((a.metadata(), a.layout()))
    while (cmd := conn.recv()) != "stop":
        end, got = time.monotonic() + cmd, {}
        while not got and time.monotonic() < end:
            got = a.notifs()
            time.sleep(0.001)
        conn.send(got)
    a.close()


@pytest.fixture
def producers():
    """start(name, progress_thread=True) -> (process, pipe, metadata, layout); every child is killed afterwards."""
    procs, ctx = [], mp.get_context("spawn")

    def start(name, progress_thread=True):
        here, there = ctx.Pipe()
        p = ctx.Process(target=_producer, args=(there, name, progress_thread), daemon=True)
        p.start()
        procs.append(p)
        assert here.poll(30), "P did not start"
        return (p, here, *here.recv())
    yield start
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join(5)


@pytest.fixture
def d_agent():
    d = NixlAgent("D", caches())
    yield d
    d.close()


def until_done(d, t, timeout=10.0) -> str:
    end = time.monotonic() + timeout
    while d.poll(t) == "PROC" and time.monotonic() < end:
        time.sleep(0.001)
    return t.state


def test_scattered_read_lands_and_notifies(producers, d_agent):
    p, conn, md, layout = producers("P1")
    d, ref = d_agent, caches(seed=7)
    assert d.add_peer(md, layout) == "P1" and d.peers == ["P1"]
    with pytest.raises(NixlError, match="already added"):
        d.add_peer(md, layout)
    with pytest.raises(ValueError, match="out of range"):
        d.read("P1", [BLOCKS], [0])
    with pytest.raises(ValueError, match="one length"):
        d.read("P1", [0, 1], [0])
    src, dst = [9, 2, 30, 17, 5], [0, 31, 12, 3, 20]  # scattered, different ids on each side
    t = d.read("P1", src, dst, b"xfer-42")
    assert until_done(d, t) == "DONE"
    tele = d.telemetry(t)
    assert tele["bytes"] == t.nbytes == len(src) * 2 * LAYERS * 512
    d.release(t)
    for layer in range(LAYERS):
        assert torch.equal(d._kv[layer][:, dst], ref[layer][:, src])
        untouched = [b for b in range(BLOCKS) if b not in dst]
        assert not d._kv[layer][:, untouched].any()  # nothing written outside the destination blocks
    conn.send(5.0)
    assert conn.recv() == {"D": [b"xfer-42"]}  # the read's own notification, named by D's agent
    d.notify("P1", b"nothing-to-read")
    conn.send(5.0)
    assert conn.recv() == {"D": [b"nothing-to-read"]}


def test_p_killed_mid_read_ends_in_err_and_d_keeps_working(producers, d_agent):
    p, conn, md, layout = producers("P1", progress_thread=False)  # not progressed: the read waits on P
    d, ref = d_agent, caches(seed=7)
    d.add_peer(md, layout)
    t = d.read("P1", list(range(16)), list(range(16, 32)), b"big")
    time.sleep(0.2)
    assert d.poll(t) == "PROC"
    with pytest.raises(NixlError, match="in flight"):
        d.release(t)  # a posted read cannot be cancelled: refused while it may still write our blocks
    t0 = time.monotonic()
    os.kill(p.pid, signal.SIGKILL)
    assert until_done(d, t, timeout=5.0) == "ERR"
    assert time.monotonic() - t0 < 5.0
    d.release(t)
    with pytest.raises(NixlError, match="not posted"):
        d.read("P1", [0], [0], b"x")
    d.remove_peer("P1")
    assert d.peers == []
    p2, conn2, md2, layout2 = producers("P2")
    d.add_peer(md2, layout2)
    t = d.read("P2", [3, 4], [7, 1], b"again")
    assert until_done(d, t) == "DONE"
    d.release(t)
    assert all(torch.equal(d._kv[layer][:, [7, 1]], ref[layer][:, [3, 4]]) for layer in range(LAYERS))


def test_refusals_are_clear(d_agent):
    d = d_agent
    layout = dict(d.layout(), agent="Q")
    with pytest.raises(NixlError, match="chunk_bytes"):
        d.add_peer(b"", dict(layout, chunk_bytes=1024))
    with pytest.raises(NixlError, match="num_regions"):
        d.add_peer(b"", dict(layout, num_regions=6))
    with pytest.raises(NixlError, match="metadata refused"):
        d.add_peer(b"not nixl metadata", layout)
    with pytest.raises(NixlError, match="unknown NIXL peer"):
        d.read("Q", [0], [0])
    with pytest.raises(ValueError):
        NixlAgent("bad", [torch.zeros(3, 4, 2)])


def test_progress_thread_does_not_spin():
    """nixl 1.5.1's own config would spin the progress thread: a whole core while idle."""
    a = NixlAgent("idle", caches())
    try:
        r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
        time.sleep(1.0)
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        used = (r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime) / (time.monotonic() - t0)
        assert used < 0.25, f"an idle agent used {used:.2f} cores"
    finally:
        a.close()
    a.close()  # idempotent

