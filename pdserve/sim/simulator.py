"""The discrete-event loop: arrivals, node steps and KV transfers on one clock, the router's pick in front.

Deployments:
- collocated (N nodes): each request goes to a node the router's pool picks (`Pool.pick`, round-robin or
  least-loaded on in-flight counts, router/nodes.py) and runs there whole;
- xPyD: as pdserve's router (router/app.py): a P picked the same way prefills the request with `max_tokens=1` and
  `kv_transfer_params={"do_remote_decode": true}`; when P's step that finishes it ends, a D picked for it gets the
  original request with P's params, loads the KV through the scheduler's P/D half (core/kv_transfers.py) over the
  transfer-time model, and replays the last prompt token. A one-token prompt skips P, as the router's token-id
  prompts do. With the router's `--pd-first-token prefill` P gets the client's own params with the first token
  asked (`first_token`), samples it and stops; the token reaches the client at P's step end, and D, given P's
  params with the token, imports all n prompt tokens and decodes it as a plain row (no replay); a token that ends
  the request (output length 1) is P's whole answer and D is not asked. With the router's early decode (its default
  there, `early_decode`) D is asked when P is: it takes the request with `await_kv` params (blocks for all n prompt
  tokens allocated as its scheduler admits it), and the KV comes over the fabric from P's step end
  (`Fabric.post`, the direct hand-off of channel/handoffs.py); when P's token ends the request the router drops D's
  request (aborted there, its await cancelled).

A request reaches the node it is sent to the profile's `served.request_latency_s` later (its time outside the node's
steps: HTTP in and out, translation, the engine's wire; 0 for a bare profile), and in xPyD each send passes the
router, which adds `TransferModel.router_latency_s` (--router-latency-ms), as a collocated pool of several nodes
does (a lone collocated node is served directly). A node steps whenever it has work and is
not busy: a step scheduled at t runs the scheduler at t and ends at
t + the profile's step time; its tokens reach the client at the step's end, and
requests that arrive meanwhile are added before its next schedule, as the engine loop's inbox is read between
steps. A node with nothing to run but loads in flight sleeps until the first load ends.

Event-leaping (`leap=True`, the default): a node whose batch is a steady decode run plans its next steps at once
(`SimNode.plan_leap`) and is woken only at the planned run's end; what could change its batch before then either
bounds the plan (a row's last token, blocks running short, its connector's next event) or touches the node from
outside: a request routed to it (`_submit`) or a lease D released on it. A touch first applies the planned steps
that started before it (`SimNode.catch_up`), so the node takes the request exactly where step by step would have,
and an arrival routed to another node costs this one nothing. Step times, token times, counts, block tables and
graph labels are those of step by step (tests/sim/test_leap.py); two things at the very same float time as a
leaping node's step boundary may be taken in another order than step by step takes them (it orders such ties by
when each was queued).
"""
from __future__ import annotations

import heapq
import itertools
import random
from dataclasses import dataclass, field
from typing import Callable, Optional, Union

from pdserve.bench.metrics import RequestResult
from pdserve.request import RequestStatus
from pdserve.router.nodes import Node as RouterNode
from pdserve.router.nodes import Pool
from pdserve.sim.connector import Fabric
from pdserve.sim.node import Leap, SimNode, StepRecord
from pdserve.sim.trace import TraceRequest
from pdserve.transfer.channel.handoffs import AWAIT_KV


@dataclass
class ClientView:
    """One trace request as the benchmark client sees it."""
    trace: TraceRequest
    prompt: Optional[list[int]]  # made at arrival, dropped at the end: 100k prompts at once would take GBs
    # (time, tokens, rows of the step that made it) of each streamed chunk
    chunks: list[tuple[float, int, int]] = field(default_factory=list)
    finished: Optional[float] = None
    error: str = ""
    # the router's TTFT stages (router/app.py): P's first scheduled step and its answer, D's arrival and first
    # scheduled step, the load's start and end (from D's connector)
    p_scheduled: Optional[float] = None
    p_done: Optional[float] = None
    d_arrival: Optional[float] = None
    d_scheduled: Optional[float] = None
    # early decode: the D node holding the request while P prefills (it reaches D no later than P: the same request
    # latency, and P's prefill after it)
    d_node: Optional[str] = None

    def ttft_stages(self, load: Optional[list[float]], first_from_p: bool = False) -> dict[str, float]:
        """Seconds per stage, for the stages this request passed, as the router splits TTFT (router/timing.py);
        with the first token from P, TTFT ends at P's answer: no transfer, no D in it."""
        if not self.chunks:
            return {}
        first = self.chunks[0][0]
        out = {"total": first - self.trace.arrival_time}
        if first_from_p and self.p_done is not None:
            return {**out, "router_to_prefill": self.p_scheduled - self.trace.arrival_time,
                    "prefill": self.p_done - self.p_scheduled, "first_token_from_prefill": first - self.p_done}
        if self.d_scheduled is None:
            return {}
        if self.p_done is not None:
            out.update(router_to_prefill=self.p_scheduled - self.trace.arrival_time,
                       prefill=self.p_done - self.p_scheduled)
        kv = load[1] - load[0] if load is not None else 0.0
        if load is not None:
            out["kv_transfer"] = kv
        out["decode_queue"] = self.d_scheduled - self.d_arrival - kv
        out["first_token"] = first - self.d_scheduled
        return out

    def result(self, delay: Optional[Callable[[int], float]] = None) -> RequestResult:
        """As the client reads it: each chunk `delay(rows of its step)` late past its step's end (the host's
        stalls), never before the chunk ahead of it (one stream: a late chunk holds back those behind it, which then
        arrive together)."""
        t0 = self.trace.arrival_time
        if self.error or self.finished is None or not self.chunks:
            return RequestResult(False, self.trace.prompt_len, 0, error=self.error or "not finished", start=t0)
        times = [t for t, _, _ in self.chunks]
        if delay is not None:
            for k, (_, _, rows) in enumerate(self.chunks):
                times[k] = max(times[k - 1] if k else t0, times[k] + delay(rows))
        return RequestResult(True, self.trace.prompt_len, sum(n for _, n, _ in self.chunks), times[0] - t0,
                             [b - a for a, b in zip(times, times[1:])], times[-1] - t0, start=t0)


class Simulator:
    def __init__(self, prefill: list[SimNode], decode: list[SimNode], policy: str = "round-robin",
                 fabric: Optional[Fabric] = None, on_step: Optional[Callable[[SimNode, StepRecord], None]] = None,
                 pd_first_token: str = "replay", leap: bool = True, router_latency_s: float = 0.0,
                 delay_seed: int = 0, early_decode: bool = True):
        """`prefill` empty: a collocated deployment of the `decode` nodes. `router_latency_s`: what the router adds to
        each send through it (0 where no router stands in front: a lone collocated node). `pd_first_token`: the router's
        --pd-first-token (replay: vLLM's, D replays the last prompt token; prefill: P's token is the first).
        `early_decode`: with prefill, the router's --pd-early-decode (D asked when P is; False: after P answered).
        `leap`: advance steady decode runs in leaps (False: every step through the scheduler, --step-by-step)."""
        if pd_first_token not in ("replay", "prefill"):
            raise ValueError(f"--pd-first-token must be 'replay' or 'prefill', got {pd_first_token!r}")
        self.prefill_nodes, self.decode_nodes, self.fabric, self.on_step = prefill, decode, fabric, on_step
        self.first_from_p = pd_first_token == "prefill" and bool(prefill)
        self.early = self.first_from_p and early_decode
        self.pd = bool(prefill)
        self.p_pool = Pool([RouterNode(n.name) for n in prefill], policy)
        self.d_pool = Pool([RouterNode(n.name) for n in decode], policy)
        self.by_name = {n.name: n for n in prefill + decode}
        self.router_node = {rn.url: rn for rn in self.p_pool.nodes + self.d_pool.nodes}
        self.events: list = []
        self._seq = itertools.count()
        self.wake_at: dict[str, float] = {}
        self.views: list[ClientView] = []
        self.owner: dict[tuple[str, str], ClientView] = {}  # (node, request id) -> the client waiting on it
        self.p_names = {n.name for n in prefill}
        self.leap = leap
        self.delay_seed = delay_seed  # the client's chunk delays (the profile's served.chunk_delay_*)
        # what a send to a node of each pool takes before the node has the request: its profile's
        # served.request_latency_s (HTTP in and out, the request's translation, the wire to the engine) and the
        # router's own hop, where one stands in front
        self.p_latency, self.d_latency = ((nodes[0].profile.served.request_latency_s if nodes else 0.0) +
                                          router_latency_s
                                          for nodes in (prefill, decode))

    def _push(self, t: float, kind: str, payload) -> None:
        heapq.heappush(self.events, (t, next(self._seq), kind, payload))

    def _wake(self, node: SimNode, t: float) -> None:
        pending = self.wake_at.get(node.name)
        if pending is not None and pending <= t:
            return
        self.wake_at[node.name] = t
        self._push(t, "wake", node.name)

    def run(self, trace: list[TraceRequest], prompts: Union[list[list[int]], Callable[[TraceRequest], list[int]]]
            ) -> tuple[list[RequestResult], float]:
        """(per-request results in trace order, duration: from 0 to the last request's end). `prompts`: the token
        ids of each request, or a function making them (called at its arrival, so only requests in flight hold
        theirs)."""
        if callable(prompts):
            self.prompt_for, views = prompts, [ClientView(r, None) for r in trace]
        else:
            views = [ClientView(r, p) for r, p in zip(trace, prompts)]
        self.views = views
        for v in views:
            self._push(v.trace.arrival_time, "arrive", v)
        while self.events:
            t, _, kind, payload = heapq.heappop(self.events)
            if kind == "arrive":
                self._arrive(payload, t)
            elif kind == "wake":
                if self.wake_at.get(payload) != t:
                    continue  # superseded by an earlier wake
                del self.wake_at[payload]
                self._run_node(self.by_name[payload], t)
            elif kind == "prefilled":
                self._to_decode(*payload, t)
            elif kind == "drop":
                self._drop_decode(payload, t)
            elif kind == "reach":
                pool, view, output_len, params = payload
                self._submit(pool, view, t, output_len, params)
        assert all(n.leap is None for n in self.by_name.values()), "a leap's end is always woken"
        end = max((v.finished or v.trace.arrival_time for v in views), default=0.0)
        served = self.decode_nodes[0].profile.served if self.decode_nodes else None
        # several nodes on one machine's cores (--shared-host): while they serve, the host is never quiet (the router
        # relays every chunk, P's server takes arrivals), so every chunk draws the delays measured beside a busy
        # neighbour; drawn per step (beside only while another node is mid-step) they left the tiny model's 1P1D
        # p99 ITL 21-56% low
        shared = any(n.host is not None and len(n.host) > 1 for n in self.decode_nodes)
        if served is None or not served.chunk_delays.quantiles:
            return [v.result() for v in views], end
        results = []
        for v in views:  # each request's own seeded stream of delays: the same however the events interleaved
            rng = random.Random(f"{self.delay_seed}:{v.trace.request_id}")
            results.append(v.result(lambda rows: served.chunk_delay(rng.random(), rows, shared)))
        return results, max([end] + [r.start + r.latency for r in results if r.success])

    def ttft_split_ms(self) -> Optional[dict]:
        """Mean milliseconds per TTFT stage over the requests that passed it, as bench serve reports a router's;
        None for a collocated deployment (no router)."""
        if not self.pd:
            return None
        loads = {}
        for n in self.decode_nodes:
            loads.update(n.connector.load_times)
        sums: dict[str, list[float]] = {}
        for v in self.views:
            for stage, sec in v.ttft_stages(loads.get(v.trace.request_id), self.first_from_p).items():
                sums.setdefault(stage, []).append(sec)
        return {k: 1000.0 * sum(x) / len(x) for k, x in sums.items()}

    def _submit(self, pool: Pool, view: ClientView, t: float, output_len: int, params: Optional[dict]) -> None:
        if view.error:
            return  # early decode: P refused it already (the router answered the client); D is not asked
        rn = pool.pick()
        node = self.by_name[rn.url]
        try:
            req = node.make_request(view.trace.request_id, view.prompt, output_len, t, params)
        except ValueError as e:  # the node's 400: the client's request fails, as in bench serve
            view.error, view.prompt = str(e), None
            return
        rn.in_flight += 1
        self.owner[(node.name, req.request_id)] = view
        if pool is self.d_pool:
            view.d_arrival = t
            if (params or {}).get(AWAIT_KV):
                view.d_node = node.name
        self._touch(node, t)
        node.add(req)
        if req.is_finished:  # P's first token ended it at D's admission: nothing to run (the client has it)
            del self.owner[(node.name, req.request_id)]
            rn.in_flight -= 1
            view.finished, view.prompt = t, None
        self._wake(node, t)

    def _arrive(self, view: ClientView, t: float) -> None:
        if view.prompt is None:
            view.prompt = self.prompt_for(view.trace)
        if self.pd and view.trace.prompt_len > 1 and self.first_from_p:
            # the client's own params, the first token asked for: P samples it and stops after it
            self._send(self.p_pool, view, t, view.trace.output_len, {"do_remote_decode": True, "first_token": True})
            if self.early:  # D at once, awaiting P's params under the request's handoff key
                self._send(self.d_pool, view, t, view.trace.output_len,
                           {"do_remote_prefill": True, AWAIT_KV: {"key": view.trace.request_id}})
        elif self.pd and view.trace.prompt_len > 1:
            self._send(self.p_pool, view, t, 1, {"do_remote_decode": True})
        else:
            self._send(self.d_pool, view, t, view.trace.output_len, None)

    def _to_decode(self, view: ClientView, params: Optional[dict], t: float) -> None:
        if not self.early:
            self._send(self.d_pool, view, t, view.trace.output_len, params)  # no params: D prefills it
            return
        # P seals its params at its step's end and its KV server answers D's await with them and the KV
        conn = self.fabric.post(view.trace.request_id, params, t)
        if conn is not None:
            node = self.by_name[conn.engine_id]
            self._touch(node, t)
            self._wake(node, t)

    def _drop_decode(self, view: ClientView, t: float) -> None:
        """The router drops D's open request (P's answer was all of it): D aborts it, its await cancelled."""
        node = self.by_name[view.d_node]
        self._touch(node, t)
        node.connector.now = t
        node.scheduler.finish_request(view.trace.request_id, RequestStatus.FINISHED_ABORTED)
        del self.owner[(node.name, view.trace.request_id)]
        self.router_node[node.name].in_flight -= 1
        self._wake(node, t)

    def _send(self, pool: Pool, view: ClientView, t: float, output_len: int, params: Optional[dict]) -> None:
        """The request leaves for a node of `pool` at `t` and reaches it the pool's request latency later (and, xPyD,
        the router's: each send passes it)."""
        lat = self.p_latency if pool is self.p_pool else self.d_latency
        if lat:
            self._push(t + lat, "reach", (pool, view, output_len, params))
        else:
            self._submit(pool, view, t, output_len, params)

    def _touch(self, node: SimNode, t: float) -> None:
        """Something from outside changes `node` at `t`: the steps it leapt that started before `t` happen first."""
        if node.leap is not None:
            self._took_leap(node, node.catch_up(t))

    def _took_leap(self, node: SimNode, lp: Leap) -> None:
        """The client side of applied leap steps, as `_run_node` takes each step: a chunk a row a step at the step's
        end, and the rows its last step ended (a finishing leap, applied at that step's start). Every row has run
        on this node before (its stages are stamped already)."""
        is_p = node.name in self.p_names
        if self.on_step is not None:
            for rec in lp.records():
                self.on_step(node, rec)
        if not is_p or self.first_from_p:
            chunks = [(e, 1, len(lp.rows)) for e in lp.ends]
            for req in lp.rows:
                view = self.owner.get((node.name, req.request_id))
                if view is not None:
                    view.chunks.extend(chunks)
        if lp.finishing:
            for req in lp.rows:
                if req.is_finished and (view := self.owner.get((node.name, req.request_id))) is not None:
                    self._finished(node, req, view, lp.ends[-1], is_p)

    def _finished(self, node: SimNode, req, view: ClientView, end: float, is_p: bool) -> None:
        del self.owner[(node.name, req.request_id)]
        self.router_node[node.name].in_flight -= 1
        if is_p:
            view.p_done = end
            if self.first_from_p and req.kv_transfer_params_out is None:
                view.finished, view.prompt = end, None  # P's token ended it: P's answer is all of it
                if self.early:
                    self._push(end, "drop", view)
            else:
                self._push(end, "prefilled", (view, req.kv_transfer_params_out))
        else:
            view.finished, view.prompt = end, None

    def _wake_releasers(self, t: float) -> None:
        """Leases a D just finished reading (or gave up): their P frees the blocks on its next poll. (A P never
        leaps today, its requests ending at their first token; were it to, the release would cut its leap here.)"""
        if self.fabric is not None:
            for p in self.prefill_nodes:
                if p.connector.released:
                    self._touch(p, t)
                    self._wake(p, t)

    def _after_step(self, node: SimNode, t: float, end: float) -> None:
        """What follows a step that ran at `t` and ends at `end`: released leases' P woken, the node's next wake."""
        self._wake_releasers(t)
        if node.has_work():
            self._wake(node, end)
        elif (nxt := node.next_transfer_event()) is not None:  # P: its leases' expiry, should D never read them
            self._wake(node, max(nxt, end))

    def _run_node(self, node: SimNode, t: float) -> None:
        if node.busy_until > t:
            self._wake(node, node.busy_until)
            return
        if node.leap is not None:  # its planned run ends now (or its finishing last step starts now): apply it all
            lp = node.catch_up(t, at_end=True)
            self._took_leap(node, lp)
            if lp.finishing:
                self._after_step(node, t, lp.ends[-1])
                return
        if self.leap and node.plan_leap(t):
            if node.busy_until > t:
                self._wake(node, node.busy_until)
            else:  # one step, which ends rows: taken now, as the step it is
                lp = node.catch_up(t, at_end=True)
                self._took_leap(node, lp)
                self._after_step(node, t, lp.ends[-1])
            return
        rec = node.step(t)
        if rec is None:
            self._wake_releasers(t)
            nxt = node.next_transfer_event()
            if nxt is not None:
                self._wake(node, nxt)
            return
        if self.on_step is not None:
            self.on_step(node, rec)
        is_p = node.name in self.p_names
        for rid, _, _ in rec.rows:
            view = self.owner.get((node.name, rid))
            if view is not None:
                if is_p and view.p_scheduled is None:
                    view.p_scheduled = rec.start
                elif not is_p and view.d_scheduled is None:
                    view.d_scheduled = rec.start
        # a step that gave a request prefilled here its first token: the other rows' chunks reach their clients that
        # much later (served.arrival_delay_s, the newcomer's way in; a request whose KV was loaded came in long before
        # its replay step; a leap never holds such a step)
        newcomer = node.profile.served.arrival_delay_s
        if newcomer and not any(r.num_output_tokens == n and not (r.kv_transfer_params or {}).get("do_remote_prefill")
                                for r, n in rec.emitted):
            newcomer = 0.0
        for req, n in rec.emitted:  # (_took_leap records a leap's steps the same way: keep the two alike)
            view = self.owner.get((node.name, req.request_id))
            if view is None:
                continue
            if self.first_from_p and not is_p and view.p_done is not None and req.num_output_tokens == n:
                n -= 1  # D sampled the first token itself (its await failed: prefilled here): the router cuts it
            # P's first token goes to the client at once (its way back through the router is not modelled: the hop
            # is counted on sends)
            if (not is_p or self.first_from_p) and n:
                late = newcomer if req.num_output_tokens != n else 0.0
                view.chunks.append((rec.end + late, n, len(rec.rows)))
            if req.is_finished:
                self._finished(node, req, view, rec.end, is_p)
        self._after_step(node, t, rec.end)
