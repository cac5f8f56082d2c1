"""CPU steps keep freed host memory (glibc mallopt): a prefill chunk's megabyte-sized intermediates come back from
the heap instead of fresh, page-faulting memory. Each case runs in its own interpreter (the setting is process-wide).
"""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's allocator only")


PROBE = """
import ctypes, ctypes.util, json
from pdserve.worker.host_memory import keep_freed_host_memory
on = keep_freed_host_memory()
libc = ctypes.CDLL(ctypes.util.find_library("c"))
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                                               "uordblks", "fordblks", "keepcost")]
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
before = libc.mallinfo2().hblks
blocks = [libc.malloc(3 << 20) for _ in range(8)]  # a prefill chunk's intermediates: 8 x 3 MB
mapped = libc.mallinfo2().hblks - before
for b in blocks:
    libc.free(b)
print(json.dumps([on, mapped, libc.mallinfo2().fordblks]))
"""


def probe(keep: str) -> tuple[bool, int, int]:
    env = {**os.environ, "PDSERVE_KEEP_HOST_MEMORY": keep, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120,
                         check=True)
    on, mapped, kept = json.loads(out.stdout.strip().splitlines()[-1])
    return on, mapped, kept


def test_freed_intermediates_stay_in_the_heap():
    """Megabyte blocks come from the heap (not a fresh mmap each, zeroed by a page fault per page on first touch)
    and stay there once freed, for the next chunk; turned off, glibc maps them and hands them back."""
    on, mapped, kept = probe("1")
    assert on is True and mapped == 0 and kept >= 24 << 20, (mapped, kept)
    off, mapped, kept = probe("0")
    assert off is False and mapped == 8 and kept < 24 << 20, (mapped, kept)


def test_the_cpu_model_runner_turns_it_on(qwen3_tiny):
    code = (f"from pdserve import LLM\nimport pdserve.worker.host_memory as h\n"
            f"LLM({str(qwen3_tiny)!r}, max_model_len=64, num_gpu_blocks_override=8)\nprint(h._done)")
    for keep, want in (("1", "True"), ("0", "False")):
        env = {**os.environ, "PDSERVE_KEEP_HOST_MEMORY": keep, "OMP_NUM_THREADS": "1"}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                             check=True)
        assert out.stdout.strip().splitlines()[-1] == want
