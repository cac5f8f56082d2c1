"""Host -> device copies of the input staging buffers, fenced: a host buffer is never rewritten before its copy ran.

`prepare()` fills pinned host arrays and copies them with `non_blocking=True`; each copy runs when the stream gets
to it. Nothing else orders the next `prepare()` after it: the sampler's read-back is the only host sync, and a step
with no sampled row has none (two prefill-only steps on P, the `prefill_kv` loop, back-to-back imports). Unfenced,
one step's token ids and slot mapping could come from the next, and KV would land in another request's blocks.
So every set of copies records an event, and the next fill of the host arrays waits for it.
"""
from __future__ import annotations

import torch


class CudaStaging:
    def __init__(self):
        self._event = None
        self.pending = False

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=True)

    def record(self) -> None:
        if self._event is None:
            self._event = torch.cuda.Event()
        self._event.record()
        self.pending = True

    def wait(self) -> None:
        """Block until the copies recorded last have run (no-op when none is pending)."""
        if self.pending:
            self._event.synchronize()
            self.pending = False
