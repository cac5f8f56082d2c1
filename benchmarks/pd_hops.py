"""Where P/D's first-token path spends its time at low load, hop by hop, on loopback (issue 35).

One 1P1D deployment (P with `--pd-first-token prefill`, pdserve's router asking for it) beside a collocated server,
all on the tiny model. Sequential requests (one at a time, so no queue), the kinds interleaved round-robin:
  collocated  a streamed completion straight to the collocated server: TTFT;
  p_plain     P's own answer to a plain non-streamed completion with max_tokens 1 (P's HTTP + engine round trip);
  p_pd        the same with `kv_transfer_params` asking for the first token (what the router sends P: + lease,
              signing, the first token's params);
  router      a streamed completion through the router: TTFT (the client's first token is P's) and the gap to the
              second token (D's first: the hand-off, D's admission, the KV pull, D's step);
  router_early  the same through a second router on the same P and D with the router's default, early decode (D
              asked with P, its admission beside P's prefill): TTFT and first gap;
  d_direct    what the router does, from this client: P's answer with the first token, then D's stream with P's
              params (the time to D's first chunk, which repeats P's token, and to its second, D's own first);
  coll_gap    the collocated stream's gap between its first and second token (one decode step at idle).
Then --cpu-requests router requests alone, and the CPU time each process of the deployment spent per request
(router; P's and D's server processes; their engine processes): what the router's own hops cost.
Prompts are fresh random token ids (no prefix-cache hit). Medians and p90s in ms, differences against collocated.

    .venv/bin/python benchmarks/pd_hops.py            # ~1 min
Writes benchmarks/results/pd_hops.json.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from pdserve.bench.launcher import Deployment, free_port
from pdserve.worker.cpu_threads import process_cpu_seconds

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_file import write_result  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
TOKEN = "pd-hops-bench"


def stream(client: httpx.Client, url: str, body: dict) -> list[float]:
    """Seconds from send to each chunk that carries token ids."""
    t0, times = time.perf_counter(), []
    with client.stream("POST", url + "/v1/completions", json={**body, "stream": True}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {") and (json.loads(line[6:])["choices"] or [{}])[0].get("token_ids"):
                times.append(time.perf_counter() - t0)
    return times


def whole(client: httpx.Client, url: str, body: dict) -> tuple[float, dict]:
    t0 = time.perf_counter()
    r = client.post(url + "/v1/completions", json=body)
    r.raise_for_status()
    return time.perf_counter() - t0, r.json()


def cpu_per_request(dep: Deployment, send, n: int) -> dict[str, float]:
    """CPU ms per request of each process of the 1P1D deployment (the router, P's and D's server processes and
    their engine processes, the servers' children) over `n` calls of `send`."""
    def procs() -> dict[str, int]:
        out = {}
        for ch in dep.children:
            if ch.name in ("router", "prefill", "decode"):
                out[ch.name] = ch.proc.pid
                for kid in Path(f"/proc/{ch.proc.pid}/task/{ch.proc.pid}/children").read_text().split():
                    cmd = Path(f"/proc/{kid}/cmdline").read_bytes()
                    if b"resource_tracker" not in cmd:  # the engine process (multiprocessing's tracker aside)
                        out[f"{ch.name}_engine"] = int(kid)
        return out
    pids = procs()
    before = {k: process_cpu_seconds(pid) for k, pid in pids.items()}
    for _ in range(n):
        send()
    return {k: (process_cpu_seconds(pid) - before[k]) / n * 1e3 for k, pid in pids.items()}


def ttft_split(client: httpx.Client, router: str) -> dict[str, float]:
    """The router's TTFT split so far (`pdserve_router_ttft_seconds{stage}`): each stage's mean in ms."""
    sums, counts = {}, {}
    for line in client.get(router + "/metrics").text.splitlines():
        if line.startswith("pdserve_router_ttft_seconds_sum") or line.startswith("pdserve_router_ttft_seconds_count"):
            stage = line.split('stage="')[1].split('"')[0]
            (sums if "_sum" in line else counts)[stage] = float(line.split()[-1])
    return {k: 1e3 * v / counts[k] for k, v in sums.items() if counts.get(k)}


def pct(v: list[float], q: float) -> float:
    v = sorted(v)
    return v[min(len(v) - 1, round(q * (len(v) - 1)))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="Model dir (default: the tiny qwen3 model, built if missing).")
    ap.add_argument("--requests", type=int, default=40, help="Requests of each kind (default: 40).")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--cpu-requests", type=int, default=100, help="Router requests for the CPU split (default: 100).")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "pd_hops.json"))
    ap.add_argument("--profile-router", metavar="FILE", default=None,
                    help="Run the router under cProfile and write its stats (pstats format) to FILE at its exit: "
                         "where the router's CPU per request goes.")
    args = ap.parse_args()
    if args.model is None:
        from pdserve.model.make_model import ensure_model
        args.model = str(ensure_model("qwen3", "tiny", 0))
    env = {"PDSERVE_KV_TOKEN": TOKEN, "OMP_NUM_THREADS": "1"}
    serve = ["serve", args.model, "--log-level", "warning", "--max-model-len", "1024"]
    kv_port = free_port()
    producer = {"kv_connector": "TcpConnector", "kv_role": "kv_producer", "kv_port": kv_port}
    consumer = {"kv_connector": "TcpConnector", "kv_role": "kv_consumer", "kv_peers": [f"127.0.0.1:{kv_port}"]}
    dep = Deployment("hops", Path(tempfile.mkdtemp(prefix="pd-hops-")))
    try:
        coll = dep.spawn("collocated", serve, free_port(), env)
        p = dep.spawn("prefill", [*serve, "--pd-first-token", "prefill", "--kv-transfer-config",
                                  json.dumps(producer)], free_port(), env)
        d = dep.spawn("decode", [*serve, "--kv-transfer-config", json.dumps(consumer)], free_port(), env)
        profiled = [sys.executable, "-m", "cProfile", "-o", args.profile_router, "-m", "pdserve.cli"] \
            if args.profile_router else None
        # D asked after P answered (the hops this script names); the router's default, early decode, asks D at once
        router = dep.spawn("router", ["router", "--prefill", p, "--decode", d, "--pd-first-token", "prefill",
                                      "--no-pd-early-decode", "--log-level", "warning"], free_port(), env,
                           program=profiled)
        early = dep.spawn("router_early", ["router", "--prefill", p, "--decode", d, "--pd-first-token", "prefill",
                                           "--log-level", "warning"], free_port(), env)
        dep.wait_healthy(180)
        rng = random.Random(0)
        base = {"model": Path(args.model).name, "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True}
        res: dict[str, list[float]] = {k: [] for k in (
            "collocated", "coll_gap", "p_plain", "p_pd", "router", "router_gap", "router_early", "router_early_gap",
            "d_direct_first", "d_direct_gap")}
        coalesced = 0
        with httpx.Client(timeout=60) as c:
            for i in range(args.requests + 3):  # 3 warm-up rounds, not kept
                keep = i >= 3
                prompts = [[rng.randrange(3, 8000) for _ in range(args.prompt_len)] for _ in range(6)]
                t = stream(c, coll, {**base, "prompt": prompts[0]})
                a, _ = whole(c, p, {**base, "prompt": prompts[1], "max_tokens": 1})
                b, _ = whole(c, p, {**base, "prompt": prompts[2], "max_tokens": 1, "stream": False,
                                    "kv_transfer_params": {"do_remote_decode": True, "first_token": True}})
                r = stream(c, router, {**base, "prompt": prompts[3]})
                e = stream(c, early, {**base, "prompt": prompts[5]})
                _, answer = whole(c, p, {**base, "prompt": prompts[4], "stream": False,
                                         "kv_transfer_params": {"do_remote_decode": True, "first_token": True}})
                dd = stream(c, d, {**base, "prompt": prompts[4], "kv_transfer_params": answer["kv_transfer_params"]})
                if keep and min(len(t), len(r), len(e), len(dd)) < 2:
                    # the server sent two steps' tokens in one chunk (its loop read them together): no gap to read
                    coalesced += 1
                elif keep:
                    res["collocated"].append(t[0])
                    res["coll_gap"].append(t[1] - t[0])
                    res["p_plain"].append(a)
                    res["p_pd"].append(b)
                    res["router"].append(r[0])
                    res["router_gap"].append(r[1] - r[0])
                    res["router_early"].append(e[0])
                    res["router_early_gap"].append(e[1] - e[0])
                    res["d_direct_first"].append(dd[0])
                    res["d_direct_gap"].append(dd[1] - dd[0])
                time.sleep(0.05)
            splits = {"router": ttft_split(c, router), "router_early": ttft_split(c, early)}
            cpu = cpu_per_request(dep, lambda: stream(c, router, {**base, "prompt": [
                rng.randrange(3, 8000) for _ in range(args.prompt_len)]}), args.cpu_requests)
    finally:
        dep.stop()
    summary = {k: {"median_ms": statistics.median(v) * 1e3, "p90_ms": pct(v, 0.9) * 1e3} for k, v in res.items()}
    for k, s in summary.items():
        print(f"{k:>14}: median {s['median_ms']:6.1f} ms  p90 {s['p90_ms']:6.1f} ms")
    if coalesced:
        print(f"{coalesced} of {args.requests} rounds left out: a stream carried two tokens in its first chunk")
    coll = summary["collocated"]["median_ms"]
    for k in ("router", "router_early"):
        print(f"{k:>14}: TTFT {summary[k]['median_ms'] / coll:.2f}x collocated's; the router's split (means, ms): " +
              ", ".join(f"{s} {v:.2f}" for s, v in splits[k].items()))
    for k, ms in cpu.items():
        print(f"{k:>14}: {ms:6.2f} ms of CPU per router request")
    write_result(args.out, args, summary=summary, ttft_split_ms=splits, cpu_ms_per_router_request=cpu, raw_s=res,
                 rounds_left_out=coalesced)
    return 0


if __name__ == "__main__":
    sys.exit(main())
