"""Installs the fakes and runs campaigns: a fixed list of seeds (CI) or random seeds for a while (soak), shrinking
the first failure of each kind and printing how to rerun it."""
from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import tempfile
import time
from pathlib import Path
from unittest import mock

from tests.fuzz import fake_connector  # noqa: F401  (registers FuzzConnector)
from tests.fuzz.driver import char_table, patched_engine_time, run_case
from tests.fuzz.fake_model import fake_load_model, make_model_dir
from tests.fuzz.shrink import shrink
from tests.fuzz.workload import gen_case

RERUN = ("PDSERVE_FUZZ_SEED={seed} PDSERVE_FUZZ_COUNT=1 .venv/bin/python -m pytest -q tests/core/test_randomized.py "
         "-k fake")
REPLAY = "PDSERVE_FUZZ_CASE={path} .venv/bin/python -m pytest -q tests/core/test_randomized.py -k fake"


@contextlib.contextmanager
def quiet():
    """A failed model step logs its traceback at ERROR; the failure report carries the message."""
    log = logging.getLogger("pdserve")
    level, log.level = log.level, logging.CRITICAL
    try:
        yield
    finally:
        log.setLevel(level)


@contextlib.contextmanager
def fakes(tiny_model_dir: str):
    """The fake model behind ModelRunner, the tokenizer loaded once, the fake connector known to the config (its
    validation accepts only KNOWN_CONNECTORS; PD_CONNECTORS makes a consumer of it a P/D consumer, as tcp's).
    Yields the model directory the fuzzer's engines load."""
    import pdserve.kv_transfer_config as config
    from pdserve.core import engine, step_pipeline
    from tests.fuzz.fake_connector import NAME
    cached = functools.lru_cache(maxsize=None)(engine.load_tokenizer)
    with tempfile.TemporaryDirectory(prefix="pdserve-fuzz-") as tmp, quiet(), \
            mock.patch("pdserve.worker.model_runner.load_model", fake_load_model), \
            mock.patch.object(engine, "load_tokenizer", cached), \
            mock.patch.object(step_pipeline, "time", patched_engine_time()), \
            mock.patch.object(config, "KNOWN_CONNECTORS", config.KNOWN_CONNECTORS + (NAME,)), \
            mock.patch.object(config, "PD_CONNECTORS", config.PD_CONNECTORS + (NAME,)):
        yield str(make_model_dir(tiny_model_dir, Path(tmp) / "fake-model"))


def tolerated() -> frozenset:
    """PDSERVE_FUZZ_TOLERATE="defect 1,defect 5": failure labels to ignore while those fixes are under way. Empty by
    default: the test checks everything."""
    return frozenset(t.strip() for t in os.environ.get("PDSERVE_FUZZ_TOLERATE", "").split(",") if t.strip())


def campaign(model_dir: str, seeds, deadline: float | None = None, shrink_s: float = 20.0, max_shrinks: int = 8,
             log=print, tol: frozenset | None = None, progress_s: float | None = None) -> dict:
    """Runs gen_case(seed) for each seed (until `deadline`, a time.monotonic(), which shrinking counts against too).
    Returns the counts and, per failure signature, its first case shrunk. `progress_s`: log the counts that often."""
    chars = char_table(model_dir)
    tol = tolerated() if tol is None else tol
    stats = {"workloads": 0, "steps": 0, "requests": 0, "failures": {}, "seconds": 0.0}
    t0 = last = time.monotonic()
    for seed in seeds:
        now = time.monotonic()
        if deadline is not None and now > deadline:
            break
        if progress_s and now - last > progress_s:
            last = now
            log(f"[fuzz] {now - t0:.0f} s: {stats['workloads']} workloads, {stats['steps']} steps, "
                f"{sum(e['count'] for e in stats['failures'].values())} failures")
        case = gen_case(seed, chars)
        res = run_case(case, model_dir, tol)
        stats["workloads"] += 1
        stats["steps"] += res.steps
        stats["requests"] += len(case["reqs"])
        for f in res.failures:
            sig = f.signature
            entry = stats["failures"].setdefault(sig, {"count": 0, "seeds": []})
            entry["count"] += 1
            if len(entry["seeds"]) < 5:
                entry["seeds"].append(seed)
            if entry["count"] == 1 and len([e for e in stats["failures"].values() if "case" in e]) < max_shrinks:
                budget = shrink_s if deadline is None else max(2.0, min(shrink_s, deadline - time.monotonic()))
                small, tries = shrink(case, lambda c, sig=sig: any(g.signature == sig for g in
                                                                   run_case(c, model_dir, tol).failures), budget)
                detail = next((g for g in run_case(small, model_dir, tol).failures if g.signature == sig), f)
                entry.update(case=small, detail=str(detail), tries=tries, path=_save(small, sig))
                log(report_one(sig, entry))
    stats["seconds"] = time.monotonic() - t0
    return stats


def _save(case: dict, sig: str) -> str:
    d = Path(os.environ.get("PDSERVE_FUZZ_OUT") or Path(tempfile.gettempdir()) / "pdserve-fuzz")
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"case-{case['seed']}-{abs(hash(sig)) % 10**6}.json"
    path.write_text(json.dumps(case))
    return str(path)


def report_one(sig: str, e: dict) -> str:
    c = e["case"]
    return (f"\nFAILURE {sig}\n  first seed {e['seeds'][0]} (rerun: {RERUN.format(seed=e['seeds'][0])})\n"
            f"  shrunk in {e['tries']} tries to cfg={json.dumps(c['cfg'])}\n"
            f"  reqs={json.dumps(c['reqs'])}\n  {e['detail'][:1500]}\n  replay: {REPLAY.format(path=e['path'])}")


def summary(stats: dict) -> str:
    lines = [f"{stats['workloads']} workloads, {stats['requests']} requests, {stats['steps']} engine steps in "
             f"{stats['seconds']:.1f} s; {len(stats['failures'])} failure kinds"]
    for sig, e in stats["failures"].items():
        lines.append(f"  {e['count']:5d} x {sig} (seeds {e['seeds']})")
    return "\n".join(lines)
