"""What a pdserve target says about a run, from its Prometheus counters read before and after it (so warm-up and
earlier traffic do not count):
- the share of non-FULL decode-graph steps, from `pdserve_cudagraph_steps_total`: behind a router the counters that
  matter are the decode nodes' (the router lists them at `/nodes`); a single server is scraped directly;
- behind a router, the mean time to first token by stage, from `pdserve_router_ttft_seconds{stage}`;
- the decode nodes' (or the server's) mean queue and prefill time per request, from vLLM's
  `vllm:request_queue_time_seconds` and `vllm:request_prefill_time_seconds`: on D, from its HTTP arrival to its first
  step (the KV wait included) and that step, which for a request that came with P's first token is D's half of the
  gap between the first two tokens, a part the router's split cannot see;
- with speculative decoding, the acceptance rate (accepted / draft tokens) and the mean acceptance length
  (1 + accepted / drafts, vLLM's definition) from `vllm:spec_decode_*_total` (vLLM's series, which a pdserve node
  exposes under vLLM's names) and `pdserve_spec_decode_num_placeholder_tokens_total`."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Optional

from prometheus_client.parser import text_string_to_metric_families

from pdserve.bench.http_get import get_json, http_get

STEPS = "pdserve_cudagraph_steps"
SPEC = ("vllm:spec_decode_", "pdserve_spec_decode_")


@dataclass(frozen=True)
class GraphSnapshot:
    steps: Counter  # (mode, reason) -> steps, summed over the scraped nodes
    device: str  # "cuda", "cpu", or "" when the target does not expose pdserve_cudagraph_info
    spec: Optional[Counter] = None  # num_drafts, num_draft_tokens, num_accepted_tokens, ... (speculative decoding)

    def __sub__(self, other: "GraphSnapshot") -> "GraphSnapshot":
        spec = None if self.spec is None else Counter({k: v - (other.spec or {}).get(k, 0)
                                                       for k, v in self.spec.items()})
        return GraphSnapshot(Counter({k: v - other.steps.get(k, 0) for k, v in self.steps.items()}), self.device,
                             spec)

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
                "device": self.device, "spec_decode": self._spec_summary()}

    def _spec_summary(self) -> Optional[dict]:
        if self.spec is None:
            return None
        d, t, a = (int(self.spec.get(k, 0)) for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"))
        return {"num_drafts": d, "num_draft_tokens": t, "num_accepted_tokens": a,
                "num_placeholder_tokens": int(self.spec.get("num_placeholder_tokens", 0)),
                "acceptance_rate": a / t if t else float("nan"),
                "mean_acceptance_length": 1 + a / d if d else float("nan")}


def metric_targets(base_url: str, timeout: float = 5.0) -> list[str]:
    """The URLs whose /metrics carry the decode steps: a router's decode nodes, else the target itself."""
    try:
        nodes = get_json(base_url + "/nodes", timeout)
        if isinstance(nodes, dict) and nodes.get("decode"):
            return [n["url"] for n in nodes["decode"]]
    except (OSError, ValueError):
        pass
    return [base_url]


def _families(url: str, timeout: float) -> list:
    try:
        status, body = http_get(url + "/metrics", timeout)
        return list(text_string_to_metric_families(body.decode(errors="replace"))) if status == 200 else []
    except (OSError, ValueError):  # unreachable, or not Prometheus text: nothing of ours there
        return []


def scrape(urls: list[str], timeout: float = 5.0) -> Optional[GraphSnapshot]:
    """None when no target exposes the graph counters (e.g. another engine)."""
    steps, device, found, spec = Counter(), "", False, None
    for url in urls:
        for fam in _families(url, timeout):
            if fam.name.startswith(SPEC) and not fam.name.endswith("num_accepted_tokens_per_pos"):
                spec = spec if spec is not None else Counter()
                key = fam.name.split("spec_decode_", 1)[1]
                spec[key] += sum(x.value for x in fam.samples if x.name.endswith("_total"))
            elif fam.name == STEPS:
                found = True
                for s in fam.samples:
                    if s.name.endswith("_total"):
                        steps[(s.labels["mode"], s.labels["reason"])] += s.value
            elif fam.name == "pdserve_cudagraph_info":
                device = fam.samples[0].labels.get("device", device) if fam.samples else device
    return GraphSnapshot(steps, device, spec) if found else None


def format_share(s: dict) -> str:
    reasons = ", ".join(f"{k} {v}" for k, v in sorted(s["non_full_reasons"].items())) or "none"
    return (f"{'Decode graph steps':-^60}\n{'FULL steps:':<44}{s['full_steps']:>16}\n"
            f"{'Non-FULL steps:':<44}{s['non_full_steps']:>16}\n"
            f"{'Non-FULL share (%):':<44}{100 * s['non_full_share']:>16.1f}\n{'Non-FULL reasons:':<20}{reasons:>40}"
            + (_format_spec(s["spec_decode"]) if s.get("spec_decode") else ""))


def _format_spec(sd: dict) -> str:
    return (f"\n{'Speculative decoding':-^60}\n{'Drafts:':<44}{sd['num_drafts']:>16}\n"
            f"{'Draft tokens (placeholders apart):':<44}{sd['num_draft_tokens']:>16}\n"
            f"{'Placeholder tokens:':<44}{sd['num_placeholder_tokens']:>16}\n"
            f"{'Acceptance rate (%):':<44}{100 * sd['acceptance_rate']:>16.1f}\n"
            f"{'Mean acceptance length:':<44}{sd['mean_acceptance_length']:>16.2f}")


def _sums(urls: list[str], keys: dict, timeout: float) -> Optional[dict]:
    """key -> (sum of seconds, count) of the histograms named in `keys` (family name -> the key of a sample) over
    the `urls`' /metrics; None when none of them has one."""
    out: dict = {}
    for url in urls:
        for fam in _families(url, timeout):
            key_of = keys.get(fam.name)
            if key_of is None:
                continue
            for s in fam.samples:
                key = key_of(s)
                if s.name.endswith(("_sum", "_count")) and key:
                    total, n = out.get(key, (0.0, 0))
                    out[key] = (total + s.value, n) if s.name.endswith("_sum") else (total, n + int(s.value))
    return out or None


def scrape_ttft_stages(base_url: str, timeout: float = 5.0) -> Optional[dict]:
    """stage -> (sum of seconds, count) of a router's TTFT split; None for a target that is not a pdserve router."""
    return _sums([base_url], {"pdserve_router_ttft_seconds": lambda s: s.labels.get("stage")}, timeout)


def scrape_phases(urls: list[str], timeout: float = 5.0) -> Optional[dict]:
    """queue / prefill -> (sum of seconds, count) over the `urls` (metric_targets: a router's decode nodes)."""
    return _sums(urls, {"vllm:request_queue_time_seconds": lambda s: "queue",
                        "vllm:request_prefill_time_seconds": lambda s: "prefill"}, timeout)


def means_ms(before: Optional[dict], after: Optional[dict]) -> Optional[dict]:
    """Mean milliseconds per key over the run's requests (those that passed the stage), from two scrapes' sums
    (scrape_ttft_stages', scrape_phases')."""
    if after is None:
        return None
    out = {}
    for stage, (total, n) in after.items():
        t0, n0 = (before or {}).get(stage, (0.0, 0))
        if n > n0:
            out[stage] = 1000.0 * (total - t0) / (n - n0)
    return out


def format_phases(phases: dict) -> str:
    rows = [f"{f'Mean {k} time (ms):':<44}{phases[k]:>16.2f}" for k in ("queue", "prefill") if k in phases]
    return "\n".join([f"{'Decode node phases':-^60}", *rows])


def format_ttft_split(split: dict) -> str:
    order = ("router_to_prefill", "prefill", "kv_transfer", "decode_queue", "first_token", "total")
    rows = [f"{f'Mean {k} (ms):':<44}{split[k]:>16.2f}" for k in order if k in split]
    return "\n".join([f"{'Router TTFT split':-^60}", *rows])
