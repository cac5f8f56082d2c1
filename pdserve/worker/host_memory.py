"""Host memory reuse for CPU steps: glibc's allocator told to keep freed memory instead of handing it back.

A CPU prefill chunk allocates megabyte-sized intermediates per layer (a 128-token chunk of a 768-wide model: 3 MB
for the gate/up projection). glibc serves blocks that size with fresh mmaps, or trims the top of its heap after
the decode steps between two prefills, so each chunk's first touch of its intermediates page-faults and the kernel
zeroes the pages (~11,000 faults per request): on this project's machine a 128-token prefill of the small model
took 95.7 ms that way and 79.9 ms with freed memory kept (`benchmarks/host_memory.py`; vLLM's CPU guide has
tcmalloc preloaded for the same reason). The trade: a process's resident memory stays at its peak of intermediates
(bounded by the token budget), never returned to the system while it runs. Blocks above 32 MiB (the KV cache,
weights) still get their own maps.
`PDSERVE_KEEP_HOST_MEMORY=0` turns it off; it does nothing outside glibc.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import platform

logger = logging.getLogger("pdserve.host_memory")

# mallopt(3) parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
_SETTINGS = ((_M_MMAP_THRESHOLD, 32 << 20), (_M_TRIM_THRESHOLD, 1 << 30), (_M_TOP_PAD, 64 << 20))
_done = False


def keep_freed_host_memory() -> bool:
    """Once per process; True when glibc took the settings. Called by the CPU model runner."""
    global _done
    if _done:
        return True
    if os.environ.get("PDSERVE_KEEP_HOST_MEMORY", "1") == "0" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        ok = all(libc.mallopt(param, value) == 1 for param, value in _SETTINGS)
    except (OSError, AttributeError):
        ok = False
    if not ok:
        logger.info("glibc mallopt refused; host memory is returned to the system as usual")
        return False
    _done = True
    return True
