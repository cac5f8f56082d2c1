"""worker/openmp.py: the calling thread's OpenMP worker threads are freed (async scheduling's engine thread)."""
from __future__ import annotations

import os
import time

import pytest
import torch

from pdserve.worker.openmp import release_thread_pool


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.mark.skipif(not os.path.exists("/proc/self/maps") or torch.get_num_threads() < 2,
                    reason="Linux, two or more threads")
def test_release_thread_pool_frees_the_calling_threads_workers():
    x = torch.randn(512, 512)
    (x @ x).sum()  # a parallel region: this thread has its pool
    before = _threads()
    if not release_thread_pool():
        pytest.skip("no libgomp in this process")
    deadline = time.monotonic() + 5
    while _threads() > before - (torch.get_num_threads() - 1) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _threads() <= before - (torch.get_num_threads() - 1)  # (other threads may end meanwhile, none start)
    assert torch.equal(x @ x, x @ x)  # the next parallel region makes the pool again
