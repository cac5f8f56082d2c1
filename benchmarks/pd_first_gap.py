"""D's half of the gap between a first-token request's first two tokens, piece by piece, at idle (issue 35).

    .venv/bin/python benchmarks/pd_first_gap.py            # ~30 s; writes benchmarks/results/pd_first_gap.json

P is a real `pdserve serve` process (kv_producer, one thread, as bench pd's P on two cores); D is an engine in this
process (kv_consumer, one thread, kv_load_wait_ms 0). For each of --requests 128-token prompts (the demo workload's),
P answers the first token with its params over HTTP, D admits the request and its KV pull is timed in parts (the
consumer's private methods wrapped, nothing changed): `to_worker` (the load queued on the engine thread until P's
worker thread has it), `to_send` (a session from the pool, the read sent, D's blocks readied), `wait` (until P's
answer is in: P's handling and the bytes), `after` (verification, bookkeeping), and `pull` in all (D's metrics add
the wait for the engine's next poll). Then, with the load over before the step is timed, D's first
own step (a plain decode of P's token) against the steady steps that follow (`execute`: the model runner's part of
a step), and a bare round trip to P's KV server (`renew`, once the requests are done). Medians over the requests
after the first --skip.
Then the direct hand-off (docs/pd.md "Early decode"): D takes each request first (`await_kv`, stepping as an idle
engine does), P is asked (a thread of this process, as the router would), and `direct_params_to_own_token_ms` is
from P's params reaching D's loader to D's first own token, `direct_own_token_after_p_answer_ms` from P's HTTP answer
(which the router streams as the first token) to that token: the first gap at idle, less the router's relays.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_file import write_result  # noqa: E402
from spies import timed  # noqa: E402

TOKEN = "pd-first-gap-bench"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=30, help="First-token requests handed from P to D (default 30).")
    ap.add_argument("--skip", type=int, default=5, help="Leading requests left out of the medians (warm-up).")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "pd_first_gap.json"))
    args = ap.parse_args()
    if args.requests <= args.skip:
        ap.error("--requests must be more than --skip")
    os.environ["OMP_NUM_THREADS"] = "1"  # before torch: D's one thread, as bench pd gives each node on two cores
    import httpx
    import torch

    from pdserve import LLM, SamplingParams
    from pdserve.bench.launcher import Deployment, free_port
    from pdserve.model.make_model import ensure_model
    from pdserve.sampling_params import RequestOutputKind
    from pdserve.transfer.tcp import consumer as tcp_consumer

    torch.set_num_threads(1)
    model = str(ensure_model("qwen3", "tiny", 0))
    name = Path(model).name
    kv_port = free_port()
    p_kv = {"kv_connector": "TcpConnector", "kv_role": "kv_producer", "kv_port": kv_port, "kv_auth_token": TOKEN}
    dep = Deployment("first-gap", Path(tempfile.mkdtemp(prefix="pd-first-gap-")))
    try:
        url = dep.spawn("prefill", ["serve", model, "--log-level", "warning", "--max-model-len", "512",
                                    "--kv-cache-memory-gb", "0.05", "--kv-transfer-config", json.dumps(p_kv)],
                        free_port(), {"OMP_NUM_THREADS": "1"})
        dep.wait_healthy(120)
        d = LLM(model, max_model_len=512, kv_cache_memory_gb=0.05, kv_transfer_config={
            "kv_connector": "TcpConnector", "kv_role": "kv_consumer", "kv_auth_token": TOKEN, "kv_load_wait_ms": 0})
        eng = d.engine
        consumer = eng.connector.consumer
        marks: dict[str, dict] = {}
        Consumer = tcp_consumer.TcpConsumer
        pull, transfer, start = Consumer._pull, Consumer._transfer, Consumer.start_load_kv

        def timed_start(self, meta):
            for job in meta.loads:
                marks.setdefault(job.request_id, {})["queued"] = time.perf_counter()
            return start(self, meta)

        def timed_pull(self, job, queued):
            m = marks.setdefault(job.request_id, {})
            m["worker"] = time.perf_counter()
            try:
                return pull(self, job, queued)
            finally:
                m["done"] = time.perf_counter()

        def timed_transfer(self, session, job):
            m = marks[job.request_id]
            m["session"] = time.perf_counter()
            recv = session.recv

            def timed_recv(*a, **kw):
                m.setdefault("recv_call", time.perf_counter())
                try:
                    return recv(*a, **kw)
                finally:
                    m["recv_return"] = time.perf_counter()
            session.recv = timed_recv
            try:
                return transfer(self, session, job)
            finally:
                del session.recv
        Consumer.start_load_kv, Consumer._pull, Consumer._transfer = timed_start, timed_pull, timed_transfer
        step_ms: list[float] = []
        eng.runner.execute = timed(eng.runner.execute, step_ms)
        sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
        rows, params = [], None
        for i in range(args.requests):
            prompt = [(i * 131 + j * 7) % 8000 + 3 for j in range(args.prompt_len)]
            body = {"model": name, "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
                    "kv_transfer_params": {"do_remote_decode": True, "first_token": True}}
            params = httpx.post(url + "/v1/completions", json=body, timeout=60).json()["kv_transfer_params"]
            rid = f"d{i}"
            eng.add_request(prompt, sp, request_id=rid, kv_transfer_params=params)
            eng.step()  # admits it and starts its load (kv_load_wait_ms 0: no step waits for it)
            while rid not in marks or "done" not in marks[rid]:  # the load ends apart from any timed step
                time.sleep(0.0002)
            first_exec, steady = None, []
            while eng.has_unfinished_requests():
                step_ms.clear()
                outs = eng.step()
                own = [o.timing for o in outs if o.request_id == rid and o.timing]
                if own:
                    first_exec = sum(step_ms)
                elif first_exec is not None and step_ms:
                    steady.append(sum(step_ms))
            m = marks[rid]
            rows.append({"pull_ms": 1e3 * (m["done"] - m["queued"]),
                         "to_worker_ms": 1e3 * (m["worker"] - m["queued"]),
                         "to_send_ms": 1e3 * (m["recv_call"] - m["session"]) + 1e3 * (m["session"] - m["worker"]),
                         "wait_ms": 1e3 * (m["recv_return"] - m["recv_call"]),
                         "after_ms": 1e3 * (m["done"] - m["recv_return"]),
                         "first_step_execute_ms": first_exec,
                         "steady_step_execute_ms": statistics.median(steady)})
            time.sleep(0.05)  # idle between requests, as at a low rate
        direct = []
        for i in range(args.requests):
            prompt = [(i * 137 + j * 11) % 8000 + 5 for j in range(args.prompt_len)]
            key, rid = f"{i:032x}", f"a{i}"
            eng.add_request(prompt, sp, request_id=rid, kv_transfer_params={
                "await_kv": {"host": "127.0.0.1", "port": kv_port, "key": key}})
            eng.step()  # its blocks, and its await asked
            answered: list[float] = []
            body = {"model": name, "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
                    "kv_transfer_params": {"do_remote_decode": True, "first_token": True, "handoff_key": key}}
            asker = threading.Thread(target=lambda b=body: (httpx.post(url + "/v1/completions", json=b, timeout=60),
                                                            answered.append(time.monotonic())))
            asker.start()
            own = None
            while own is None:
                own = next((o for o in eng.step() if o.request_id == rid and o.timing), None)
            t_own = time.monotonic()
            asker.join()
            drain_until = time.monotonic() + 10
            while eng.has_unfinished_requests() and time.monotonic() < drain_until:
                eng.step()
            direct.append({"direct_params_to_own_token_ms": 1e3 * (own.metrics.first_own_token_time -
                                                                   own.metrics.arrival_time),
                           "direct_own_token_after_p_answer_ms": 1e3 * (t_own - answered[0])})
            time.sleep(0.05)
        renew = []
        for _ in range(30):
            t = time.perf_counter()
            consumer.check_remote(params)
            renew.append(1e3 * (time.perf_counter() - t))
            time.sleep(0.01)
        kept = rows[args.skip:]
        medians = {k: statistics.median(r[k] for r in kept) for k in kept[0]}
        medians.update({k: statistics.median(r[k] for r in direct[args.skip:]) for k in direct[0]})
        medians["renew_round_trip_ms"] = statistics.median(renew)
        for k, v in medians.items():
            print(f"{k:<26} {v:8.3f}")
        write_result(args.out, args, medians=medians, rows=rows, direct=direct)
        eng.shutdown()
    finally:
        dep.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
