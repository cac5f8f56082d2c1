"""Request arrival times: gamma-distributed gaps, vLLM's model (burstiness 1 is a Poisson process)."""
from __future__ import annotations

import math

import numpy as np


def arrival_offsets(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Seconds from the start at which each of `n` requests is sent.

    Gaps are gamma(shape = burstiness, scale = 1/(rate * burstiness)), mean 1/rate whatever the burstiness; lower
    burstiness means burstier traffic. rate = inf sends everything at once."""
    if n <= 0:
        return []
    if not 0 < burstiness < math.inf:  # NaN fails both comparisons
        raise ValueError("--burstiness must be a number > 0")
    if not rate > 0:
        raise ValueError("--request-rate must be > 0 (or inf)")
    if math.isinf(rate):
        return [0.0] * n
    gaps = np.random.default_rng(seed).gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    gaps[0] = 0.0  # the first request goes at once
    t = np.cumsum(gaps)
    if n > 1:  # as vLLM: rescale so the last send lands at n/rate; the gaps' shape (burstiness) is kept
        t *= (n / rate) / t[-1]
    return t.tolist()
