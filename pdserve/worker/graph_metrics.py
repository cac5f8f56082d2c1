"""Per-step graph records: (runtime mode, unpadded tokens, padded tokens, num_reqs, reason), aggregated.

`snapshot()` is what `engine.graph_stats()` and the Prometheus series (`pdserve_cudagraph_steps_total{mode,reason}`,
`pdserve_cudagraph_padded_tokens_total`) read; `table()` is the periodic --cudagraph-metrics log, with vLLM's
columns plus Reason. A table covers the steps from its window's first step on: it goes out once a step lands
`log_interval` s after that one, or when the server's engine loop finds it due (`flush_if_due`, at least once a
second, idle or not), so a burst's last steps are not held back until the next burst.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from typing import Optional

logger = logging.getLogger("pdserve.cudagraph")


class GraphStats:
    def __init__(self, device: str, captured: bool, log_interval: Optional[float] = None):
        self.device = device
        self.captured = captured  # real CUDA graphs captured (False on CPU: FULL runs the same callable eagerly)
        self.steps: Counter[tuple[str, str]] = Counter()  # (mode, reason) -> steps, since start
        self.padded_tokens = 0  # padding tokens added, since start
        self.window: Counter[tuple[int, int, int, str, str]] = Counter()  # since the last table
        self.log_interval = log_interval
        self._window_start = 0.0  # monotonic time of the window's first step
        self._lock = threading.Lock()

    def record(self, mode: str, num_tokens: int, padded_tokens: int, num_reqs: int, reason: Optional[str]) -> None:
        reason = reason or "none"
        with self._lock:
            self.steps[(mode, reason)] += 1
            self.padded_tokens += padded_tokens - num_tokens
            if self.log_interval is not None:
                if not self.window:
                    self._window_start = time.monotonic()
                self.window[(num_tokens, padded_tokens, num_reqs, mode, reason)] += 1
        self.flush_if_due()

    def flush_if_due(self) -> None:
        if self.log_interval is not None and self.window and \
                time.monotonic() - self._window_start >= self.log_interval:
            self.log_table()

    def snapshot(self) -> dict:
        with self._lock:
            steps = dict(self.steps)
            full = sum(n for (m, _), n in steps.items() if m == "FULL")
            total = sum(steps.values())
            by_reason: Counter = Counter()  # a reason seen under two modes (PIECEWISE and NONE) counts both
            for (m, r), n in steps.items():
                if m != "FULL":
                    by_reason[r] += n
            return {"device": self.device, "captured": self.captured, "total_steps": total, "full_steps": full,
                    "non_full_steps": total - full, "padded_tokens": self.padded_tokens,
                    "steps": {f"{m}/{r}": n for (m, r), n in sorted(steps.items())},
                    "non_full_by_reason": dict(by_reason)}

    def table(self) -> str:
        with self._lock:
            rows, self.window = sorted(self.window.items(), key=lambda kv: -kv[1]), Counter()
            span = time.monotonic() - self._window_start if rows else 0.0
        head = f"{'Unpadded Tokens':>15} | {'Padded Tokens':>13} | {'Num Paddings':>12} | {'Num Reqs':>8} | " \
               f"{'Runtime Mode':>12} | {'Reason':>17} | {'Count':>6}"
        lines = [f"CUDA graph metrics, {sum(n for _, n in rows)} steps over {span:.1f} s (device={self.device}, "
                 f"captured={self.captured}):", head, "-" * len(head)]
        for (n, p, r, mode, reason), count in rows:
            lines.append(f"{n:>15} | {p:>13} | {p - n:>12} | {r:>8} | {mode:>12} | {reason:>17} | {count:>6}")
        return "\n".join(lines)

    def log_table(self) -> None:
        logger.info("%s", self.table())
