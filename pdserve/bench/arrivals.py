"""Request arrival times: gamma-distributed gaps, vLLM's model (burstiness 1 is a Poisson process)."""
from __future__ import annotations

import math

import numpy as np


def arrival_offsets(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Seconds from the start at which each of `n` requests is sent.

    Gaps are gamma(shape = burstiness, scale = 1/(rate * burstiness)), mean 1/rate whatever the burstiness; lower
    burstiness means burstier traffic, burstiness = inf constant gaps of 1/rate. As vLLM, the first request waits
    its own gap too, and the times are rescaled so that the last send lands at n/rate: n gaps of mean 1/rate (a
    first gap of 0 left n - 1 gaps to fill n/rate, 12% slow for 8 requests). rate = inf sends everything at once."""
    if n <= 0:
        return []
    if not burstiness > 0:  # NaN fails it too
        raise ValueError("--burstiness must be a number > 0 (or inf: constant gaps)")
    if not rate > 0:
        raise ValueError("--request-rate must be > 0 (or inf)")
    if math.isinf(rate):
        return [0.0] * n
    if math.isinf(burstiness):
        return [(i + 1) / rate for i in range(n)]
    gaps = np.random.default_rng(seed).gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    t = np.cumsum(gaps)
    if t[-1] > 0:  # the gaps' shape (burstiness) is kept
        t *= (n / rate) / t[-1]
    return t.tolist()
