"""Per-request block tables on top of the BlockPool: prefix-cache lookup, slot allocation, publishing full blocks."""
from __future__ import annotations

import numpy as np

from pdserve.core.block_pool import BlockPool, hash_block
from pdserve.request import Request
from pdserve.sched_output import cdiv


_NO_BLOCKS = np.zeros(0, np.int64)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_blocks: dict[str, list[int]] = {}
        self._num_published: dict[str, int] = {}  # leading blocks of a request already in the prefix cache
        # Each request's block ids as an int64 array with room to grow, synced with req_blocks (which only grows
        # until freed) by appending what was added since: the model runner copies rows into its block table from
        # these every step, a memcpy instead of converting a Python list that grows with the context.
        self._tables: dict[str, list] = {}  # request id -> [array, ids filled]

    def blocks_of(self, request_id: str) -> list[int]:
        return self.req_blocks.get(request_id, [])

    def block_table(self, request_id: str) -> np.ndarray:
        blocks = self.req_blocks.get(request_id)
        if not blocks:
            return _NO_BLOCKS
        entry = self._tables.get(request_id)
        n = len(blocks)
        if entry is None:
            entry = self._tables[request_id] = [np.empty(max(16, 2 * n), np.int64), 0]
        elif len(entry[0]) < n:
            entry[0] = np.concatenate([entry[0][:entry[1]], np.empty(2 * n - entry[1], np.int64)])
        arr, filled = entry
        if filled < n:
            arr[filled:n] = blocks[filled:n]
            entry[1] = n
        return arr[:n]

    def _update_hashes(self, req: Request) -> None:
        bs, hashes = self.block_size, req.block_hashes
        for i in range(len(hashes), req.num_tokens // bs):
            hashes.append(hash_block(hashes[-1] if hashes else req.hash_seed, req.all_token_ids[i * bs:(i + 1) * bs]))

    def get_computed_blocks(self, req: Request) -> tuple[list[int], int]:
        """Longest cached prefix of full blocks. It never covers the last token: that token's logits are needed.
        A request asking for prompt logprobs takes no hit (as vLLM's): every prompt position must be computed."""
        if not self.pool.enable_caching:
            return [], 0
        self._update_hashes(req)
        if req.sampling_params.prompt_logprobs is not None:
            return [], 0
        hits = []
        for h in req.block_hashes[: (req.num_tokens - 1) // self.block_size]:
            b = self.pool.lookup(h)
            if b is None:
                break
            hits.append(b)
        return hits, len(hits) * self.block_size

    def allocate_slots(self, req: Request, num_new_tokens: int, computed_blocks: list[int] = ()) -> bool:
        """Make room for `num_new_tokens` after the request's computed tokens (plus any cache hits given).
        All or nothing: on False nothing changed."""
        blocks = self.req_blocks.setdefault(req.request_id, [])
        num_computed = req.num_computed_tokens + len(computed_blocks) * self.block_size
        need = cdiv(num_computed + num_new_tokens, self.block_size) - len(blocks) - len(computed_blocks)
        # Hits waiting in the free queue leave it when touched, so they count against the free blocks too.
        evictable_hits = sum(1 for b in computed_blocks if self.pool.ref_cnt[b] == 0)
        if need > self.pool.num_free_blocks - evictable_hits:
            if not blocks:
                del self.req_blocks[req.request_id]
            return False
        self.pool.touch(computed_blocks)
        blocks.extend(computed_blocks)
        if computed_blocks:
            self._num_published[req.request_id] = len(blocks)
        if need > 0:
            blocks.extend(self.pool.allocate(need))
        return True

    def cache_blocks(self, req: Request) -> None:
        """Publish the request's blocks that are full and whose tokens are all computed."""
        if not self.pool.enable_caching:
            return
        full = req.num_computed_tokens // self.block_size
        start = self._num_published.get(req.request_id, 0)
        if full <= start:
            return
        self._update_hashes(req)
        blocks = self.req_blocks[req.request_id]
        for i in range(start, min(full, len(req.block_hashes))):
            self.pool.cache_block(blocks[i], req.block_hashes[i])
        self._num_published[req.request_id] = full

    def free(self, req: Request) -> None:
        self._tables.pop(req.request_id, None)
        blocks = self.req_blocks.pop(req.request_id, [])
        self._num_published.pop(req.request_id, None)
        self.pool.free(reversed(blocks))

    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def check_invariants(self) -> None:
        self.pool.check_invariants(self.req_blocks.values())
