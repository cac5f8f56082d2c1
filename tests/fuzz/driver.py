"""Runs one Case on an LLMEngine and checks it: after every step the pool's invariants and progress; at the end
every request finished once with a reason, its output equal to the oracle (greedy and seeded requests), its streamed
deltas equal to its final output, and every block free on both sides of the fake connector.

Progress, in steps (every generated request fits an empty pool, so each must finish):
- a step may schedule nothing while requests wait only while a transfer is in flight (its end can free or fill
  blocks); otherwise within STALL_STEPS something runs. A fake load ends within its timeout, so this cannot hide
  a stall for longer than `FuzzConnector.max_wait_steps`;
- some request gets a token (or finishes, or a load fails it) at least every (cdiv(max_model_len, token budget) + 2)
  x (unfinished requests + 1) steps plus that wait: the oldest running request is never the preemption victim of a
  newer one, so it completes its prefill in cdiv(max_model_len, budget) steps unless the pool cannot hold it.
  A request short of blocks while P's lease lasts waits for running requests, which produce tokens meanwhile.
"""
from __future__ import annotations

import functools
import json
import time as _time
from dataclasses import dataclass, field

from pdserve.config import EngineConfig
from pdserve.sched_output import cdiv
from pdserve.request import RequestStatus
from tests.fuzz.expect import explain, expect
from tests.fuzz.fake_model import VOCAB
from tests.fuzz.workload import engine_kwargs, make_params

STALL_STEPS = 3


@dataclass
class Failure:
    kind: str  # livelock | invariant | exception | oracle | error | unfinished | leak | lease | stream | gave_up
    label: str  # the known defect it most likely is, or NEW
    detail: str

    @property
    def signature(self) -> str:
        return f"{self.kind}: {self.label}"

    def __str__(self) -> str:
        return f"[{self.kind}] {self.label}: {self.detail}"


@dataclass
class Result:
    steps: int = 0
    failures: list[Failure] = field(default_factory=list)


class _NoSleep:
    """The engine step's `time` (core/step_pipeline.py) with a no-op sleep: it sleeps 1 ms whenever only transfers
    are in flight, and the fake connector's transfers advance by steps, not time."""

    def __getattr__(self, name):
        return getattr(_time, name)

    @staticmethod
    def sleep(seconds: float) -> None:
        pass


def patched_engine_time():
    return _NoSleep()


@functools.lru_cache(maxsize=None)
def char_table(model_dir: str) -> tuple[str, ...]:
    from pdserve.core.engine import load_tokenizer
    tok = load_tokenizer(model_dir)
    return tuple(tok.decode([i], skip_special_tokens=True) for i in range(VOCAB))


@functools.lru_cache(maxsize=4096)
def _alone(model_dir: str, prompt: tuple, sp_json: str, mml: int) -> tuple:
    from pdserve.core.engine import LLMEngine
    e = LLMEngine(EngineConfig.from_kwargs(model_dir, max_model_len=mml, block_size=16, enforce_eager=True,
                                           enable_prefix_caching=False, num_gpu_blocks_override=cdiv(mml, 16) + 1,
                                           max_num_seqs=1, device="cpu", async_scheduling=False))
    e.add_request(list(prompt), make_params(json.loads(sp_json)), "alone")
    out = None
    while e.has_unfinished_requests():
        out = next((o for o in e.step() if o.finished), out)
    c = out.outputs[0]
    return c.token_ids, c.finish_reason, c.stop_reason, c.text


def alone(model_dir: str, prompt: list[int], sp: dict, mml: int) -> tuple:
    """(tokens, finish_reason, stop_reason, text) of the request run by itself on an eager engine."""
    return _alone(model_dir, tuple(prompt), json.dumps(sp, sort_keys=True), mml)


def _label_error(msg: str) -> str:
    if "boolean index did not match" in msg or "IndexError" in msg:
        return "defect 1 (CPU FULL step IndexError)"
    return "NEW"


def run_case(case: dict, model_dir: str, tolerate: frozenset = frozenset()) -> Result:
    """`tolerate`: failure labels (e.g. 'defect 5') not to report, while a known defect is being fixed."""
    res = Result()
    try:
        _run(case, model_dir, res)
    except Exception as e:  # the engine raised out of step() or add_request: the test's own bugs land here too
        import traceback
        res.failures.append(Failure("exception", "NEW", f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=-4)}"))
    res.failures = [f for f in res.failures if not any(f.label.startswith(t) for t in tolerate)]
    return res


def _run(case: dict, model_dir: str, res: Result) -> None:
    from pdserve.core.engine import LLMEngine
    cfg = case["cfg"]
    engine = LLMEngine(EngineConfig.from_kwargs(model_dir, **engine_kwargs(cfg)))
    conn = engine.connector
    chars = char_table(model_dir)
    rows_scheduled = [0]
    schedule = engine.scheduler.schedule

    def counting_schedule():
        out = schedule()
        rows_scheduled[0] = len(out.rows)
        return out

    engine.scheduler.schedule = counting_schedule
    fail = res.failures.append
    reqs = {f"r{i}": q for i, q in enumerate(case["reqs"])}
    outs: dict[str, list] = {rid: [] for rid in reqs}
    finished: dict[str, object] = {}
    submitted, rejected, aborted = set(), set(), set()
    bound = STALL_STEPS + (conn.max_wait_steps() if hasattr(conn, "max_wait_steps") else 0)
    total = sum(len(q["prompt"]) + (q["sp"]["max_tokens"] or cfg["max_model_len"]) for q in reqs.values())
    cap = 20 * total + 50 * bound + 200
    last_arrival = max([q["at"] for q in reqs.values()] + [q["abort"] or 0 for q in reqs.values()])

    def record(o):
        if o.request_id in finished:
            fail(Failure("stream", "NEW", f"{o.request_id}: output after it finished"))
        outs[o.request_id].append(o)
        if o.finished:
            finished[o.request_id] = o

    stall, idle, step = 0, 0, 0
    per_req = cdiv(cfg["max_model_len"], min(cfg["max_num_batched_tokens"], cfg.get("long_prefill") or 1 << 30)) + 2
    while True:
        for rid, q in reqs.items():
            if q["at"] == step:
                sp = make_params(q["sp"])
                if q["kind"] == "remote":
                    lz = q["lease"]
                    params = conn.p.offer(f"t-{rid}", q["prompt"], lz["steps"], lz["outcome"], lz["latency"])
                    engine.add_request(q["prompt"], sp, rid, kv_transfer_params=params)
                elif q["kind"] == "prefilled":
                    try:
                        engine.add_prefilled_request(q["prompt"], sp, rid)
                    except RuntimeError:  # its documented answer to a pool with no room for the import
                        rejected.add(rid)
                        continue
                else:
                    engine.add_request(q["prompt"], sp, rid)
                submitted.add(rid)
            if q["abort"] == step and rid in submitted and rid not in finished:
                aborted.add(rid)
                o = engine.abort_request(rid)
                if o is not None:
                    record(o)
        step_outs = engine.step()
        for o in step_outs:
            record(o)
        step += 1
        idle = 0 if step_outs or not engine.scheduler.has_unfinished() else idle + 1
        try:
            engine.check_invariants()
        except AssertionError as e:
            fail(Failure("invariant", "NEW", f"step {step}: {e}"))
            break
        s = engine.scheduler
        in_flight = conn is not None and conn.has_pending()
        stall = stall + 1 if rows_scheduled[0] == 0 and s.has_unfinished() and not in_flight else 0
        unfinished = len(s.requests)
        if stall > STALL_STEPS or idle > per_req * (unfinished + 1) + bound:
            held = [r for r in s.waiting
                    if r.num_computed_tokens > 0 or r.status == RequestStatus.WAITING_FOR_REMOTE_KV]
            what = f"nothing scheduled for {stall} steps" if stall > STALL_STEPS else f"no token for {idle} steps"
            label = ("defect 2 (decode-node livelock: imports hold the pool)" if stall > STALL_STEPS else
                     "defect 2 family (imports hold the pool; the FIFO head recomputes forever)") if held else "NEW"
            fail(Failure("livelock", label, f"step {step}: {what}; waiting {list(s.waiting)}, running {s.running}, "
                         f"free blocks {engine.kv.num_free_blocks()}/{engine.num_blocks - 1}, "
                         f"preemptions {s.num_preemptions}"))
            break
        if step > last_arrival and not engine.has_unfinished_requests():
            break
        if step > cap:
            fail(Failure("livelock", "NEW", f"not done after {step} steps (work bound {cap})"))
            break
    res.steps = step
    if not res.failures:
        _check_end(engine, case, reqs, outs, finished, submitted, aborted, chars, fail)
        for rid in rejected:
            if outs[rid]:
                fail(Failure("stream", "NEW", f"{rid}: outputs for a request add_prefilled_request refused"))
    engine.shutdown()


def _check_end(engine, case, reqs, outs, finished, submitted, aborted, chars, fail) -> None:
    cfg, conn = case["cfg"], engine.connector
    policy = (cfg.get("kv") or {}).get("policy", "recompute")
    mml = cfg["max_model_len"]
    for rid in sorted(submitted, key=lambda x: int(x[1:])):
        q, o = reqs[rid], finished.get(rid)
        events = conn.events.get(rid, []) if hasattr(conn, "events") else []
        if o is None:
            lost = any(e.startswith("failed:") for e in events)
            fail(Failure("unfinished", "NEW (a load's failure output lost: dropped by a failed model step?)" if lost
                         else "NEW", f"{rid} never finished"))
            continue
        c = o.outputs[0]
        stream_ids = [t for x in outs[rid] for t in x.outputs[0].delta_token_ids]
        stream_text = "".join(x.outputs[0].delta_text for x in outs[rid])
        if stream_ids != c.token_ids or stream_text != c.text:
            fail(Failure("stream", "NEW", f"{rid}: streamed {stream_ids!r}/{stream_text!r} != final "
                         f"{c.token_ids!r}/{c.text!r}"))
        sp = make_params(q["sp"])
        reason = c.finish_reason
        if reason == "error":
            provoked = policy == "fail" and any(e.startswith("failed:") for e in events)
            if not provoked or c.token_ids:
                fail(Failure("error", _label_error(o.error or ""), f"{rid}: finish_reason error: {o.error}"))
            continue
        if reason == "abort":
            if rid not in aborted:
                fail(Failure("oracle", "NEW", f"{rid}: aborted but the test never aborted it"))
        elif reason not in ("stop", "length"):
            fail(Failure("oracle", "NEW", f"{rid}: finish_reason {reason!r}"))
        if any(not 0 <= t < VOCAB for t in c.token_ids) or len(c.token_ids) > (sp.max_tokens or mml):
            fail(Failure("oracle", "NEW", f"{rid}: tokens {c.token_ids} out of range or too many"))
        if sp.temperature >= 1e-5 and sp.seed is None:
            continue  # sampled from the engine's shared generator: nothing more to predict
        got = (c.token_ids, reason, c.stop_reason, c.text)
        if sp.temperature >= 1e-5:  # seeded: its tokens must not depend on the batch, so equal its run alone
            want = alone(engine.config.model.model, q["prompt"], q["sp"], mml)
            if got[:1 if reason == "abort" else 4] != (want[0][:len(c.token_ids)],) + want[1:] * (reason != "abort"):
                fail(Failure("oracle", "NEW (seeded output depends on the batch, or wrong KV)",
                             f"{rid} ({q['kind']}, prompt {len(q['prompt'])}): got {got}, alone {want}"))
            continue
        e = expect(q["prompt"], sp, mml, chars)
        if reason == "abort":
            if c.token_ids != e.tokens[:len(c.token_ids)]:
                fail(Failure("oracle", "NEW", f"{rid}: aborted output {c.token_ids} is no prefix of {e.tokens}"))
            continue
        want = (e.tokens, e.finish_reason, e.stop_reason, e.text)
        if got != want:
            differ = ", ".join(n for n, a, b in zip(("tokens", "finish_reason", "stop_reason", "text"), got, want)
                               if a != b)
            label = explain(q["prompt"], sp, mml, chars, got) or (
                "NEW (wrong tokens: KV read back wrong?)" if c.token_ids != e.tokens[:len(c.token_ids)]
                else f"NEW (differs in {differ})")
            fail(Failure("oracle", label, f"{rid} ({q['kind']}, prompt {len(q['prompt'])}): got {got}, "
                         f"expected {want}"))
        for ev in events:
            if ev.startswith("gave_up"):
                fail(Failure("gave_up", "defect 3 (a momentary shortage gives up remote KV)",
                             f"{rid}: D prefilled locally ({ev}) while P's lease still held its KV"))
    _check_whole(engine, conn, set(reqs), fail)


def _check_whole(engine, conn, rids, fail) -> None:
    s, kv = engine.scheduler, engine.kv
    if (kv.num_free_blocks() != engine.num_blocks - 1 or kv.req_blocks or s.transfers.leased
            or s.transfers.deferred_free or s.requests):
        fail(Failure("leak", "NEW (D's blocks)", f"D: free {kv.num_free_blocks()}/{engine.num_blocks - 1}, holders "
                     f"{list(kv.req_blocks)}, leased {list(s.transfers.leased)}, "
                     f"deferred {list(s.transfers.deferred_free)}, requests {list(s.requests)}"))
    # Any dict of the engine's layers still keyed by a request id is state that outlived its request.
    left = {f"{type(o).__name__}.{n}": sorted(k for k in v if k in rids) for o in (engine, s, kv, engine.runner)
            for n, v in vars(o).items() if isinstance(v, dict) and any(k in rids for k in v)}
    if left:
        fail(Failure("leak", "NEW (engine per-request state)", f"left behind: {left}"))
    if conn is None or not hasattr(conn, "p"):
        return
    for tid, lease in conn.p.leases.items():
        if lease.pins:
            fail(Failure("lease", "NEW", f"P's lease {tid} still pinned by a read"))
        elif lease.alive and not lease.load_failed:  # D is done with the request but never told P
            fail(Failure("lease", "defect 4 (P's blocks pinned by requests D is done with)",
                         f"P's lease {tid} still held ({lease.state}) after D finished the request"))
