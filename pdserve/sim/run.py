"""One simulated run: build the deployment's nodes from the engine's config objects, run the trace, and return what
`bench serve --save-result` writes for a real run (vLLM's keys, per-request lists, the decode nodes' graph share),
plus a `sim` section (deployment, profile, per-node counters), so the two are read the same way."""
from __future__ import annotations

import re
import time
from collections import Counter
from dataclasses import dataclass
from typing import Optional

from pdserve.bench.metrics import compute_metrics, summarize
from pdserve.bench.server_metrics import GraphSnapshot
from pdserve.config import EngineConfig
from pdserve.sim.connector import Fabric, SimConnector, TransferModel
from pdserve.sim.node import DEFAULT_MAX_MODEL_LEN, SimNode, num_blocks_for
from pdserve.sim.profile import Profile
from pdserve.sim.simulator import Simulator
from pdserve.sim.trace import TraceRequest, prompt_token_ids

VOCAB_SIZE = 32000  # the range simulated token ids are drawn from; only equality of ids matters (prefix hits)
_XPYD = re.compile(r"(\d+)p(\d+)d")


@dataclass(frozen=True)
class Deployment:
    num_prefill: int  # 0: collocated
    num_decode: int  # collocated: the number of nodes

    @property
    def name(self) -> str:
        return f"collocated x{self.num_decode}" if not self.num_prefill else f"{self.num_prefill}P{self.num_decode}D"


def parse_deployment(spec: str, nodes: int = 1) -> Deployment:
    """`collocated` (with `nodes` nodes) or `XpYd` (1p1d, 2p4d, ...)."""
    if nodes < 1:
        raise ValueError("--nodes must be >= 1")
    if spec == "collocated":
        return Deployment(0, nodes)
    m = _XPYD.fullmatch(spec.lower())
    if m is None or int(m[1]) < 1 or int(m[2]) < 1:
        raise ValueError(f"--deployment {spec!r}: 'collocated' or XpYd with X, Y >= 1 (e.g. 1p1d, 2p4d)")
    if nodes != 1:
        raise ValueError("--nodes is for collocated deployments; an XpYd deployment names its node counts")
    return Deployment(int(m[1]), int(m[2]))


def max_model_len_for(config: EngineConfig, profile: Profile) -> int:
    return config.model.max_model_len or profile.model.max_model_len or DEFAULT_MAX_MODEL_LEN


def build_nodes(dep: Deployment, config: EngineConfig, profile: Profile, transfer: Optional[TransferModel],
                spec_acceptance: float, seed: int) -> tuple[list[SimNode], list[SimNode], Optional[Fabric]]:
    mml = max_model_len_for(config, profile)
    num_blocks = num_blocks_for(config, profile.model.kv_bytes_per_token, mml)
    device = profile.raw.get("device", "sim")
    fabric = Fabric(transfer, profile.model.kv_bytes_per_token, config.cache.block_size, seed) \
        if dep.num_prefill else None

    def node(name: str, role: Optional[str], i: int) -> SimNode:
        conn = SimConnector(role, name, fabric, config.cache.block_size) if role else None
        return SimNode(name, config, profile, mml, num_blocks, conn, spec_acceptance, VOCAB_SIZE, seed * 1000 + i,
                       device)
    if not dep.num_prefill:
        return [], [node(f"node{i}", None, i) for i in range(dep.num_decode)], None
    prefill = [node(f"prefill{i}", "kv_producer", i) for i in range(dep.num_prefill)]
    decode = [node(f"decode{i}", "kv_consumer", 100 + i) for i in range(dep.num_decode)]
    return prefill, decode, fabric


def simulate(trace: list[TraceRequest], dep: Deployment, config: EngineConfig, profile: Profile, *,
             transfer: Optional[TransferModel] = None, policy: str = "round-robin", spec_acceptance: float = 0.0,
             seed: int = 0, on_step=None, slos: Optional[dict[str, float]] = None,
             pd_first_token: str = "replay", step_by_step: bool = False, shared_host: bool = False,
             early_decode: bool = True) -> dict:
    """Run `trace` on the deployment; returns bench serve's result dict (see module docstring). `slos` (seconds
    by metric, bench serve's --goodput) adds `request_goodput`; `pd_first_token`: the router's --pd-first-token
    (replay or prefill, for an XpYd deployment), with `early_decode` the router's --pd-early-decode (prefill only:
    D asked when P is, its KV straight from P's step end); `step_by_step`: every step through the scheduler, no
    event-leaping (the same results, slower; sim/simulator.py); `shared_host`: every node on one machine's cores,
    each step slowed by the profile's served.neighbour_scale per other node mid-step as it starts (a deployment run
    on one machine, as bench pd's; steps then go one by one, since a leap's step times would change)."""
    if pd_first_token == "prefill" and not dep.num_prefill:
        raise ValueError("--pd-first-token prefill is for XpYd deployments (P samples the first token for D)")
    if dep.num_prefill and transfer is None:
        raise ValueError("an XpYd deployment needs a transfer model")
    prefill, decode, fabric = build_nodes(dep, config, profile, transfer, spec_acceptance, seed)
    if shared_host:
        for n in prefill + decode:
            n.host = prefill + decode
    # the router stands in front of xPyD and of several collocated nodes; a lone collocated node is served directly
    routed = transfer is not None and (dep.num_prefill > 0 or dep.num_decode > 1)
    sim = Simulator(prefill, decode, policy, fabric, on_step, pd_first_token, leap=not (step_by_step or shared_host),
                    router_latency_s=transfer.router_latency_s if routed else 0.0, delay_seed=seed,
                    early_decode=early_decode)
    t0 = time.perf_counter()
    results, duration = sim.run(trace, lambda r: prompt_token_ids(r, VOCAB_SIZE, seed))
    wall = time.perf_counter() - t0
    metrics = compute_metrics(results, duration, slos)
    steps = Counter()
    for n in decode:  # as bench serve scrapes: the decode nodes behind a router, else the server itself
        steps.update(n.graph_stats.steps)
    spec = None
    if config.speculative_config is not None:
        spec = Counter()
        for n in decode:
            spec.update(n.spec_counts)
    graph = GraphSnapshot(steps, profile.raw.get("device", "sim"), spec).summary()
    return {
        "date": time.strftime("%Y%m%d-%H%M%S"), "backend": "sim", "base_url": f"sim://{dep.name}", "endpoint": "",
        "model_id": profile.raw.get("name", "sim"), "model": profile.raw.get("name", "sim"), "tokenizer_id": None,
        "num_prompts": len(trace), "max_concurrency": None, "seed": seed, "ignore_eos": True, "temperature": 0.0,
        "warmup": 0, "goodput_slos_ms": {k: v * 1000 for k, v in (slos or {}).items()}, **metrics.to_dict(),
        **metrics.vllm_keys(), "graph": graph,
        "router_ttft_split_ms": sim.ttft_split_ms(),
        "send_lag_ms": summarize([0.0] * len(results)),  # a simulated client sends on time
        "input_lens": [r.prompt_len for r in results],
        "output_lens": [r.output_tokens if r.success else 0 for r in results],
        "ttfts": [r.ttft for r in results], "itls": [r.itl for r in results],
        "latencies": [r.latency for r in results], "start_times": [r.start for r in results],
        "generated_texts": [""] * len(results), "errors": [r.error for r in results],
        "request_ids": [r.request_id for r in trace],
        "sim": {"deployment": dep.name, "router_policy": policy, "pd_first_token": pd_first_token,
                "pd_early_decode": early_decode and pd_first_token == "prefill",
                "profile": profile.raw, "wall_s": wall, "step_by_step": step_by_step, "shared_host": shared_host,
                "kv_bytes_transferred": fabric.bytes_moved if fabric else 0,
                "kv_failed_loads": fabric.failed_loads if fabric else 0,
                "kv_expired_leases": fabric.expired_leases if fabric else 0,
                "nodes": [_node_stats(n, role) for role, ns in (("prefill", prefill), ("decode", decode)) for n in ns]},
    }


def _node_stats(n: SimNode, role: str) -> dict:
    s = n.scheduler
    return {"name": n.name, "role": role if n.connector is not None else "collocated", "steps": n.num_steps,
            "rows": n.num_rows, "busy_s": n.busy_s,
            "num_blocks": n.kv.pool.num_blocks,
            "preemptions": s.num_preemptions, "prefix_cache_queries": s.prefix_cache_queries,
            "prefix_cache_hits": s.prefix_cache_hits, "graph": n.graph_stats.snapshot()}
