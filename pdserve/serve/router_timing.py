"""The router's TTFT split: each node's `Server-Timing` header (written by `server_timing`, read by
`parse_server_timing`) and the router's own clock, per request, into `pdserve_router_ttft_seconds{stage}` (the stages
are defined in pdserve/serve/router.py's docstring)."""
from __future__ import annotations

from typing import Optional

from prometheus_client import CollectorRegistry, Histogram

# D's answer to a P/D request carries this header when D took none of P's KV (it prefilled locally: a refused or
# failed load, a lease gone, a KV link to P that TLS or a firewall breaks). D's own `done` to P travels that same
# link, so the router releases P's lease over HTTP instead of leaving it to expire.
KV_UNUSED_HEADER = "X-PD-KV-Unused"


def parse_server_timing(header: Optional[str]) -> dict[str, float]:
    """{name: seconds} from a `Server-Timing` header (`name;dur=<ms>, ...`); parts without a duration are skipped."""
    out = {}
    for part in (header or "").split(","):
        name, *params = (x.strip() for x in part.split(";"))
        for param in params:
            key, _, value = param.partition("=")
            if key == "dur":
                try:
                    out[name] = float(value) / 1000
                except ValueError:
                    pass
    return out


def server_timing(timing: Optional[dict], kv_unused: bool = False) -> dict:
    """A `Server-Timing` header (`name;dur=<ms>`, RFC's format) from the first token's engine timing
    (engine_messages.timing: queue, kv_transfer, prefill, ttft): the router builds its TTFT split from it. With
    `kv_unused` (D took none of P's KV, e.g. its KV link to P is broken, so D's own `done` may not reach P
    either), KV_UNUSED_HEADER too: pdserve's router then releases P's lease over HTTP."""
    out = {KV_UNUSED_HEADER: "1"} if kv_unused else {}
    if timing:
        out["Server-Timing"] = ", ".join(f"{k};dur={v * 1000:.3f}" for k, v in timing.items())
    return out


class TtftSplit:
    def __init__(self, registry: CollectorRegistry):
        self.hist = Histogram("pdserve_router_ttft_seconds", "Time to first token by stage: router_to_prefill, "
                              "prefill, kv_transfer, decode_queue, first_token (these add up to total), and total.",
                              ["stage"], registry=registry,
                              buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))

    def observe(self, total: float, p_round_trip: Optional[float], p: dict, d: dict, handed_over: bool) -> None:
        """One request's TTFT split. `p`, `d`: P's and D's Server-Timing ({} when absent); `handed_over`: D got
        P's KV params. first_token is the remainder, so the stages observed add up to `total`."""
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
        stages["first_token"] = max(rest, 0.0)
        for stage, seconds in stages.items():
            self.hist.labels(stage).observe(seconds)
