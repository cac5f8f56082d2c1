"""`pdserve sim calibrate`: measure this machine's engine and fit a linear step-time profile.

For each graph setting the device allows (graphs: FULL decode steps and PIECEWISE mixed ones; eager: NONE), a real
`LLMEngine` runs a grid of batches, `rows` requests of `context` prompt tokens decoding `decode_steps` tokens each:
their prefill steps sample the token dimension, their decode steps the row and context dimensions. Every
`engine.step()` is timed whole (scheduling and output processing included: the simulator adds nothing on top) with
its shape read from the scheduler's output and the dispatcher's choice, and the linear profile (profile.py) is
fitted by least squares on relative error with coefficients kept >= 0 (fit()).
On CPU the modes differ only in what runs eagerly around the same callables (docs/graphs.md): the fitted bases are
this machine's, not graph speedups.

The graphs engine then measures the profile's `idle` section (`measure_idle`): how much a step costs extra after
the engine slept 2-100 ms, and how that extra fades over the steps after it (the grid's steps run back to back and
never show it; a real node at a low rate pays it at each arrival).

`--served` then measures what serving adds (the profile's `served` section, profile.py): a real `pdserve serve`
(its default backend, the same graph settings and thread count) gets the same grid as streamed completions, each
batch's requests sent together. Once every request of a batch streams, its steps are r rows decoding: a stream's mean
gap over that run (its chunks may reach the client in bursts; the run's length may not) is a served decode step of
known shape, and `step_scale` and `step_overhead_s` are fitted to the batches' runs against the bare profile's
prediction (relative error, both >= 0). A lone request's time to its first chunk, less its served
prefill step, is what a request spends outside the steps: `request_latency_s` is the median. The served grid runs
`--served-repeats` times (3): each batch's decode run is its median over them.
How late each chunk of a decode run reaches the client against the run's pace (a quadratic fitted to its chunks:
steps slow as the context grows), past the stream's median chunk, gives `chunk_delay_quantiles_s`, the host's stalls
as the client sees them, and per batch size `chunk_delay_by_rows`.
Then, per context, ARRIVAL_PROBES lone streams each see a request of that context arrive halfway through: the
stream's gap that ends with its chunk nearest the newcomer's first chunk, less the served prefill step of that
context, gives `arrival_delay_s` (the median, >= 0): what a step that admits and answers a newcomer costs the other
streams beyond its time (the engine takes the request in between steps, the server answers it first).
`--served-neighbours N` starts N more such servers and runs the grid again while each of them decodes batches back
to back: each batch's decode run beside them, against the same run alone, gives `neighbour_scale` (the median ratio
less 1, per neighbour), what `pdserve sim --shared-host` applies to a step per other node mid-step on the machine.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from pdserve.sim.node import _shape
from pdserve.sim.profile import MODES, Idle, StepShape, profile_from_dict
from pdserve.sim.trace import TraceRequest, prompt_token_ids

FEATURES = ("per_token_s", "per_row_s", "per_context_token_s")
LONE_PROBES = 4  # lone requests per context after the served grid, for the request latency's median
ARRIVAL_PROBES = 4  # streams per context that see a newcomer arrive (arrival_delay_s, its median)
DELAY_QUANTILES = 101  # chunk_delay_quantiles_s: 1% apart (the most a profile takes)
DELAY_MIN_CHUNKS = 50  # chunks a batch size needs for quantiles of its own (chunk_delay_by_rows)
# the idle section (measure_idle): the pauses probed, each this many times, around these steady and timed steps
IDLE_GAPS_S = (0.002, 0.005, 0.01, 0.02, 0.05, 0.1)
IDLE_REPEATS = 5
IDLE_WARM, IDLE_AFTER = 3, 2
# Each grid batch's prefill is timed this many times more (`_prefills`), each step's median kept in place of the
# grid's one timing of it: a prefill step shape is seen once per batch, and that one reading (the first replay of a
# graph size, a cold path) came out up to 1.9x a repeat's (session 35: a 64-token prefill 6.2 ms once, 3.3 again).
PREFILL_REPEATS = 3
_PREFILL_IDS = itertools.count()  # the prefill pass's request ids, so its prompts are its own (and no cache hit)


def _features(s: StepShape) -> list[float]:
    return [1.0 if s.mode == m else 0.0 for m in MODES] + [s.padded_tokens, s.num_reqs, s.context_tokens]


def measure(model: str, rows: list[int], contexts: list[int], decode_steps: int, eager: bool,
            engine_kwargs: Optional[dict] = None, progress: Optional[Callable[[str], None]] = None,
            idle: bool = False) -> tuple[list[tuple[StepShape, float]], dict]:
    """(shape, seconds) of every step of the grid on one engine; and the model facts a profile records (with
    `idle`, the profile's `idle` section measured on the same engine after the grid, `measure_idle`)."""
    from pdserve.config import EngineConfig
    from pdserve.core.engine import LLMEngine
    from pdserve.model.hf_config import model_dims
    from pdserve.worker.model_runner import kv_bytes_per_block
    # capture sizes up to the largest prefill step of the grid, so mixed steps ride PIECEWISE where graphs are on
    kw = dict(max_num_seqs=max(rows), max_model_len=max(contexts) + decode_steps + 1, device="cpu",
              enforce_eager=eager, max_cudagraph_capture_size=min(512, max(rows) * max(contexts)))
    kw.update(engine_kwargs or {})
    engine = LLMEngine(EngineConfig.from_kwargs(model, **kw))
    vocab = engine.vocab_size
    seen = spy_steps(engine)
    samples: list[tuple[StepShape, float]] = []
    n = 0
    grid = [(0, 0)] + [(r, c) for r in rows for c in contexts]  # (0, 0): a warm-up batch, not kept
    for r, c in grid:
        steps = _run_batch(engine, seen, [f"cal-{n + i}" for i in range(max(r, 1))], c or 8, decode_steps, seed=1)
        n += max(r, 1)
        if r:
            samples += steps
        if progress is not None and r:
            progress(f"{'eager' if eager else 'graphs'}: {r} rows x {c} tokens, {len(samples)} steps so far")
    # the grid's steps with prompt tokens in them, timed once each, give way to the prefill pass's medians
    samples = [(s, t) for s, t in samples if s.num_tokens == s.num_reqs] + \
        _prefills(engine, grid[1:], seen, PREFILL_REPEATS)
    # the model's context, not the grid's: a profile serves any run of this model
    facts = {"max_model_len": min(engine.hf_config.get("max_position_embeddings", 4096), 4096),
             "device": engine.device.type, "vocab_size": vocab,
             "kv_bytes_per_token": kv_bytes_per_block(model_dims(engine.hf_config, engine.max_model_len), 1,
                                                      engine.dtype)}
    if idle and decode_steps >= IDLE_WARM + IDLE_AFTER + 1:
        facts["idle"] = measure_idle(engine, min(contexts), decode_steps)
        if progress is not None:
            progress("idle: " + ", ".join(f"{1e3 * e:.2f} ms after {1e3 * g:g} ms" for g, e in
                                          zip(facts["idle"]["gaps_s"], facts["idle"]["extra_s"])))
    engine.shutdown()
    return samples, facts


def _run_batch(engine, seen: list, ids: list[str], prompt_len: int, max_tokens: int, seed: int,
               ) -> list[tuple[StepShape, float]]:
    """Greedy requests `ids` of `prompt_len` tokens each (prompt_token_ids by id and `seed`), added together and run
    to the end: (shape, seconds) of every step that ran rows. `seen`: the engine's spy record (spy_steps)."""
    from pdserve.sampling_params import SamplingParams
    vocab = engine.vocab_size
    for rid in ids:
        tr = TraceRequest(rid, 0.0, prompt_len, max_tokens)
        engine.add_request(prompt_token_ids(tr, vocab, seed=seed), SamplingParams(
            max_tokens=max_tokens, ignore_eos=True, temperature=0), request_id=rid)
    steps = []
    while engine.has_unfinished_requests():
        seen.clear()
        t0 = time.perf_counter()
        engine.step()
        dt = time.perf_counter() - t0
        if seen and seen[-1][0].rows and seen[-1][1] is not None:
            out, (mode, desc, _, num_tokens) = seen[-1]
            steps.append((_shape(out, mode.value, desc.num_tokens, num_tokens), dt))
    return steps


def spy_steps(engine) -> list:
    """What each step of `engine` scheduled and the dispatcher's choice for it, as [SchedulerOutput, choice]
    entries appended to the list returned (the caller clears it)."""
    seen: list = []
    schedule, choose = engine.scheduler.schedule, engine.runner.choose_graph

    def spy_schedule():
        seen.append([schedule(), None])
        return seen[-1][0]

    def spy_choose(step_rows):
        seen[-1][1] = choose(step_rows)
        return seen[-1][1]
    engine.scheduler.schedule, engine.runner.choose_graph = spy_schedule, spy_choose
    return seen


def _prefills(engine, grid: list[tuple[int, int]], seen: list, repeats: int) -> list[tuple[StepShape, float]]:
    """(shape, median seconds) of every step of each grid batch's prefill, the batch run `repeats` times with
    prompts of their own (no prefix-cache hit) and one output token (so no decode row joins a step): the same
    shapes each run, step by step. `seen`: the engine's spy record (measure's)."""
    out = []
    for r, c in grid:
        runs = [_run_batch(engine, seen, [f"cal-prefill-{next(_PREFILL_IDS)}" for _ in range(r)], c, 1, seed=3)
                for _ in range(repeats)]
        for i in range(min(len(run) for run in runs)):
            out.append((runs[0][i][0], statistics.median(run[i][1] for run in runs)))
    return out


def measure_idle(engine, context: int, decode_steps: int) -> dict:
    """The profile's `idle` section: lone requests of `context` tokens; after IDLE_WARM steady decode steps the
    engine sleeps one of IDLE_GAPS_S (taken in turn, IDLE_REPEATS times each) and the next IDLE_AFTER steps are
    timed against the steady ones' median. `extra_s`: each gap's median first-step extra (>= 0, never falling as
    gaps grow: a longer pause cools at least as much); `decay`: the second step's extra over the first's, the median
    over the gaps of 10 ms and more (where the extra stands clear of the steps' noise), in [0, 0.9]."""
    from pdserve.sampling_params import SamplingParams
    firsts: dict[float, list[float]] = {g: [] for g in IDLE_GAPS_S}
    ratios = []
    for k in range(IDLE_REPEATS * len(IDLE_GAPS_S)):
        gap = IDLE_GAPS_S[k % len(IDLE_GAPS_S)]
        tr = TraceRequest(f"idle-{k}", 0.0, context, decode_steps)
        engine.add_request(prompt_token_ids(tr, engine.vocab_size, seed=4), SamplingParams(
            max_tokens=decode_steps, ignore_eos=True, temperature=0), request_id=tr.request_id)
        times = []
        while engine.has_unfinished_requests():
            if len(times) == 1 + IDLE_WARM:  # the prefill, then the steady decode steps
                time.sleep(gap)
            t0 = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t0)
        steady = statistics.median(times[1:1 + IDLE_WARM])
        extra = [t - steady for t in times[1 + IDLE_WARM:1 + IDLE_WARM + IDLE_AFTER]]
        firsts[gap].append(extra[0])
        if gap >= 0.01 and extra[0] > 0:
            ratios.append(extra[1] / extra[0])
    out, floor = [], 0.0
    for g in IDLE_GAPS_S:
        floor = max(floor, statistics.median(firsts[g]), 0.0)
        out.append(floor)
    decay = min(0.9, max(0.0, statistics.median(ratios))) if ratios else 0.0
    return {"gaps_s": list(IDLE_GAPS_S), "extra_s": out, "decay": decay}


def _nonneg_lstsq(X: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0: a column that fits negative is dropped (the most negative first)
    and the rest refitted; columns that are all zero (a mode never measured) stay 0."""
    active = [j for j in range(X.shape[1]) if X[:, j].any()]
    coef = np.zeros(X.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(X[:, active], y, rcond=None)
        if (sol >= 0).all():
            coef[active] = sol
            break
        del active[int(np.argmin(sol))]
    return coef


def fit(samples: list[tuple[StepShape, float]]) -> tuple[dict, dict]:
    """(coefficients, fit report). Relative error is what is minimized (each step weighted by 1 / its time): steps
    range over two orders of magnitude, and on a shared machine a step now and then takes several times its due
    (another process had the core); such a step's relative residual is bounded near -1, so it barely moves the fit,
    where in plain least squares it would pull every coefficient up."""
    if len(samples) < 4:
        raise ValueError(f"{len(samples)} measured steps are too few to fit a profile: widen the grid")
    X = np.array([_features(s) for s, _ in samples])
    y = np.array([t for _, t in samples])
    coef = _nonneg_lstsq(X / y[:, None], np.ones_like(y))
    rel = np.abs(X @ coef - y) / y
    seen_modes = {s.mode for s, _ in samples}
    base = {m: float(coef[i]) for i, m in enumerate(MODES)}
    missing = [m for m in MODES if m not in seen_modes]
    for m in missing:  # no step of that mode ran here: it costs what an eager step does
        base[m] = base["NONE"] if "NONE" in seen_modes else max(base.values())
    report = {"samples": len(samples), "median_rel_error": float(np.median(rel)),
              "p90_rel_error": float(np.percentile(rel, 90)),
              "steps_by_mode": {m: sum(1 for s, _ in samples if s.mode == m) for m in MODES},
              "modes_not_measured": missing}
    coefs = {"base_s": base, **{k: float(coef[3 + i]) for i, k in enumerate(FEATURES)}}
    return coefs, report


async def _stream(session, url: str, body: dict, on_chunk: Optional[Callable[[list[float]], object]] = None,
                  times: Optional[list] = None) -> list[float]:
    """perf_counter times of a completion stream's token chunks (into `times` where given; `on_chunk(times)` after
    each one)."""
    times = [] if times is None else times
    async with session.post(url + "/v1/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"the served calibration's server answered {r.status}: {(await r.text())[:200]}")
        async for line in r.content:
            if line.startswith(b"data: {") and json.loads(line[6:]).get("choices"):
                times.append(time.perf_counter())
                if on_chunk is not None:
                    on_chunk(times)
    return times


def _body(model_name: str, tr: TraceRequest, vocab: int, seed: int) -> dict:
    """A greedy streamed completion of `tr`'s prompt to its output length."""
    return {"model": model_name, "prompt": prompt_token_ids(tr, vocab, seed=seed), "max_tokens": tr.output_len,
            "ignore_eos": True, "temperature": 0, "stream": True}


async def _batches(url: str, model_name: str, grid: list[tuple[int, int]], decode_steps: int, vocab: int,
                   progress: Optional[Callable[[str], None]]) -> list[tuple[int, int, float, list[list[float]]]]:
    """(rows, context, send time, each stream's chunk times) of every batch of the grid, one batch at a time."""
    import aiohttp
    out, n = [], 0
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        for r, c in grid:
            bodies = [_body(model_name, TraceRequest(f"served-{n + i}", 0.0, c, decode_steps), vocab, seed=2)
                      for i in range(r)]
            n += r
            t0 = time.perf_counter()
            streams = await asyncio.gather(*(_stream(session, url, b) for b in bodies))
            out.append((r, c, t0, streams))
            if progress is not None and r:
                progress(f"served: {r} rows x {c} tokens")
    return out


Batches = list[tuple[int, int, float, list[list[float]]]]  # (rows, context, send time, each stream's chunk times)
Arrivals = list[tuple[int, list[float], float]]  # (the newcomer's context, the stream's chunk times, its first chunk)


async def _arrivals(url: str, model_name: str, contexts: list[int], decode_steps: int, vocab: int,
                    progress: Optional[Callable[[str], None]]) -> Arrivals:
    """ARRIVAL_PROBES lone streams per context (the shortest context's prompt, `decode_steps` tokens), each joined
    by a one-token request of that context once it has streamed half its chunks."""
    import aiohttp
    out, n = [], itertools.count()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        for c in [c for _ in range(ARRIVAL_PROBES) for c in contexts]:
            halfway = asyncio.Event()  # not a polling loop: the client's own CPU would be in what it measures
            times: list[float] = []
            body = _body(model_name, TraceRequest(f"arrival-stream-{next(n)}", 0.0, min(contexts), decode_steps),
                         vocab, seed=4)
            task = asyncio.ensure_future(_stream(session, url, body,
                                                 lambda t: len(t) >= decode_steps // 2 and halfway.set(), times))
            waiter = asyncio.ensure_future(halfway.wait())
            await asyncio.wait([task, waiter], return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
            first = (await _stream(session, url, _body(model_name, TraceRequest(f"arrival-{next(n)}", 0.0, c, 1),
                                                       vocab, seed=5)))[0]
            await task
            out.append((c, times, first))
        if progress is not None:
            progress(f"served: {len(out)} arrivals into a stream")
    return out


def arrival_delays(arrivals: Arrivals, prefill_s: Callable[[int], Optional[float]]) -> list[float]:
    """Per probe, the stream's gap that ends with its chunk nearest the newcomer's first chunk (the step that made
    both), less `prefill_s(context)`, the served step of that prefill (None: no shape known, probe left out)."""
    out = []
    for c, times, first in arrivals:
        k = min(range(len(times)), key=lambda i: abs(times[i] - first), default=0)
        step = prefill_s(c)
        if k >= 1 and step is not None:
            out.append(times[k] - times[k - 1] - step)
    return out


async def _beside(url: str, neighbours: list[str], model_name: str, grid: list[tuple[int, int]], decode_steps: int,
                  vocab: int, busy_rows: int, busy_context: int, progress: Optional[Callable[[str], None]]) -> Batches:
    """The grid's batches on `url` while every neighbour decodes batches of `busy_rows` back to back, busy from
    before the first batch to after the last: the slowdown read is a neighbour's that is busy throughout (the
    simulator applies it per neighbour mid-step). The neighbours running the grid too would overlap it only in
    part, and by chance: their ratios spread 0.9-1.5 where these hold."""
    import aiohttp
    stop = asyncio.Event()

    async def keep_busy(neighbour: str) -> None:
        busy = [_body(model_name, TraceRequest(f"busy-{i}", 0.0, busy_context, 4 * decode_steps), vocab, seed=3)
                for i in range(busy_rows)]
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
            while not stop.is_set():
                await asyncio.gather(*(_stream(session, neighbour, b) for b in busy))

    tasks = [asyncio.ensure_future(keep_busy(n)) for n in neighbours]
    try:
        await asyncio.sleep(0.5)  # the neighbours' first batches past their prefills
        return await _batches(url, model_name, grid, decode_steps, vocab, progress)
    finally:
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)


def measure_served(model: str, rows: list[int], contexts: list[int], decode_steps: int, vocab: int,
                   progress: Optional[Callable[[str], None]] = None, neighbours: int = 0,
                   repeats: int = 1) -> tuple[Batches, Batches, Arrivals]:
    """The grid's batches through a real `pdserve serve` of `model` (started here, stopped at the end) with the
    engine settings `measure` used; OMP_NUM_THREADS as this process has it. With `neighbours`, that many more such
    servers start, and the grid runs again while they decode back to back (`_beside`): (the lone server's batches,
    its batches beside the neighbours ([] without), its arrival probes (`_arrivals`))."""
    from pdserve.bench.launcher import Deployment, free_port
    args = ["serve", model, "--log-level", "warning", "--max-model-len", str(max(contexts) + decode_steps + 1),
            "--max-num-seqs", str(max(rows)), "--max-num-batched-tokens", str(max(8, max(rows) * max(contexts))),
            "--max-cudagraph-capture-size", str(min(512, max(rows) * max(contexts)))]
    env = {k: os.environ[k] for k in ("OMP_NUM_THREADS",) if k in os.environ}
    log_dir = Path(tempfile.mkdtemp(prefix="pdserve-calibrate-"))
    dep = Deployment("calibrate", log_dir)
    measured = False
    try:
        urls = [dep.spawn(f"server{i}", args, free_port(), env) for i in range(1 + neighbours)]
        dep.wait_healthy(300)
        # the first: a warm-up, not kept; then the grid `repeats` times (each batch's runs and each lone request's
        # first chunk are medians over them: one run of a batch moves by 20% and more on busy cores)
        grid = [(1, min(contexts))] + [(r, c) for _ in range(repeats) for r in rows for c in contexts]
        # and LONE_PROBES more lone requests per context: a lone request's first chunk moves by 2-3x from one to the
        # next at 2 threads here, and the request latency is their median
        grid += [(1, c) for _ in range(LONE_PROBES) for c in contexts]
        name = Path(model).name
        lone = asyncio.run(_batches(urls[0], name, grid, decode_steps, vocab, progress))[1:]
        arrivals = asyncio.run(_arrivals(urls[0], name, contexts, decode_steps, vocab, progress))
        beside = []
        if neighbours:
            busy_rows = sorted(rows)[len(rows) // 2]
            beside = asyncio.run(_beside(urls[0], urls[1:], name, grid, decode_steps, vocab, busy_rows,
                                         min(contexts), progress))[1:]
        measured = True
        return lone, beside, arrivals
    finally:
        dep.stop()
        if measured:  # the servers' logs are kept only where a failure's message names them
            shutil.rmtree(log_dir, ignore_errors=True)


def fit_served(batches: Batches, bare: list[tuple[StepShape, float]], predict: Callable[[StepShape], float],
               beside: Optional[Batches] = None, neighbours: int = 1, idle: Idle = Idle(),
               arrivals: Optional[Arrivals] = None) -> tuple[dict, dict]:
    """(the profile's `served` section, its fit report) from the served batches; `bare`: the bare steps measured
    with the same engine settings (a batch's decode and prefill step shapes are read from them), `predict`: the
    bare profile; `beside`: the same batches run beside `neighbours` other servers decoding back to back, which fits
    `neighbour_scale`; `idle`: the profile's idle section, whose extra a lone request's prefill paid after the
    server idled (the simulator adds it apart, so it is taken out of the request latency); `arrivals`: the arrival
    probes, which fit `arrival_delay_s`."""
    gaps, firsts, delays = _decode_runs(batches, bare)
    if len(gaps) < 2:
        raise ValueError("the served batches gave too few decode runs to fit: widen the grid (--rows, "
                         "--context-lens, --decode-steps)")
    X = np.array([[predict(s), 1.0] for s, _ in gaps.values()])
    y = np.array([t for _, t in gaps.values()])
    scale, overhead = _nonneg_lstsq(X / y[:, None], np.ones_like(y))
    if scale == 0:  # the served steps do not grow with the bare ones at all: keep the bare model's shape
        scale, overhead = 1.0, max(0.0, float(np.median(y - X[:, 0])))
    served = {"step_scale": float(scale), "step_overhead_s": float(overhead)}
    rel = np.abs(X @ np.array([served["step_scale"], served["step_overhead_s"]]) - y) / y

    def served_step(s: StepShape) -> float:
        return scale * predict(s) + overhead
    lat = [t - served_step(s) for s, t, _ in firsts]
    whole = max(0.0, float(statistics.median(lat))) if lat else 0.0
    est = whole
    if lat and idle.gaps_s:  # the server idled from the last chunk through the request's own way in (the latency
        for _ in range(3):  # being fitted: a few rounds settle it, the extra growing slowly with the pause)
            est = max(0.0, float(statistics.median(x - idle.extra(g + est) for x, (_, _, g) in zip(lat, firsts))))
    served["request_latency_s"] = est
    # how late chunks reach the client past the pace of their run (_lateness): the host's stalls, p99 ITL's tail.
    # DELAY_QUANTILES quantiles, 0 to 100%: at 21 (5% apart) the top 5% was drawn evenly from p95 to the largest
    # delay seen, and the small model's simulated p99 ITL read that line (+81% at 1 req/s with an 84 ms maximum)
    # and per streams in flight, where enough chunks were read: a client reading 16 streams lags more than one
    # reading 1 or 4 (the small model at 1 thread: p99 29 ms against 17 and 11), and the simulator draws by the rows
    # of the chunk's step
    served.update(_delay_fields(delays, ""))
    prefill_shape = _prefill_shapes(bare)
    extra = arrival_delays(arrivals or [], lambda c: served_step(prefill_shape[c]) if c in prefill_shape else None)
    if extra:
        served["arrival_delay_s"] = max(0.0, float(statistics.median(extra)))
    report = {"decode_runs": len(gaps), "median_rel_error": float(np.median(rel)),
              "p90_rel_error": float(np.percentile(rel, 90)), "first_chunks": len(firsts),
              "request_latency_s_with_idle_extra": whole,  # the request latency with the idle extra left in
              "chunks": sum(len(d) for d in delays.values()), "arrival_probes": len(extra)}
    if beside:
        # the same batches' decode runs with `neighbours` other servers busy throughout: how much longer a step
        # takes per busy neighbour
        paired, _, near = _decode_runs(beside, bare)
        # how late chunks come while a neighbour is busy: the tiny model at 1 thread, p99 3.6 ms for one stream
        # beside one against 1.2 alone (the simulator draws these where nodes share a host, --shared-host)
        served.update(_delay_fields(near, "neighbour_"))
        ratios = [paired[k][1] / gaps[k][1] for k in paired if k in gaps]
        if not ratios:
            raise ValueError("the batches beside a neighbour gave no decode run to compare: widen the grid")
        served["neighbour_scale"] = max(0.0, (float(statistics.median(ratios)) - 1.0) / neighbours)
        report.update(neighbour_runs=len(ratios), neighbours=neighbours,
                      neighbour_ratio_min=float(min(ratios)), neighbour_ratio_max=float(max(ratios)))
    return served, report


def _delay_fields(delays: dict[int, list[float]], prefix: str) -> dict:
    """The served section's `{prefix}chunk_delay_quantiles_s` (every chunk) and `{prefix}chunk_delay_by_rows` (each
    batch size with at least DELAY_MIN_CHUNKS chunks) from {rows: lateness}."""
    def quantiles(d: list[float]) -> list[float]:
        return [float(x) for x in np.quantile(d, np.linspace(0, 1, DELAY_QUANTILES))] if d else []
    return {f"{prefix}chunk_delay_quantiles_s": quantiles([x for d in delays.values() for x in d]),
            f"{prefix}chunk_delay_by_rows": {str(r): quantiles(d) for r, d in sorted(delays.items())
                                             if len(d) >= DELAY_MIN_CHUNKS}}


def _lateness(times: list[float]) -> list[float]:
    """Each chunk's lateness (seconds, >= 0) against its run's pace, past the run's typical (median) chunk: the
    steps already hold the typical gap, so only what comes later than that is a stall. The pace is a least-squares
    quadratic in the chunk's index, not the run's mean gap: steps grow with the context they read, and against a
    straight line a run whose gaps only grow reads late at both ends (the small model's 16-row runs gave 30 ms at
    p95 that way, against a ~35 ms step)."""
    k = np.arange(len(times), dtype=np.float64)
    x = np.asarray(times, dtype=np.float64) - times[0]
    deg = 2 if len(times) >= 5 else 1
    late = x - np.polyval(np.polyfit(k, x, deg), k)
    # stalls are late only and would pull the trend after them: fitted again without the chunks that stand out
    # (later than the typical one by over 3 median deviations)
    mid = np.median(late)
    keep = late <= mid + 3 * np.median(np.abs(late - mid))
    if keep.sum() > deg + 1:
        late = x - np.polyval(np.polyfit(k[keep], x[keep], deg), k)
    return [float(v) for v in np.maximum(0.0, late - np.median(late))]


def _prefill_shapes(bare: list[tuple[StepShape, float]]) -> dict[int, StepShape]:
    """{prompt tokens: the shape of a lone request's prefill step} from the bare steps."""
    return {s.num_tokens: s for s, _ in bare if s.num_reqs == 1 and s.num_tokens > 1}


def _decode_runs(batches: Batches, bare: list[tuple[StepShape, float]]
                 ) -> tuple[dict[tuple[int, int], tuple[StepShape, float]], list[tuple[StepShape, float, float]],
                            dict[int, list[float]]]:
    """({(rows, context): (the decode run's step shape, its mean gap)}, [(a lone request's prefill shape, its time to
    the first chunk, the client's idle time before it was sent)], {rows: every decode-run chunk's lateness in
    seconds in batches of that many streams}) of the served batches (fit_served's docstring)."""
    decode_shape = {s.num_reqs: s for s, _ in bare if s.num_tokens == s.num_reqs}  # r rows, one token each
    prefill_shape = _prefill_shapes(bare)
    runs: dict[tuple[int, int], list[tuple[StepShape, float]]] = {}
    firsts, delays = [], {}
    last_end = None  # the previous batch's last chunk: the server idles from there to the next send
    for r, c, t0, streams in batches:
        # the first batch follows the warm-up batch (not kept) as closely as any follows the one before it
        idle_before = t0 - last_end if last_end is not None else 0.0
        last_end = max((t[-1] for t in streams if t), default=last_end)
        if r not in decode_shape or any(len(t) < 2 for t in streams):
            continue
        # From the first chunk at or after the batch's last first token, every step is r rows decoding. A stream's
        # chunks can reach the client in bursts (its process waits for a core), so each stream's mean gap over
        # that run is the sample, not each gap: the run's length is what a burst cannot change.
        all_in = max(t[0] for t in streams)
        spans = []
        for t in streams:
            k0 = next((k for k, x in enumerate(t) if x >= all_in), len(t))
            if len(t) - 1 - k0 >= 2:
                g = (t[-1] - t[k0]) / (len(t) - 1 - k0)
                spans.append((k0, len(t) - 1, g))
                delays.setdefault(r, []).extend(_lateness(t[k0:]))
        if len(spans) == r:
            k0 = statistics.median(a for a, _, _ in spans)
            k1 = statistics.median(b for _, b, _ in spans)
            ctx = round(r * (c + (k0 + 1 + k1) / 2))  # the run's steps made tokens k0 + 1 .. k1: their mean context
            s = decode_shape[r]
            runs.setdefault((r, c), []).append((StepShape(s.mode, r, s.padded_tokens, r, ctx, ctx),
                                                statistics.median(g for _, _, g in spans)))
        if r == 1 and c in prefill_shape:
            firsts.append((prefill_shape[c], streams[0][0] - t0, idle_before))
    # a batch run more than once: its median run (an odd count's middle one, an even count's upper middle)
    gaps = {k: sorted(v, key=lambda x: x[1])[len(v) // 2] for k, v in runs.items()}
    return gaps, firsts, delays


def calibrate(model: str, rows: list[int], contexts: list[int], decode_steps: int, name: Optional[str] = None,
              engine_kwargs: Optional[dict] = None, progress: Optional[Callable[[str], None]] = None,
              served: bool = False, neighbours: int = 0, served_repeats: int = 3) -> dict:
    """The linear profile of `model` on this machine, as a JSON-ready dict (checked by profile_from_dict); with
    `served`, its `served` section from a real server too (the module's docstring), and with `neighbours` its
    neighbour_scale from that many more servers decoding beside it."""
    if not rows or min(rows) < 1 or not contexts or min(contexts) < 1 or decode_steps < 2:
        raise ValueError("--rows and --context-lens need positive integers, --decode-steps >= 2")
    if neighbours and not served:
        raise ValueError("--served-neighbours needs --served")
    if not 1 <= served_repeats <= 20:
        raise ValueError(f"--served-repeats must be in [1, 20], got {served_repeats}")
    if not 0 <= neighbours <= 8:
        raise ValueError(f"--served-neighbours must be in [0, 8], got {neighbours}")
    if served and 1 not in rows:
        raise ValueError("--served needs 1 in --rows: a lone request's first chunk gives the request latency")
    samples, facts = [], {}
    graphs: list = []
    idle = None
    for eager in (False, True):
        got, facts = measure(model, rows, contexts, decode_steps, eager, engine_kwargs, progress, idle=not eager)
        samples += got
        graphs = graphs or got  # the served engine's settings: graphs on, as `pdserve serve`'s default
        idle = idle or facts.get("idle")
    coefs, report = fit(samples)
    report.update(rows=rows, context_lens=contexts, decode_steps=decode_steps,
                  date=time.strftime("%Y-%m-%d %H:%M:%S"))
    d = {"type": "linear", "name": name or Path(model).name, "device": facts["device"],
         "model": {"name": Path(model).name, "kv_bytes_per_token": facts["kv_bytes_per_token"],
                   "max_model_len": facts["max_model_len"]},
         "coefficients": coefs, "fit": report}
    if idle is not None:
        d["idle"] = idle
    bare = profile_from_dict(d)  # what we write must load
    if served:
        batches, beside, arrivals = measure_served(model, rows, contexts, decode_steps, facts["vocab_size"],
                                                   progress, neighbours, served_repeats)
        d["served"], report["served"] = fit_served(batches, graphs, bare.bare_step_time, beside, neighbours,
                                                   bare.idle, arrivals)
        profile_from_dict(d)
    return d
