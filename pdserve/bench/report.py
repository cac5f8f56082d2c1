"""The seed's table and plot from `bench pd` rows (one row per arm and rate)."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

TIMING = (("mean_tpot_ms", "mean TPOT ms"), ("p99_tpot_ms", "p99 TPOT ms"), ("p99_itl_ms", "p99 ITL ms"),
          ("median_ttft_ms", "median TTFT ms"))
CPU_CAVEAT = "device=cpu: timing differences between rules are not graph effects"


def _reference(rows: list[dict], row: dict, on_gpu: bool) -> Optional[dict]:
    """On a GPU every arm is compared with the strict arm (the seed's 'before'); on CPU rule-vs-rule timing says
    nothing about graphs, so only P/D arms are compared, with collocated."""
    ref_arm = "strict" if on_gpu else "collocated"
    if row["arm"] == ref_arm:
        return None
    return next((r for r in rows if r["arm"] == ref_arm and r["rate"] == row["rate"]), None)


def arm_label(arm: str) -> str:
    """The table's and plot's name of an arm: collocated ones as they are, P/D ones as `1P1D <arm>`."""
    return arm if arm.startswith("collocated") else f"1P1D {arm}"


def _cell(value: float, ref: Optional[float]) -> str:
    if value is None or math.isnan(value):
        return "n/a"
    if ref is None or math.isnan(ref) or ref == 0:
        return f"{value:.2f}"
    return f"{value:.2f} ({100 * (value - ref) / ref:+.0f}%)"


def _share(share: float, ref: float) -> str:
    if math.isnan(share):
        return "n/a"
    return f"{100 * share:.1f}%" + ("" if math.isnan(ref) else f" ({100 * (share - ref):+.1f} pp)")


def format_table(rows: list[dict]) -> str:
    on_gpu = any(r["device"] == "cuda" for r in rows)
    device = "cuda" if on_gpu else (next((r["device"] for r in rows if r["device"]), "") or "unknown")
    spec = any(r.get("spec_decode") for r in rows)  # speculative decoding: D's (or collocated's) acceptance
    head = ["ISL/OSL", "rate", "arm", "non-FULL", "non-FULL reasons", *(label for _, label in TIMING), "failed",
            *(["accept %", "mean acc len"] if spec else [])]
    body = []
    for r in sorted(rows, key=lambda r: (r["isl"], r["osl"], r["rate"])):
        ref = _reference(rows, r, on_gpu)
        share, ref_share = r["non_full_share"], ref["non_full_share"] if ref and on_gpu else math.nan
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(r["non_full_reasons"].items())) or "-"
        body.append([f"{r['isl']}/{r['osl']}", f"{r['rate']:g}", arm_label(r["arm"]), _share(share, ref_share), reasons,
                     *(_cell(r[k], ref[k] if ref else None) for k, _ in TIMING), str(r["failed"]),
                     *(_acceptance(r.get("spec_decode")) if spec else [])])
    widths = [max(len(x) for x in col) for col in zip(head, *body)]

    def line(cells: list[str]) -> str:
        return "  ".join(c.rjust(w) if i > 2 else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    out = [line(head), "-" * len(line(head))] + [line(b) for b in body]
    note = ("(%): change against the 1P1D strict arm at the same rate" if on_gpu else
            f"{CPU_CAVEAT}; (%): 1P1D against collocated at the same rate")
    return "\n".join([f"bench pd (device={device})", *out, note])


def _acceptance(sd: Optional[dict]) -> list[str]:
    if not sd or not sd["num_draft_tokens"]:
        return ["-", "-"]
    return [f"{100 * sd['acceptance_rate']:.1f}", f"{sd['mean_acceptance_length']:.2f}"]


def plot(rows: list[dict], path: Path) -> Optional[Path]:
    """p99 ITL and non-FULL share against rate, one line per arm. None when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (ax_itl, ax_share) = plt.subplots(1, 2, figsize=(11, 4))
    for arm in dict.fromkeys(r["arm"] for r in rows):
        pts = sorted((r["rate"], r["p99_itl_ms"], 100 * r["non_full_share"]) for r in rows if r["arm"] == arm)
        label = arm_label(arm)
        ax_itl.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
        ax_share.plot([p[0] for p in pts], [p[2] for p in pts], marker="o", label=label)
    device = next((r["device"] for r in rows if r["device"]), "unknown")
    ax_itl.set(xlabel="request rate (req/s)", ylabel="p99 ITL (ms)", title=f"p99 inter-token latency ({device})")
    ax_share.set(xlabel="request rate (req/s)", ylabel="non-FULL steps (%)", title="decode steps off FULL graphs")
    for ax in (ax_itl, ax_share):
        ax.set_ylim(bottom=0)  # from zero: a 1 ms wobble must not look like a cliff
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
