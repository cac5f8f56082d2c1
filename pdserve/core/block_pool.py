"""Paged KV blocks: free list, reference counts, prefix cache by chained block hashes, LRU eviction.

Invariants (`check_invariants` proves them):
- block 0 is the null block: never free, never owned, never cached; only padded rows write or read it;
- a block with ref_cnt 0 is in the free queue, a block with ref_cnt > 0 is not;
- ref_cnt equals the number of owners' block lists that hold the block;
- the hash map points only at blocks carrying that hash; a cached free block is evictable, oldest first.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from typing import Iterable, Optional

from pdserve.sched_output import NULL_BLOCK


def hash_block(parent: Optional[bytes], token_ids: Iterable[int]) -> bytes:
    """Chained hash of one full block: equal iff the whole prefix up to this block is equal."""
    h = hashlib.blake2b(parent or b"", digest_size=16)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True):
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[Optional[bytes]] = [None] * num_blocks
        # Allocation takes the front. Freed cached blocks go to the back (LRU); freed uncached blocks go to the
        # front, so they are reused before any cached block is evicted.
        self.free_queue: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, num_blocks))
        self.cached: dict[bytes, int] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_cached_free_blocks(self) -> int:
        return sum(1 for b in self.free_queue if self.block_hash[b] is not None)

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def lookup(self, block_hash: bytes) -> Optional[int]:
        return self.cached.get(block_hash) if self.enable_caching else None

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take a reference on cache hits; a hit sitting in the free queue stops being evictable."""
        for b in block_ids:
            if self.ref_cnt[b] == 0:
                del self.free_queue[b]
            self.ref_cnt[b] += 1

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free_queue):
            raise RuntimeError(f"cannot allocate {n} blocks, {len(self.free_queue)} free")
        out = []
        for _ in range(n):
            b, _ = self.free_queue.popitem(last=False)
            self._evict(b)
            self.ref_cnt[b] = 1
            out.append(b)
        return out

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference each. Callers pass a request's blocks tail first, so a prompt's last blocks are
        evicted before its shared prefix."""
        for b in block_ids:
            assert self.ref_cnt[b] > 0, f"double free of block {b}"
            self.ref_cnt[b] -= 1
            if self.ref_cnt[b] == 0:
                if self.block_hash[b] is None or not self.enable_caching:
                    self._evict(b)
                    self.free_queue[b] = None
                    self.free_queue.move_to_end(b, last=False)  # uncached blocks are reused first
                else:
                    self.free_queue[b] = None

    def cache_block(self, block_id: int, block_hash: bytes) -> None:
        """Publish a full, computed block. If an identical block is already published, keep that one."""
        if not self.enable_caching or self.block_hash[block_id] is not None or block_hash in self.cached:
            return
        self.block_hash[block_id] = block_hash
        self.cached[block_hash] = block_id

    def _evict(self, b: int) -> None:
        h = self.block_hash[b]
        if h is not None:
            if self.cached.get(h) == b:
                del self.cached[h]
            self.block_hash[b] = None

    def reset_prefix_cache(self) -> None:
        for b in list(self.free_queue):
            self._evict(b)

    def check_invariants(self, owners: Iterable[list[int]]) -> None:
        counts = [0] * self.num_blocks
        for blocks in owners:
            for b in blocks:
                counts[b] += 1
        assert counts[NULL_BLOCK] == 0 and self.ref_cnt[NULL_BLOCK] == 0, "null block owned"
        assert NULL_BLOCK not in self.free_queue and self.block_hash[NULL_BLOCK] is None, "null block free or cached"
        for b in range(1, self.num_blocks):
            assert counts[b] == self.ref_cnt[b], f"block {b}: ref_cnt {self.ref_cnt[b]} but {counts[b]} owners"
            assert (self.ref_cnt[b] == 0) == (b in self.free_queue), f"block {b}: free-queue membership wrong"
        for h, b in self.cached.items():
            assert self.block_hash[b] == h, f"hash map points at block {b} with another hash"
        assert len(self.free_queue) + sum(1 for c in self.ref_cnt if c > 0) == self.num_blocks - 1
