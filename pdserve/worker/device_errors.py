"""Which errors leave the device unusable for the rest of the process: a CUDA context that hit an illegal address or
a device-side assert is "sticky", so every later kernel launch, copy and synchronize fails the same way. An engine
that failed only the step's requests and went on would answer every request with a 500 while /health said 200 (a
zombie no router or supervisor reacts to); the engine instead declares itself dead on these (step_pipeline.py).

Out of memory is never one: it fails one step, and the next may fit.
"""
from __future__ import annotations

from typing import Optional

import torch

# Substrings of the messages CUDA (and ROCm's HIP, cuBLAS, NCCL) errors carry through torch. "CUDA error" is every
# cudaError_t torch raises (`CUDA error: an illegal memory access was encountered`, `CUDA error: device-side assert
# triggered`, `CUDA error: unspecified launch failure`, ...); the others name the sticky ones where another layer
# words them.
MARKERS = ("CUDA error", "illegal memory access", "device-side assert", "unspecified launch failure",
           "illegal instruction", "misaligned address", "uncorrectable ECC error", "HIP error",
           "CUBLAS_STATUS_EXECUTION_FAILED", "NCCL error", "CUDA driver error")
_OOM = ("out of memory",)
# torch >= 2.8 raises device errors as torch.AcceleratorError (a RuntimeError); older ones as a plain RuntimeError
_ACCELERATOR_ERROR = getattr(torch, "AcceleratorError", None)


def device_unusable(e: BaseException) -> Optional[str]:
    """Why `e` (or an exception it was raised from) means the device can run nothing more; None when it does not."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        msg = str(e)
        oom = isinstance(e, torch.OutOfMemoryError) or any(m in msg for m in _OOM)
        if not oom and ((_ACCELERATOR_ERROR is not None and isinstance(e, _ACCELERATOR_ERROR))
                        or any(m in msg for m in MARKERS)):
            first = (msg.strip().splitlines() or [""])[0][:300]
            return f"{type(e).__name__}: {first}"
        e = e.__cause__ or e.__context__
    return None
