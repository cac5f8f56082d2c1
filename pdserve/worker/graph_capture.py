"""CUDA graph capture shared by the FULL and PIECEWISE runners: one side stream, a progress bar, warm-up first."""
from __future__ import annotations

import gc
from typing import Callable, Iterable

import torch


def capture_each(items: list, label: str, unit: str, stream: "torch.cuda.Stream", progress: bool,
                 capture_one: Callable[[object, Callable], None]) -> None:
    """Calls capture_one(item, capture) for each item on `stream`, a side stream (as torch requires), where
    capture(fn, pool) runs fn once to warm up (lazy initialisation must not be recorded) and returns its graph.
    torch.cuda.graph collects garbage and empties the cache on every entry; with (L + 1) graphs per PIECEWISE size
    that is most of start-up, so both are no-ops here (as vLLM does) and run once at the end."""

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
    collect, empty = gc.collect, torch.cuda.empty_cache
    gc.collect, torch.cuda.empty_cache = (lambda *a: 0), (lambda: None)
    try:
        with torch.cuda.stream(stream):
            for item in shown:
                capture_one(item, capture)
    finally:
        gc.collect, torch.cuda.empty_cache = collect, empty
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    gc.collect()
