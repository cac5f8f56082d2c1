"""The run's share of non-FULL decode-graph steps, from the servers' `pdserve_cudagraph_steps_total` counters.

Behind a pdserve router the counters that matter are the decode nodes' (the router lists them at `/nodes`); a
single server is scraped directly. Counters are read before and after the run and subtracted, so warm-up and
earlier traffic do not count."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Optional

import httpx
from prometheus_client.parser import text_string_to_metric_families

STEPS = "pdserve_cudagraph_steps"


@dataclass(frozen=True)
class GraphSnapshot:
    steps: Counter  # (mode, reason) -> steps, summed over the scraped nodes
    device: str  # "cuda", "cpu", or "" when the target does not expose pdserve_cudagraph_info

    def __sub__(self, other: "GraphSnapshot") -> "GraphSnapshot":
        return GraphSnapshot(Counter({k: v - other.steps.get(k, 0) for k, v in self.steps.items()}), self.device)

    def summary(self) -> dict:
        full = sum(v for (mode, _), v in self.steps.items() if mode == "FULL")
        reasons = Counter()
        for (mode, reason), v in self.steps.items():
            if mode != "FULL" and v:
                reasons[reason] += int(v)
        non_full = sum(reasons.values())
        total = full + non_full
        return {"full_steps": int(full), "non_full_steps": non_full,
                "non_full_share": non_full / total if total else float("nan"), "non_full_reasons": dict(reasons),
                "device": self.device}


def metric_targets(base_url: str, timeout: float = 5.0) -> list[str]:
    """The URLs whose /metrics carry the decode steps: a router's decode nodes, else the target itself."""
    try:
        r = httpx.get(base_url + "/nodes", timeout=timeout)
        if r.status_code == 200 and isinstance(r.json(), dict) and r.json().get("decode"):
            return [n["url"] for n in r.json()["decode"]]
    except (httpx.HTTPError, ValueError):
        pass
    return [base_url]


def scrape(urls: list[str], timeout: float = 5.0) -> Optional[GraphSnapshot]:
    """None when no target exposes the graph counters (e.g. another engine)."""
    steps, device, found = Counter(), "", False
    for url in urls:
        try:
            r = httpx.get(url + "/metrics", timeout=timeout)
            families = list(text_string_to_metric_families(r.text)) if r.status_code == 200 else []
        except (httpx.HTTPError, ValueError):  # unreachable, or not Prometheus text: no graph counters there
            continue
        for fam in families:
            if fam.name == STEPS:
                found = True
                for s in fam.samples:
                    if s.name.endswith("_total"):
                        steps[(s.labels["mode"], s.labels["reason"])] += s.value
            elif fam.name == "pdserve_cudagraph_info":
                device = fam.samples[0].labels.get("device", device) if fam.samples else device
    return GraphSnapshot(steps, device) if found else None


def format_share(s: dict) -> str:
    reasons = ", ".join(f"{k} {v}" for k, v in sorted(s["non_full_reasons"].items())) or "none"
    return (f"{'Decode graph steps':-^60}\n{'FULL steps:':<44}{s['full_steps']:>16}\n"
            f"{'Non-FULL steps:':<44}{s['non_full_steps']:>16}\n"
            f"{'Non-FULL share (%):':<44}{100 * s['non_full_share']:>16.1f}\n{'Non-FULL reasons:':<20}{reasons:>40}")
