"""The router's TTFT split: each node's `Server-Timing` header (serve/server_timing.py) and the router's own clock,
per request, into `pdserve_router_ttft_seconds{stage}` (the stages are defined in router/app.py's docstring)."""
from __future__ import annotations

from typing import Optional

from prometheus_client import CollectorRegistry, Histogram


class TtftSplit:
    def __init__(self, registry: CollectorRegistry):
        self.hist = Histogram("pdserve_router_ttft_seconds", "Time to first token by stage: router_to_prefill, "
                              "prefill, kv_transfer, decode_queue, first_token (these add up to total), and total.",
                              ["stage"], registry=registry,
                              buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))

    def observe(self, total: float, p_round_trip: Optional[float], p: dict, d: dict, handed_over: bool,
                from_prefill: bool = False) -> None:
        """One request's TTFT split. `p`, `d`: P's and D's Server-Timing ({} when absent); `handed_over`: D got
        P's KV params. first_token is the remainder, so the stages observed add up to `total`; with the first token
        from P (`from_prefill`) it is `first_token_from_prefill`, the router's own time to put it out."""
        stages = {"total": total}
        rest = total
        if p_round_trip is not None:
            rest -= p_round_trip
            if "prefill" in p:
                stages["prefill"] = p["prefill"]
                stages["router_to_prefill"] = max(p_round_trip - p["prefill"], 0.0)
        if handed_over and "kv_transfer" in d:
            stages["kv_transfer"] = d["kv_transfer"]
            rest -= d["kv_transfer"]
        if "queue" in d:
            stages["decode_queue"] = d["queue"]
            rest -= d["queue"]
        stages["first_token_from_prefill" if from_prefill else "first_token"] = max(rest, 0.0)
        for stage, seconds in stages.items():
            self.hist.labels(stage).observe(seconds)
