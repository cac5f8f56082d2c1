"""Wrappers the diagnostic benchmarks put around an engine's methods (nothing inside changes)."""
from __future__ import annotations

import time
from typing import Callable


def timed(fn: Callable, sink: list) -> Callable:
    """`fn`, appending each call's milliseconds to `sink` (also when it raises)."""
    def call(*a, **kw):
        t = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            sink.append(1e3 * (time.perf_counter() - t))
    return call
