"""CUDA graph capture shared by the FULL and PIECEWISE runners: one side stream, a progress bar, warm-up first."""
from __future__ import annotations

from typing import Callable, Iterable

import torch


def capture_each(items: list, label: str, unit: str, progress: bool,
                 capture_one: Callable[[object, Callable], None]) -> None:
    """Calls capture_one(item, capture) for each item on a side stream (as torch requires), where capture(fn, pool)
    runs fn once to warm up (lazy initialisation must not be recorded) and returns its graph."""
    stream = torch.cuda.Stream()

    def capture(fn: Callable[[], object], pool) -> "torch.cuda.CUDAGraph":
        fn()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=stream):
            fn()
        return graph

    shown: Iterable = items
    if progress:
        from tqdm import tqdm
        shown = tqdm(items, desc=f"Capturing CUDA graphs ({label})", unit=unit)
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for item in shown:
            capture_one(item, capture)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
