"""A node's `Server-Timing` header: written by the server (`server_timing`) with the first token's engine timing,
read by pdserve's router (`parse_server_timing`) for its TTFT split (router/timing.py)."""
from __future__ import annotations

from typing import Optional

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
