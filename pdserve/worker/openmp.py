"""OpenMP thread pools on CPU: GNU OpenMP (torch's libgomp) keeps one per thread that starts parallel regions.

With async scheduling the model runs on a worker thread, while the engine thread made a pool of its own at start-up
(loading, profiling, warm-up): two pools of N - 1 threads each on N cores. libgomp then counts more threads than
CPUs and stops spinning between parallel regions, so every region wakes its threads through the kernel: on this
project's 2-core machine a tiny-model decode step took 5.1 ms that way against 2.2 ms on one thread (a 64 x 256
matmul and silu: 97 us against 41). `release_thread_pool` frees the calling thread's pool (OpenMP 5.0's
omp_pause_resource_all, soft): the engine thread calls it when it hands the model to the worker thread, and from
then on runs no parallel region itself. A no-op without libgomp (another runtime, another OS).
"""
from __future__ import annotations

import ctypes
import logging

logger = logging.getLogger("pdserve.openmp")

_OMP_PAUSE_SOFT = 1


def release_thread_pool() -> bool:
    """Free the calling thread's OpenMP worker threads (made again if it starts a parallel region); True if done."""
    try:
        with open("/proc/self/maps") as maps:
            lib = next((line.split()[-1] for line in maps if "/libgomp" in line), None)
        if lib is None:
            return False
        return ctypes.CDLL(lib).omp_pause_resource_all(_OMP_PAUSE_SOFT) == 0
    except (OSError, AttributeError) as e:
        logger.info("could not release the OpenMP thread pool: %s", e)
        return False
