"""What nixl 1.5.1 does here (UCX, CPU memory, two processes), for the `nixl` KV transport.

    .venv/bin/python benchmarks/nixl_probe.py          # writes benchmarks/results/nixl_probe.json

P (a child process) registers a KV cache shaped like the small model's (12 layers of [2, blocks, 16, 4, 64] float32:
16 KiB per layer, K or V and block; 384 KiB a block) through pdserve.transfer.nixl.agent; D (another process) adds P
from its metadata and layout (handed over a pipe here; pdserve's authenticated session in the connector), then reads
P's blocks into its own with one prepared-descriptor-list READ each, polls until DONE, and checks the bytes; the
read's notification (the transfer's name) is received on P. Phases, each in fresh processes:
- transfers: 1, 16, 256 blocks, ids ascending on both sides (a fresh pool) and shuffled (a long-running one), under
  UCX_TLS=tcp,self (pdserve's default) and UCX_TLS=all (UCX's own default: cma on one host). D times read() to DONE
  (polling every 0.2 ms) and P, polling its notifications every 1 ms, when the notification arrived.
- progress: P's idle CPU (no agent; progress thread with NIXL's own delay 0; 1 ms; 10 ms, pdserve's default;
  100 ms; no thread, P polled by a Python thread every 1 ms; no thread and no polling) and 16-block reads against
  each; then the CPU that P and D (and each of their threads) spend on 256-block reads (D polling every 1 ms).
- failure: P SIGKILLed 50 ms into a 512-block read (what D's poll says, and when; whether D stays usable: posting
  and notifying the dead peer, remove_peer, a new P); P SIGSTOPped mid-read (a hung peer): the read's state after 3 s,
  releasing it, and whether P's bytes still land in D's blocks once P runs again.
Timings on a shared 2-core machine: the probe waits while /tmp/pdserve-bench-lock exists, holds it meanwhile, and
records the load. vLLM's NIXL metric names (what the connector's metrics copy) are listed in the results.
"""
import json
import multiprocessing as mp
import os
import resource
import signal
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pdserve.transfer.nixl.agent import NixlAgent, NixlError  # noqa: E402

LAYERS, BLOCKS, SHAPE = 12, 600, (16, 4, 64)  # the small model: 384 KiB a block
LOCK = Path("/tmp/pdserve-bench-lock")
OUT = Path(__file__).resolve().parent / "results" / "nixl_probe.json"
VLLM_METRICS = {  # vllm/distributed/kv_transfer/kv_connector/v1/nixl/stats.py (NixlPromMetrics), fed by NIXL telemetry
    "vllm:nixl_xfer_time_seconds": "histogram: a read's transfer duration (telemetry xferDuration, us -> s)",
    "vllm:nixl_post_time_seconds": "histogram: time to post the read (telemetry postDuration, us -> s)",
    "vllm:nixl_bytes_transferred": "histogram: bytes per read (telemetry totalBytes)",
    "vllm:nixl_num_descriptors": "histogram: descriptors per read after NIXL merged adjacent ones (descCount)",
    "vllm:nixl_num_failed_transfers": "counter: reads that failed to post or ended in ERR / raised in check",
    "vllm:nixl_num_failed_notifications": "counter: send_notif failures (nothing to read, P frees on timeout)",
    "vllm:nixl_num_kv_expired_reqs": "counter, on P: requests whose blocks were freed by the timeout, unread",
}


def caches(seed=None) -> list[torch.Tensor]:
    if seed is None:
        return [torch.zeros(2, BLOCKS, *SHAPE) for _ in range(LAYERS)]
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, BLOCKS, *SHAPE, generator=g) for _ in range(LAYERS)]


def cpu_self() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def cpu_of(pid: int, tid: int = 0) -> float:
    f = Path(f"/proc/{pid}" + (f"/task/{tid}" if tid else "") + "/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def threads_cpu(pid: int) -> dict:
    """tid -> (name, CPU seconds) of every thread of `pid`."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            name = "main" if int(tid) == pid else Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
            out[tid] = (name, cpu_of(pid, int(tid)))
        except OSError:
            pass
    return out


def busiest(before: dict, after: dict, per: int) -> list:
    """CPU ms per read of the threads that used any, busiest first ("python" other than main: NIXL's progress thread;
    "async": UCX's async event thread)."""
    rows = [(after[t][0], round((after[t][1] - before.get(t, (0, 0.0))[1]) * 1e3 / per, 1)) for t in after]
    return sorted((r for r in rows if r[1] > 0), key=lambda r: -r[1])


def idle_cores(seconds: float) -> float:
    c0, t0 = cpu_self(), time.monotonic()
    time.sleep(seconds)
    return round((cpu_self() - c0) / (time.monotonic() - t0), 4)


# ---- P: the child process that owns the blocks ----------------------------------------------------------------------
def producer(conn, name: str, opts: dict, poll_ms: float, baseline: bool) -> None:
    kv = caches(seed=1)
    base = idle_cores(2.0) if baseline else None
    a = NixlAgent(name, kv, **opts)
    got, lock = [], threading.Lock()

    def poller():  # a Python thread progressing an agent that has no progress thread of its own
        while True:
            for sender, msgs in a.notifs().items():
                with lock:
                    got.extend((m, time.monotonic(), sender) for m in msgs)
            time.sleep(poll_ms / 1e3)
    if poll_ms:
        threading.Thread(target=poller, daemon=True).start()
    conn.send((a.metadata(), a.layout(), base))
    while True:
        cmd, *args = conn.recv()
        if cmd == "stop":
            break
        if cmd == "idle":
            conn.send(idle_cores(args[0]))
        elif cmd == "wait":  # poll every 1 ms until `msg` arrives: (arrival time, sender) or None
            end, hit = time.monotonic() + args[1], None
            while hit is None and time.monotonic() < end:
                if not poll_ms:
                    for sender, msgs in a.notifs().items():
                        got.extend((m, time.monotonic(), sender) for m in msgs)
                with lock:
                    hit = next((x for x in got if x[0] == args[0]), None)
                time.sleep(0.001)
            conn.send(hit and hit[1:])
        elif cmd == "drain":  # NIXL's own return value, as it is
            conn.send(a.notifs())
    a.close()


def start_p(name: str, opts=None, poll_ms: float = 0, baseline: bool = False):
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    p = ctx.Process(target=producer, args=(there, name, opts or {}, poll_ms, baseline), daemon=True)
    p.start()
    md, layout, base = here.recv()
    return p, here, md, layout, base


def stop_p(p, conn) -> None:
    try:
        if p.is_alive():
            conn.send(("stop",))
            p.join(5)
    finally:
        if p.is_alive():
            p.kill()
            p.join()


def wait(d: NixlAgent, t, timeout: float = 30.0, sleep: float = 0.0) -> str:
    end = time.monotonic() + timeout
    while d.poll(t) == "PROC" and time.monotonic() < end:
        sleep and time.sleep(sleep)
    return t.state


def matches(kv, ref, src, dst) -> bool:
    return all(torch.equal(kv[layer][:, dst], ref[layer][:, src]) for layer in range(LAYERS))


def ids(rng, n: int, scattered: bool):
    if not scattered:
        start = int(rng.integers(0, BLOCKS - n + 1))
        return np.arange(start, start + n), np.arange(BLOCKS - n, BLOCKS) if n < BLOCKS // 2 else np.arange(n)
    return rng.choice(BLOCKS, n, replace=False), rng.choice(BLOCKS, n, replace=False)


# ---- D: one scenario per process (UCX reads UCX_TLS once per process) ------------------------------------------------
def transfers(out) -> None:
    kv, ref, rng = caches(), caches(seed=1), np.random.default_rng(0)
    d = NixlAgent("D", kv)
    p, conn, md, layout, _ = start_p("P")
    try:
        t0 = time.perf_counter()
        peer = d.add_peer(md, layout)
        res = {"ucx_tls": os.environ.get("UCX_TLS"), "add_peer_ms": round((time.perf_counter() - t0) * 1e3, 2),
               "peer_name_type": type(peer).__name__, "rows": []}
        t0 = time.perf_counter()
        wait(d, x := d.read(peer, [0], [1], b"first"))
        res["first_read_ms"] = round((time.perf_counter() - t0) * 1e3, 2)
        d.release(x)
        conn.send(("drain",))
        res["notifs_format"] = repr(conn.recv())
        for n, scattered, reps in ((1, True, 30), (16, False, 20), (16, True, 20), (256, False, 8), (256, True, 8)):
            d_ms, p_ms, tele, ok = [], [], [], True
            for i in range(reps):
                src, dst = ids(rng, n, scattered)
                tag = f"{n}-{scattered}-{i}".encode()
                conn.send(("wait", tag, 30.0))
                t0 = time.monotonic()
                x = d.read(peer, src, dst, tag)
                state = wait(d, x, sleep=0.0002)
                t1 = time.monotonic()
                tele.append(d.telemetry(x))
                d.release(x)
                arrival = conn.recv()
                ok &= state == "DONE" and matches(kv, ref, src, dst) and arrival is not None and arrival[1] == "D"
                d_ms.append((t1 - t0) * 1e3)
                p_ms.append((arrival[0] - t0) * 1e3 if arrival else float("nan"))
            med = statistics.median(d_ms)
            res["rows"].append({
                "blocks": n, "scattered": scattered, "reps": reps, "bytes_match_and_notified": ok,
                "d_done_ms": round(med, 3), "p_notified_ms": round(statistics.median(p_ms), 3),
                "gbps": round(n * 384 * 1024 / med / 1e6, 3),
                "telemetry_xfer_ms": round(statistics.median(t["xfer_duration_s"] for t in tele) * 1e3, 3),
                "telemetry_post_ms": round(statistics.median(t["post_duration_s"] for t in tele) * 1e3, 3),
                "descriptors": tele[0]["descriptors"], "bytes": tele[0]["bytes"]})
        res["sigkill"] = sigkill(d, peer, p, kv, ref)
        out.send(res)
    finally:
        stop_p(p, conn)
        d.close()


def sigkill(d: NixlAgent, peer: str, p, kv, ref) -> dict:
    src = dst = np.random.default_rng(1).permutation(BLOCKS)[:512]
    # under cma the post itself copies (read() returns DONE): the kill comes from a timer, inside the post
    delay = 0.005 if os.environ["UCX_TLS"] == "all" else 0.08
    killed = threading.Event()
    timer = threading.Timer(delay, lambda: (os.kill(p.pid, signal.SIGKILL), killed.set()))
    t0 = time.monotonic()
    timer.start()
    res = {"kill_after_ms": delay * 1e3}
    try:
        x = d.read(peer, src, dst, b"big")
        res.update(read_returned_ms=round((time.monotonic() - t0) * 1e3, 2), state_when_read_returned=x.state)
        killed.wait()
        t1 = time.monotonic()
        res.update(state_after=wait(d, x, timeout=60, sleep=0.0005),
                   noticed_ms_after_kill=round((time.monotonic() - t1) * 1e3, 2))
        d.release(x)
    except NixlError as e:
        res["read"] = f"raises NixlError: {e}"
    timer.join()
    for what, call in (("read_to_dead_peer", lambda: d.read(peer, [0], [0], b"x")),
                       ("notify_dead_peer", lambda: d.notify(peer, b"x"))):
        try:
            call()
            res[what] = "accepted"
        except NixlError as e:
            res[what] = f"raises NixlError: {e}"
    t0 = time.monotonic()
    d.remove_peer(peer)
    res["remove_peer_ms"] = round((time.monotonic() - t0) * 1e3, 3)
    p2, conn2, md, layout, _ = start_p("P2")
    try:
        peer2 = d.add_peer(md, layout)
        src, dst = np.arange(16) * 7, np.arange(16) * 5 + 3
        conn2.send(("wait", b"after", 10.0))
        ok = wait(d, x := d.read(peer2, src, dst, b"after")) == "DONE" and matches(kv, ref, src, dst)
        res["d_usable_after"] = ok and conn2.recv() is not None and d.peers == ["P2"]
        d.release(x)
        d.remove_peer(peer2)
    finally:
        stop_p(p2, conn2)
    return res


def progress(out) -> None:
    kv = caches()
    d = NixlAgent("D", kv)
    res = {"ucx_tls": os.environ.get("UCX_TLS"), "p": []}
    cases = [("thread, delay 0 (nixl's Python API)", {"progress_delay_us": 0}, 0),
             ("thread, delay 1 ms", {"progress_delay_us": 1000}, 0),
             ("thread, delay 10 ms (pdserve default)", {"progress_delay_us": 10_000}, 0),
             ("thread, delay 100 ms", {"progress_delay_us": 100_000}, 0),
             ("no thread, Python poll every 1 ms", {"progress_thread": False}, 1.0),
             ("no thread, not progressed", {"progress_thread": False}, 0)]
    for i, (label, opts, poll_ms) in enumerate(cases):
        p, conn, md, layout, base = start_p(f"P{i}", opts, poll_ms, baseline=(i == 0))
        try:
            if base is not None:
                res["p_idle_cores_no_agent"] = base
            conn.send(("idle", 2.0))
            row = {"case": label, "p_idle_cores": conn.recv()}
            peer, rng, ms = d.add_peer(md, layout), np.random.default_rng(2), []
            for _ in range(20):
                src, dst = ids(rng, 16, True)
                t0 = time.monotonic()
                x = d.read(peer, src, dst, b"p")
                state = wait(d, x, timeout=2.0, sleep=0.0002)
                if state == "PROC":  # P not progressed: the emulated READ waits for P's worker
                    conn.send(("wait", b"p", 5.0))
                    row["stalled_until_p_polled"] = {"state_after_2s": "PROC", "after_p_polled": wait(d, x, 5.0),
                                                     "p_got_notif": conn.recv() is not None}
                    d.release(x, force=True)
                    break
                ms.append((time.monotonic() - t0) * 1e3)
                d.release(x)
            row["read_16_ms_median"] = round(statistics.median(ms), 3) if ms else None
            if i == 2:
                row["cpu_256_blocks"] = cpu_per_read(d, peer, p.pid, rng)
            res["p"].append(row)
            d.remove_peer(peer)
        finally:
            stop_p(p, conn)
    out.send(res)
    d.close()


def cpu_per_read(d: NixlAgent, peer: str, pid: int, rng, reps: int = 10) -> dict:
    """CPU seconds P and D spend per 256-block scattered read, D polling every 1 ms."""
    p0, d0, t0 = cpu_of(pid), cpu_self(), time.monotonic()
    pt0, dt0 = threads_cpu(pid), threads_cpu(os.getpid())
    for _ in range(reps):
        src, dst = ids(rng, 256, True)
        wait(d, x := d.read(peer, src, dst, b"c"), sleep=0.001)
        d.release(x)
    wall = time.monotonic() - t0
    p_s, d_s = (cpu_of(pid) - p0) / reps, (cpu_self() - d0) / reps
    return {"reads": reps, "wall_ms_per_read": round(wall / reps * 1e3, 2), "p_cpu_ms_per_read": round(p_s * 1e3, 2),
            "d_cpu_ms_per_read": round(d_s * 1e3, 2), "p_cores": round(p_s * reps / wall, 3),
            "d_cores": round(d_s * reps / wall, 3), "p_threads_ms_per_read": busiest(pt0, threads_cpu(pid), reps),
            "d_threads_ms_per_read": busiest(dt0, threads_cpu(os.getpid()), reps)}


def sigstop(out) -> None:
    kv = caches()
    d = NixlAgent("D", kv)
    p, conn, md, layout, _ = start_p("P")
    try:
        peer = d.add_peer(md, layout)
        dst = np.arange(512)
        x = d.read(peer, np.arange(512), dst, b"big")
        time.sleep(0.03)
        os.kill(p.pid, signal.SIGSTOP)
        res = {"state_after_3s_stopped": wait(d, x, timeout=3.0, sleep=0.01)}
        try:
            d.release(x)
            res["release"] = "freed"
        except NixlError as e:
            res["release"] = f"refused: {e}"
        d.release(x, force=True)
        for c in kv:
            c.zero_()
        os.kill(p.pid, signal.SIGCONT)
        time.sleep(1.5)
        written = sum(int((c[:, dst] != 0).flatten(2).any(-1).sum()) for c in kv)
        res["d_chunks_written_after_forced_release"] = f"{written} of {512 * 2 * LAYERS}"
        out.send(res)
    finally:
        os.kill(p.pid, signal.SIGCONT) if p.is_alive() else None
        stop_p(p, conn)
        d.close()


def run(fn, ucx_tls) -> dict:
    """fn in a fresh D process (and its P) with UCX_TLS as given."""
    saved = os.environ.get("UCX_TLS")
    os.environ["UCX_TLS"] = ucx_tls
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=fn, args=(there,))
    proc.start()
    try:
        return here.recv()
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
        os.environ.pop("UCX_TLS", None) if saved is None else os.environ.__setitem__("UCX_TLS", saved)


def main() -> None:
    while LOCK.exists():
        print("waiting for /tmp/pdserve-bench-lock ...", flush=True)
        time.sleep(30)
    LOCK.touch()
    try:
        from importlib.metadata import version
        load = float(Path("/proc/loadavg").read_text().split()[0])
        res = {"nixl": version("nixl"), "nixl_cu12": version("nixl-cu12"), "torch_threads": torch.get_num_threads(),
               "loadavg_1m_before": load, "block_bytes": 384 * 1024, "layers": LAYERS, "pool_blocks": BLOCKS,
               "vllm_metrics": VLLM_METRICS}
        for key, fn, tls in (("transfers_tcp", transfers, "tcp,self"), ("transfers_ucx_all", transfers, "all"),
                             ("progress", progress, "tcp,self"), ("sigstop", sigstop, "tcp,self")):
            print(f"{key} ...", flush=True)
            res[key] = run(fn, tls)
            print(json.dumps(res[key], indent=1), flush=True)
        res["loadavg_1m_after"] = float(Path("/proc/loadavg").read_text().split()[0])
        kv = Path(__file__).resolve().parent / "results" / "kv_transfer.json"
        if kv.exists():  # pdserve's own tcp transport on the same bytes, for reference
            res["pdserve_tcp_gbps"] = [{k: r[k] for k in ("blocks", "scattered", "tcp_gbps")}
                                       for r in json.loads(kv.read_text())["transfers"]]
        OUT.write_text(json.dumps(res, indent=1) + "\n")
        print(f"wrote {OUT}")
    finally:
        LOCK.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
