"""Server overhead: the same 64 requests through `pdserve serve` (streaming, all sent at once) and through the
offline `LLM.generate`, one script, one run. Reports total (prompt + output) tokens/s of each, their ratio, and the
TTFT the server adds.

    .venv/bin/python benchmarks/server_overhead.py                      # tiny and small models, thread and process
    .venv/bin/python benchmarks/server_overhead.py --models tiny --backends thread   # quick look

Per model: offline first, then one server per engine backend (`--engine-backend thread|process`), each started with
the same engine flags, warmed up with one request, then sent the 64 streaming requests concurrently over aiohttp
(the client runs in this process, on the same 2 cores, as a real client on the host would). Prompts are random token
ids (lengths ~ U[16, 256]), outputs ~ U[16, 128] tokens, greedy, ignore_eos, so every mode does the same work.
TTFT is measured from sending a request (server: the client's clock; offline: the request's arrival in the engine)
to its first token. Before each timed phase the script waits for the CPU to go quiet (the machine is shared).
Writes benchmarks/results/server_overhead.json.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import gc
import json
import os
import platform
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from pdserve import SamplingParams  # noqa: E402

ENGINE_ARGS = {"dtype": "float32", "device": "cpu", "max_model_len": 1024, "max_num_seqs": 64,
               "max_num_batched_tokens": 2048, "block_size": 16, "enable_prefix_caching": True}
T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


def cpu_busy(interval: float = 1.0) -> float:
    def read():
        vals = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        return sum(vals), vals[3] + vals[4]
    t1, i1 = read()
    time.sleep(interval)
    t2, i2 = read()
    return 1.0 - (i2 - i1) / max(t2 - t1, 1)


def wait_quiet(max_wait: float, threshold: float = 0.15) -> float:
    deadline = time.monotonic() + max_wait
    busy = cpu_busy()
    while busy > threshold and time.monotonic() < deadline:
        busy = cpu_busy()
    return busy


def workload(n: int, vocab: int, seed: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    lens = [rng.randint(16, 256) for _ in range(n)]
    outs = [rng.randint(16, 128) for _ in range(n)]
    return [[rng.randrange(3, vocab) for _ in range(k)] for k in lens], outs


def summary(values: list[float]) -> dict:
    v = sorted(values)
    return {"mean": statistics.fmean(v), "median": statistics.median(v), "p90": v[int(0.9 * (len(v) - 1))],
            "max": v[-1]}


class Offline:
    def __init__(self, model: str):
        from pdserve import LLM
        self.llm = LLM(model, **ENGINE_ARGS)
        warm = [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)] * 4
        self.llm.generate([[5, 6, 7, 8]] * 4, warm, use_tqdm=False)

    def run(self, prompts, outs) -> dict:
        params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in outs]
        t = time.perf_counter()
        c = time.process_time()
        res = self.llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t
        return {"wall_s": wall, "cpu_s": time.process_time() - c,
                "ttft": [o.metrics.first_token_time - o.metrics.arrival_time for o in res],
                "output_tokens": sum(len(o.outputs[0].token_ids) for o in res), "usage_ok": True,
                "token_ids": [o.outputs[0].token_ids for o in res]}

    def ttft_probe(self, prompts) -> list[float]:
        """One request at a time: time to its first token (what a lone request waits)."""
        out = []
        for p in prompts:
            t = time.perf_counter()
            self.llm.generate([p], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True), use_tqdm=False)
            out.append(time.perf_counter() - t)
        return out

    def close(self) -> None:
        del self.llm
        gc.collect()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def proc_cpu(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        try:
            f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
        except OSError:
            pass
    return total


async def _one(session, url: str, prompt: list[int], max_tokens: int) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, "return_token_ids": True}
    t = time.perf_counter()
    first, usage, ids = None, None, []
    async with session.post(url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.content:
            if not line.startswith(b"data: {"):
                continue
            obj = json.loads(line[6:])
            if obj["choices"]:
                got = obj["choices"][0].get("token_ids")
                if got:
                    ids += got
                    first = first or time.perf_counter()
            if obj.get("usage"):
                usage = obj["usage"]
    return {"ttft": first - t, "usage": usage, "token_ids": ids}


async def _burst(url: str, prompts, outs) -> tuple[float, list[dict]]:
    import aiohttp
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=3600)) as s:
        await _one(s, url, [5, 6, 7, 8], 8)  # warm-up (also opens a connection)
        t = time.perf_counter()
        res = await asyncio.gather(*(_one(s, url, p, m) for p, m in zip(prompts, outs)))
        return time.perf_counter() - t, res


class Server:
    def __init__(self, model: str, backend: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        flags = [f"--{k.replace('_', '-')}={v}" for k, v in ENGINE_ARGS.items() if not isinstance(v, bool)]
        cmd = [sys.executable, "-m", "pdserve.cli", "serve", model, "--port", str(self.port), "--engine-backend",
               backend, "--log-level", "warning", *flags]
        self.logf = tempfile.NamedTemporaryFile("w+", prefix="pdserve-bench-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=self.logf, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        import urllib.request
        deadline = time.monotonic() + 300
        while True:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"server did not start:\n{Path(self.logf.name).read_text()[-3000:]}")
            try:
                if urllib.request.urlopen(self.url + "/health", timeout=2).status == 200:
                    break
            except OSError:
                time.sleep(0.3)

    def pids(self) -> list[int]:
        out = subprocess.run(["pgrep", "-g", str(self.proc.pid)], capture_output=True, text=True).stdout
        return [int(x) for x in out.split()]

    def run(self, prompts, outs) -> dict:
        pids = self.pids()
        c = proc_cpu(pids) + time.process_time()
        wall, res = asyncio.run(_burst(self.url, prompts, outs))
        return {"wall_s": wall, "cpu_s": proc_cpu(pids) + time.process_time() - c,
                "ttft": [r["ttft"] for r in res],
                "output_tokens": sum(r["usage"]["completion_tokens"] for r in res),
                "usage_ok": all(r["usage"]["completion_tokens"] == m == len(r["token_ids"])
                                for r, m in zip(res, outs)),
                "token_ids": [r["token_ids"] for r in res]}

    def ttft_probe(self, prompts) -> list[float]:
        async def probe():
            import aiohttp
            async with aiohttp.ClientSession() as s:
                return [(await _one(s, self.url, p, 1))["ttft"] for p in prompts]
        return asyncio.run(probe())

    def close(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            rc = self.proc.wait(10)
        self.logf.close()
        os.unlink(self.logf.name)
        return rc


def bench_model(size: str) -> dict:
    from pdserve.model.make_model import ensure_model
    model = str(ensure_model("qwen3", size, 0))
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    log(f"== {size}: starting the offline engine and {ARGS.backends} server(s)")
    runners = {"offline": Offline(model)}
    for backend in ARGS.backends.split(","):
        runners[f"server_{backend}"] = Server(model, backend)
    names = list(runners)
    runs = {n: [] for n in names}
    try:
        for rep in range(ARGS.repeats):
            prompts, outs = workload(ARGS.num_requests, vocab, ARGS.seed * 100 + rep)  # fresh: no prefix-cache hit
            n_prompt = sum(map(len, prompts))
            ref = None
            for name in names[rep % len(names):] + names[:rep % len(names)]:  # rotate the order
                busy = wait_quiet(ARGS.wait_idle)
                r = runners[name].run(prompts, outs)
                ids = r.pop("token_ids")
                ref = ref if name != "offline" else ids
                r.update(cpu_busy_before=busy, prompt_tokens=n_prompt, repeat=rep, _ids=ids,
                         total_tok_s=(n_prompt + r["output_tokens"]) / r["wall_s"])
                runs[name].append(r)
                log(f"   repeat {rep + 1}/{ARGS.repeats} {name:<16} {r['wall_s']:7.2f} s  "
                    f"{r['total_tok_s']:8.1f} total tok/s  cpu {r['cpu_s']:.1f} s  (cpu busy before {busy:.2f})")
            for name in names:
                r = runs[name][-1]
                r["same_tokens_as_offline"] = sum(a == b for a, b in zip(r.pop("_ids"), ref))
        probe_prompts = [p[:128] for p in workload(ARGS.probe_requests, vocab, ARGS.seed * 100 + 99)[0]]
        probes = {}
        for name in names:  # lone requests: the server's own cost per request, without queueing behind a burst
            wait_quiet(ARGS.wait_idle)
            probes[name] = runners[name].ttft_probe(probe_prompts)
            log(f"   lone-request TTFT {name:<16} median {statistics.median(probes[name]) * 1e3:.1f} ms")
    finally:
        codes = {n: r.close() for n, r in runners.items() if isinstance(r, Server)}
        runners["offline"].close()
    modes = {}
    for name in names:
        best = max(runs[name], key=lambda r: r["total_tok_s"])
        modes[name] = {"best_total_tok_s": best["total_tok_s"],
                       "median_total_tok_s": statistics.median(r["total_tok_s"] for r in runs[name]),
                       "ttft_median_s_of_best": statistics.median(best["ttft"]),
                       "lone_request_ttft_s": summary(probes[name]),
                       "exit_code": codes.get(name),
                       "runs": [{**{k: v for k, v in r.items() if k != "ttft"}, "ttft_s": summary(r["ttft"])}
                                for r in runs[name]]}
    off = modes["offline"]
    for name, m in modes.items():
        if name != "offline":
            m["ratio_best_vs_offline"] = m["best_total_tok_s"] / off["best_total_tok_s"]
            m["ratio_median_vs_offline"] = m["median_total_tok_s"] / off["median_total_tok_s"]
            m["added_ttft_median_s"] = m["ttft_median_s_of_best"] - off["ttft_median_s_of_best"]
            m["added_lone_request_ttft_median_s"] = (m["lone_request_ttft_s"]["median"]
                                                     - off["lone_request_ttft_s"]["median"])
    return {"model": model, "modes": modes}


def main() -> None:
    global ARGS
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="tiny,small", help="comma list of qwen3 sizes (default: tiny,small)")
    ap.add_argument("--backends", default="thread,process", help="server engine backends (default: both)")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="interleaved repeats of every mode; the table shows the "
                    "best (least disturbed) and the median")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--probe-requests", type=int, default=16, help="lone requests (128-token prompts, 1 output "
                    "token) per mode for the added-TTFT probe")
    ap.add_argument("--wait-idle", type=float, default=120.0, help="most seconds to wait for a quiet CPU per phase")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "server_overhead.json"))
    ARGS = ap.parse_args()
    import torch
    result = {"machine": {"cores": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
                          "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds")},
              "command": " ".join([Path(sys.executable).name] + sys.argv),
              "engine_args": ENGINE_ARGS, "num_requests": ARGS.num_requests,
              "workload": "prompt lengths ~ U[16, 256] random token ids, outputs ~ U[16, 128], greedy, ignore_eos",
              "models": {}}
    for size in ARGS.models.split(","):
        result["models"][size] = bench_model(size)
        Path(ARGS.out).parent.mkdir(parents=True, exist_ok=True)
        Path(ARGS.out).write_text(json.dumps(result, indent=1))
    print("\n| model | mode | best total tok/s | vs offline (best) | vs offline (median) | burst TTFT median s | "
          "lone-request TTFT median ms | added lone-request TTFT ms |")
    print("|---|---|---|---|---|---|---|---|")
    for size, r in result["models"].items():
        for name, m in r["modes"].items():
            off = name == "offline"
            ratio = "1" if off else f"{m['ratio_best_vs_offline']:.3f}"
            ratio_med = "1" if off else f"{m['ratio_median_vs_offline']:.3f}"
            added = "-" if off else f"{m['added_lone_request_ttft_median_s'] * 1e3:+.1f}"
            print(f"| {size} | {name} | {m['best_total_tok_s']:.1f} | {ratio} | {ratio_med} | "
                  f"{m['ttft_median_s_of_best']:.3f} | {m['lone_request_ttft_s']['median'] * 1e3:.1f} | {added} |")
    log(f"written to {ARGS.out}")


ARGS = None
if __name__ == "__main__":
    main()
