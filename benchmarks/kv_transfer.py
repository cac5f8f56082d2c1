"""The tcp KV transport on loopback: GB/s against a plain socket copy of the same bytes, and P's step slowdown.

    .venv/bin/python benchmarks/kv_transfer.py            # small model from $PDSERVE_HOME (built if missing)

A producer and a consumer engine run in this process. For 1, 16 and 256 blocks of the small model, a lease of
that many blocks is pulled by the consumer's real load path (handshake, authenticated frames of up to 64 blocks,
writes into its own blocks, `done`), timed end to end; the baseline sends the same number of bytes over a plain
loopback socket in the same chunking. Then P's decode step time is measured alone and while a thread keeps pulling
256-block transfers from it.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import socket
import statistics
import threading
import time
from pathlib import Path

from pdserve import LLM, SamplingParams
from pdserve.model.make_model import ensure_model
from pdserve.transfer.base import LoadJob
from pdserve.transfer.tcp import BLOCKS_PER_READ, Lease

ENGINE = dict(max_model_len=1024, kv_cache_memory_gb=0.3, max_num_seqs=16)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def plain_copy_seconds(nbytes: int, chunk: int) -> float:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    payload = b"\x01" * chunk

    def sink():
        conn, _ = srv.accept()
        buf = bytearray(chunk)
        view, left = memoryview(buf), nbytes
        while left:
            left -= conn.recv_into(view[:min(chunk, left)])
        conn.sendall(b"k")
        conn.close()

    t = threading.Thread(target=sink)
    t.start()
    t0 = time.perf_counter()
    with socket.create_connection(srv.getsockname()) as c:
        sent = 0
        while sent < nbytes:
            n = min(chunk, nbytes - sent)
            c.sendall(payload[:n])
            sent += n
        c.recv(1)
    dt = time.perf_counter() - t0
    t.join()
    srv.close()
    return dt


def pull_seconds(p, d, num_blocks: int) -> tuple[float, int]:
    """One transfer of `num_blocks` leased blocks through the consumer's load path."""
    pc, dc = p.engine.connector, d.engine.connector
    src = p.engine.kv.pool.allocate(num_blocks)
    dst = d.engine.kv.pool.allocate(num_blocks)
    tid = f"bench-{num_blocks}-{time.monotonic_ns()}"
    with pc._lock:
        pc.leases[tid] = Lease("bench", src, time.monotonic() + 60)
    params = {"transfer_id": tid, "remote_host": "127.0.0.1", "remote_port": pc.port}
    before = dc.stats.bytes_received
    t0 = time.perf_counter()
    dc._pull(LoadJob("bench", params, 0, dst))
    dt = time.perf_counter() - t0
    nbytes = dc.stats.bytes_received - before
    assert dc.get_finished().done_recving == {"bench"}, "transfer failed"
    with pc._lock:
        pc.leases.pop(tid, None)  # P's engine may already have released it after `done`
    p.engine.kv.pool.free(src)
    d.engine.kv.pool.free(dst)
    return dt, nbytes


def step_ms(llm, steps: int) -> float:
    e = llm.engine
    for i in range(8):
        e.add_request([3 + (i * 13 + j) % 8000 for j in range(64)],
                      SamplingParams(temperature=0, max_tokens=steps + 2, ignore_eos=True))
    e.step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        e.step()
        times.append(time.perf_counter() - t0)
    for rid in list(e.scheduler.requests):
        e.abort_request(rid)
    return statistics.median(times) * 1e3


def reader(host, port, token, compat, pace, stop) -> None:
    """A bare consumer in another process: handshake, then whole-lease reads until told to stop."""
    from pdserve.transfer.protocol import client_handshake
    with socket.create_connection((host, port)) as sock:
        session = client_handshake(sock, token.encode(), compat)
        while not stop.is_set():
            t0 = time.monotonic()
            for start in range(0, 256, BLOCKS_PER_READ):
                session.send({"op": "read", "transfer_id": "reader", "start": start, "count": BLOCKS_PER_READ})
                session.recv()
            time.sleep(max(0.0, pace - (time.monotonic() - t0)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="Model directory (default: the small qwen3 model).")
    ap.add_argument("--reps", type=int, default=5, help="Transfers per size (median reported).")
    ap.add_argument("--out", default="benchmarks/results/kv_transfer.json")
    args = ap.parse_args()
    model = args.model or str(ensure_model("qwen3", "small", 0))
    kv = {"kv_connector": "TcpConnector", "kv_auth_token": "bench"}
    p = LLM(model, kv_transfer_config={**kv, "kv_role": "kv_producer", "kv_port": free_port()}, **ENGINE)
    d = LLM(model, kv_transfer_config={**kv, "kv_role": "kv_consumer"}, **ENGINE)
    rows = []
    print(f"{'blocks':>6} {'MB':>8} {'tcp GB/s':>9} {'plain GB/s':>10} {'ratio':>6}")
    for n in (1, 16, 256):
        tcp = [pull_seconds(p, d, n) for _ in range(args.reps)]
        nbytes = tcp[0][1]
        chunk = nbytes // n * min(n, BLOCKS_PER_READ)
        plain = [plain_copy_seconds(nbytes, chunk) for _ in range(args.reps)]
        t_tcp, t_plain = statistics.median(t for t, _ in tcp), statistics.median(plain)
        row = {"blocks": n, "bytes": nbytes, "tcp_gbps": nbytes / t_tcp / 1e9, "plain_gbps": nbytes / t_plain / 1e9,
               "ratio": t_plain / t_tcp}
        rows.append(row)
        print(f"{n:>6} {nbytes / 1e6:>8.2f} {row['tcp_gbps']:>9.2f} {row['plain_gbps']:>10.2f} {row['ratio']:>6.2f}")
    # P's step time alone, then while another process reads a 256-block lease: back to back (worst case) and
    # paced at 4 transfers/s (a 4 req/s load of ~4K-token prompts).
    src = p.engine.kv.pool.allocate(256)
    with p.engine.connector._lock:
        p.engine.connector.leases["reader"] = Lease("reader", src, time.monotonic() + 3600)
    alone = step_ms(p, 30)
    slow = {}
    ctx = multiprocessing.get_context("spawn")
    for name, pace in (("back_to_back", 0.0), ("paced_4_per_s", 0.25)):
        stop = ctx.Event()
        proc = ctx.Process(target=reader, args=("127.0.0.1", p.engine.connector.port, kv["kv_auth_token"],
                                                p.engine.compat_fields(), pace, stop))
        proc.start()
        time.sleep(1.0)
        slow[name] = step_ms(p, 30)
        stop.set()
        proc.join()
    with p.engine.connector._lock:
        del p.engine.connector.leases["reader"]
    p.engine.kv.pool.free(src)
    for name, ms in slow.items():
        print(f"P decode step (batch 8): {alone:.1f} ms alone, {ms:.1f} ms while a reader process pulls 256-block "
              f"transfers {name.replace('_', ' ')}: {ms / alone - 1:+.1%}")
    slowdown = {name: ms / alone - 1 for name, ms in slow.items()}
    result = {"model": model, "transfers": rows, "p_step_ms_alone": alone, "p_step_ms_serving": slow,
              "p_step_slowdown": slowdown, "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    p.engine.shutdown()
    d.engine.shutdown()


if __name__ == "__main__":
    main()
