"""Hostile request bodies against a serving node: what they cost the other users (issue 37).

    .venv/bin/python benchmarks/hostile_bodies.py   # tiny model; writes benchmarks/results/hostile_bodies.json

One `pdserve serve` process (default backend and limits). Each round runs a greedy stream of --stream-tokens
tokens twice, alternating: quiet (nothing else), and hostile (a sender posting the issue's bodies back to back while
the stream runs, streams following one another until every body was sent once: a 20 MiB body, a prompt that
cannot fit, 100,000-item lists of stop strings, stop ids, messages and a full-vocabulary logit_bias, a 15 MiB dense
list of token ids, a request's own Jinja chat template). Meanwhile a
prober asks GET /health every 10 ms: its latency bounds how long the server's event loop was held (a stalled loop
answers nothing), as a client feels it.

Reported: the stream's inter-token latency (median, p99, max) quiet and hostile, pooled over rounds, and their
ratios (target: hostile p99 ITL within 2x of quiet); per body, its status, the field its error names and its
latency (target: each a 4xx naming the field); the /health probe's p50 / p99 / max per phase (target: the max
under 100 ms). A shared 2-core machine adds noise: run it on a quiet one for figures to quote.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from pdserve.bench.launcher import Deployment, free_port

ROOT = Path(__file__).resolve().parent.parent

STREAM_PROMPT = "def fibonacci(n):"
TEMPLATE = "{% for a in range(10**4) %}{% for b in range(10**4) %}{{ a * b }}{% endfor %}{% endfor %}"


def hostile_bodies(max_model_len: int) -> list[tuple[str, str, bytes, str]]:
    """(name, path, raw body, the field or flag its error must name)."""
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    dense = b'{"prompt": [' + b"0," * (15 << 19) + b'0], "max_tokens": 4}'
    cases = [
        ("20 MiB body", "/v1/completions", {"prompt": "x" * (20 << 20), "max_tokens": 4}, "--max-body-bytes"),
        ("prompt that cannot fit", "/v1/completions",
         {"prompt": "many words " * (40 * max_model_len // 11), "max_tokens": 4}, "prompt"),
        ("100k stop strings", "/v1/chat/completions", chat | {"stop": ["x"] * 100_000}, "stop"),
        ("100k stop_token_ids", "/v1/chat/completions", chat | {"stop_token_ids": [5] * 100_000}, "stop_token_ids"),
        ("100k messages", "/v1/chat/completions",
         {"messages": [{"role": "user", "content": "hello world"}] * 100_000, "max_tokens": 4}, "messages"),
        ("full-vocabulary logit_bias", "/v1/chat/completions",
         chat | {"logit_bias": {str(i): 1 for i in range(151_936)}}, "logit_bias"),
        ("request chat template", "/v1/chat/completions",
         chat | {"chat_template_kwargs": {"chat_template": TEMPLATE}}, "chat_template_kwargs"),
    ]
    out = [(name, path, json.dumps(body).encode(), field) for name, path, body, field in cases]
    out.insert(5, ("15 MiB dense id list", "/v1/completions", dense, "values"))
    return out


def names_field(r: httpx.Response, field: str) -> bool:
    try:
        err = r.json()["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return err.get("param") == field or field in str(err.get("message", ""))


class Prober(threading.Thread):
    """GET /health every `every` s; latencies in s."""

    def __init__(self, url: str, every: float = 0.01):
        super().__init__(daemon=True)
        self.url, self.every, self.lat, self.stop_ = url, every, [], threading.Event()

    def run(self) -> None:
        with httpx.Client(timeout=30) as c:
            while not self.stop_.is_set():
                t = time.perf_counter()
                try:
                    c.get(self.url + "/health")
                except httpx.HTTPError:
                    pass
                self.lat.append(time.perf_counter() - t)
                time.sleep(self.every)


def stream_itls(url: str, tokens: int, started: threading.Event) -> list[float]:
    body = {"prompt": STREAM_PROMPT, "max_tokens": tokens, "ignore_eos": True, "temperature": 0, "stream": True}
    arrivals = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                arrivals.append(time.perf_counter())
                started.set()
    return [b - a for a, b in zip(arrivals, arrivals[1:])]


def run_phase(url: str, tokens: int, bodies, hostile: bool) -> dict:
    started, done, one_pass = threading.Event(), threading.Event(), threading.Event()
    answers = []

    def attack():
        started.wait(60)
        with httpx.Client(base_url=url, timeout=300) as h:
            while not done.is_set():
                for name, path, raw, field in bodies:
                    if done.is_set() and one_pass.is_set():
                        break
                    t = time.perf_counter()
                    r = h.post(path, content=raw, headers={"content-type": "application/json"})
                    answers.append({"body": name, "status": r.status_code, "names_field": names_field(r, field),
                                    "latency_ms": round((time.perf_counter() - t) * 1e3, 1),
                                    "message": r.text[:160] if r.status_code != 200 else ""})
                one_pass.set()
    sender = threading.Thread(target=attack, daemon=True) if hostile else None
    prober = Prober(url)
    prober.start()
    if sender:
        sender.start()
    try:  # a hostile phase streams on until every body was sent once
        itls = stream_itls(url, tokens, started)
        while hostile and not one_pass.is_set():
            itls += stream_itls(url, tokens, started)
    finally:
        done.set()
        started.set()
        prober.stop_.set()
        prober.join(10)
        if sender:
            sender.join(300)
    return {"itls": itls, "probe": prober.lat, "answers": answers}


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def summary(xs: list[float]) -> dict:
    return {"median_ms": round(statistics.median(xs) * 1e3, 2), "p99_ms": round(pct(xs, 0.99) * 1e3, 2),
            "max_ms": round(max(xs) * 1e3, 2), "n": len(xs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=os.path.expanduser("~/.cache/pdserve/models/qwen3-tiny-s0"),
                    help="Model directory (default: the tiny model `make demo` builds).")
    ap.add_argument("--rounds", type=int, default=3, help="Quiet/hostile pairs, alternating (default: 3).")
    ap.add_argument("--stream-tokens", type=int, default=400,
                    help="Tokens of the measured stream per phase (default: 400).")
    ap.add_argument("--max-model-len", type=int, default=2048, help="The server's --max-model-len (default: 2048).")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/hostile_bodies.json"),
                    help="Result JSON (default: benchmarks/results/hostile_bodies.json).")
    args = ap.parse_args()
    if not Path(args.model).is_dir():
        sys.exit(f"--model: {args.model} is not a model directory (make demo builds the default one)")
    log_dir = Path(tempfile.mkdtemp(prefix="hostile_bodies-"))  # the server's log, kept for a look after
    dep = Deployment("hostile", log_dir)
    bodies = hostile_bodies(args.max_model_len)
    phases = {"quiet": [], "hostile": []}
    try:
        url = dep.spawn("server", ["serve", args.model, "--max-model-len", str(args.max_model_len)],
                        free_port(), {})
        dep.wait_healthy(240)
        stream_itls(url, 16, threading.Event())  # warm-up
        for i in range(args.rounds):
            for kind in ("quiet", "hostile") if i % 2 == 0 else ("hostile", "quiet"):
                ph = run_phase(url, args.stream_tokens, bodies, kind == "hostile")
                phases[kind].append(ph)
                print(f"round {i + 1} {kind}: ITL p99 {pct(ph['itls'], 0.99) * 1e3:.1f} ms, /health max "
                      f"{max(ph['probe']) * 1e3:.1f} ms, {len(ph['answers'])} hostile answers", flush=True)
    finally:
        dep.stop()
    itl = {k: summary([x for ph in v for x in ph["itls"]]) for k, v in phases.items()}
    probe = {k: summary([x for ph in v for x in ph["probe"]]) for k, v in phases.items()}
    answers = [a for ph in phases["hostile"] for a in ph["answers"]]
    per_body = {}
    for name, *_ in bodies:
        mine = [a for a in answers if a["body"] == name]
        if mine:
            per_body[name] = {"statuses": sorted({a["status"] for a in mine}),
                              "all_4xx_naming_the_field": all(400 <= a["status"] < 500 and a["names_field"]
                                                              for a in mine),
                              "median_latency_ms": statistics.median(a["latency_ms"] for a in mine),
                              "max_latency_ms": max(a["latency_ms"] for a in mine), "sent": len(mine),
                              "example": mine[0]["message"]}
    ratio = {q: round(itl["hostile"][q] / itl["quiet"][q], 2) for q in ("median_ms", "p99_ms", "max_ms")}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    result = {"command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "commit": commit,
              "date": time.strftime("%Y-%m-%d %H:%M:%S"), "load_average_at_end": os.getloadavg(),
              "machine": f"{platform.machine()}, {os.cpu_count()} cores", "rounds": args.rounds,
              "itl": itl, "itl_ratio_hostile_over_quiet": ratio, "health_probe": probe, "bodies": per_body,
              "targets": {"p99_itl_within_2x": ratio["p99_ms"] <= 2.0,
                          "every_body_a_4xx_naming_its_field": all(b["all_4xx_naming_the_field"]
                                                                   for b in per_body.values())
                          and len(per_body) == len(bodies),
                          "health_probe_max_under_100ms": probe["hostile"]["max_ms"] < 100.0}}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result[k] for k in ("itl", "itl_ratio_hostile_over_quiet", "health_probe", "targets")},
                     indent=1))
    for name, b in per_body.items():
        print(f"  {name:28s} {b['statuses']} field named: {b['all_4xx_naming_the_field']} "
              f"median {b['median_latency_ms']:.0f} ms (x{b['sent']})")


if __name__ == "__main__":
    main()
