"""CUDA: the KV cache sized from `--gpu-memory-utilization`, after everything else on the GPU is measured.

The order is what makes the number safe: (1) the model runner is built over a probe KV cache of two blocks (the
weights and static buffers are then resident); (2) a forward of the largest step the scheduler can make (every
token on the null block) and a sampling pass over max_num_seqs rows give the activations' peak; (3) the largest
FULL graph and the largest PIECEWISE size are captured into a scratch pool, whose growth bounds the real pool,
since every graph shares one pool and its temporaries (captured largest first, smaller graphs reuse that memory);
(4) the scratch graphs are dropped and the KV cache gets the rest of the budget; (5) the engine captures the real
graphs over it. Memory that other processes or the CUDA context hold counts against the budget too (as vLLM), and
so does whatever the allocator keeps cached: the budget is read off the device, not the allocator.
"""
from __future__ import annotations

import gc
import logging
import os
from dataclasses import dataclass

import torch

logger = logging.getLogger("pdserve.memory")


@dataclass(frozen=True)
class MemoryProfile:
    total: int  # the device's memory
    held: int  # in use once profiled, the probe KV cache aside: weights, static buffers, workspaces (cuBLAS,
    # Triton's), the allocator's cached slack, the CUDA context and other processes
    activations: int  # the largest step's peak above what stays allocated
    graphs: int  # the graph pool's growth for the largest graphs (released after the probe, taken again)


def kv_cache_bytes(p: MemoryProfile, utilization: float) -> int:
    """What the KV cache may take: the budget less everything measured (may be <= 0: the caller says so)."""
    return int(utilization * p.total) - p.held - p.activations - p.graphs


def num_blocks_for(p: MemoryProfile, utilization: float, bytes_per_block: int, max_blocks: int,
                   blocks_per_seq: int) -> int:
    """Blocks for the KV cache, the null block included, capped at `max_blocks` usable ones."""
    usable = min(max(0, kv_cache_bytes(p, utilization)) // bytes_per_block, max_blocks)
    if usable < blocks_per_seq:
        gib = 2 ** 30
        raise ValueError(
            f"--gpu-memory-utilization {utilization}: {usable} KV blocks fit, fewer than one max_model_len sequence "
            f"needs ({blocks_per_seq}); of {p.total / gib:.1f} GiB, {p.held / gib:.2f} GiB is held (weights, "
            f"buffers, other processes), {p.activations / gib:.2f} GiB goes to activations, {p.graphs / gib:.2f} "
            f"GiB to CUDA graphs; raise --gpu-memory-utilization or lower --max-model-len / "
            f"--max-num-batched-tokens / --max-num-seqs")
    return usable + 1


def device_memory_bytes(device: torch.device) -> int:
    """All the memory `device` has: the GPU's, or this machine's physical memory for the CPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def out_of_memory(e: BaseException) -> bool:
    """An allocation that failed: numpy's and Python's MemoryError, torch's CPU allocator and CUDA's OOM."""
    return isinstance(e, (MemoryError, torch.OutOfMemoryError)) or "can't allocate memory" in str(e)


def _settle() -> None:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def profile(runner) -> MemoryProfile:
    """Steps (2)-(3) above, on a runner built over the probe KV cache."""
    _settle()
    probe_kv = sum(c.numel() * c.element_size() for c in runner.kv_caches)
    torch.cuda.reset_peak_memory_stats()
    runner.profile_run()
    _settle()
    # what the step freed again; what it left allocated (workspaces grown for it) is counted in `held` below
    activations = max(0, torch.cuda.max_memory_allocated() - torch.cuda.memory_allocated())
    before = torch.cuda.memory_reserved()
    scratch = runner.probe_graphs()
    graphs = max(0, torch.cuda.memory_reserved() - before)
    del scratch
    _settle()
    free, total = torch.cuda.mem_get_info()
    p = MemoryProfile(total, total - free - probe_kv, activations, graphs)
    logger.info("memory profile: %s", {k: f"{v / 2**30:.2f} GiB" for k, v in p.__dict__.items()})
    return p


def check_after_capture(utilization: float) -> None:
    """Graph instantiation also takes device memory outside the allocator, for every graph, which the probe of
    the largest ones cannot see: say so when the engine ended up over its budget."""
    free, total = torch.cuda.mem_get_info()
    used = total - free
    if used > utilization * total:
        logger.warning("after graph capture the GPU has %.2f GiB in use, %.2f GiB over --gpu-memory-utilization "
                       "%.2f: lower it, or capture fewer sizes (--max-cudagraph-capture-size)", used / 2**30,
                       (used - utilization * total) / 2**30, utilization)
