"""What both ends of the tcp transport share: the KV cache as bytes on the wire, and the transfer counters."""
from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch

BLOCKS_PER_READ = 64  # blocks per read frame: D asks for all frames at once, P streams them back to back


@dataclass
class TransferStats:
    """Counters for the Prometheus series of both sides; change and read them under `lock`."""
    bytes_sent: int = 0
    bytes_received: int = 0
    seconds_receiving: float = 0.0
    failures: Counter = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def count(self, cause: str, n: int = 1) -> None:
        if n:  # a zero would still show as a key: failures must stay empty when nothing failed
            with self.lock:
                self.failures[cause] += n


class KVBlocks:
    """Wire order of a frame's payload: [layer, K/V, block], each block's bytes contiguous per layer and K/V."""

    def __init__(self):
        self.flat, self.kv_caches, self.bytes_per_block = None, [], 0

    def register(self, kv_caches: list) -> None:
        c0 = kv_caches[0]  # [2 (K, V), blocks, block_size, kv heads, head size] per layer
        self.kv_caches, self.num_blocks = kv_caches, c0.shape[1]
        self.chunk_bytes = c0[0, 0].numel() * c0.element_size()
        self.bytes_per_block = 2 * len(kv_caches) * self.chunk_bytes
        # On CPU, flat byte views of each layer's cache: reads are sent from, and loads received into, the blocks
        # themselves (`flat`). Elsewhere (flat None) reads gather into host memory and loads scatter from it.
        self.flat = [c.view(-1).view(torch.uint8).numpy() for c in kv_caches] if c0.device.type == "cpu" else None

    def views(self, block_ids: list[int]) -> list[np.ndarray]:
        """Byte views (numpy: untracked by the GC) of `block_ids` in wire order, one per run of consecutive ids."""
        if not block_ids:
            return []
        runs, start, prev = [], block_ids[0], block_ids[0]  # a Python loop: numpy's fixed cost is more at <= 64 ids
        for b in block_ids[1:]:
            if b != prev + 1:
                runs.append((start, prev + 1))
                start = b
            prev = b
        runs.append((start, prev + 1))
        n, cb = self.num_blocks, self.chunk_bytes
        return [flat[(kv * n + s) * cb:(kv * n + e) * cb] for flat in self.flat for kv in (0, 1) for s, e in runs]

    def payload(self, block_ids: list[int]) -> list:
        """What P sends for `block_ids`: views of the blocks themselves, or a gathered host copy."""
        if self.flat:
            return self.views(block_ids)
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.kv_caches[0].device)
        data = torch.stack([c.index_select(1, idx) for c in self.kv_caches])  # [layers, 2, n, B, H, D]
        return [data.cpu().contiguous().view(torch.uint8).numpy()]

    def receive_into(self, block_ids: list[int]) -> list:
        """Where D receives `block_ids`: the blocks themselves, or a host buffer for `finish_receive`."""
        return self.views(block_ids) if self.flat else [memoryview(bytearray(len(block_ids) * self.bytes_per_block))]

    def finish_receive(self, block_ids: list[int], into: list) -> None:
        if self.flat:
            return
        c0 = self.kv_caches[0]
        shape = (len(self.kv_caches), 2, len(block_ids), *c0.shape[2:])  # the payload's size was checked on receipt
        data = torch.frombuffer(into[0], dtype=torch.uint8).view(c0.dtype).view(shape).to(c0.device)
        idx = torch.tensor(block_ids, dtype=torch.long, device=c0.device)
        for layer, cache in enumerate(self.kv_caches):
            cache.index_copy_(1, idx, data[layer])
        if c0.device.type == "cuda":  # on this thread's stream: the load is reported done only once it has run
            done = torch.cuda.Event()
            done.record()
            done.synchronize()
