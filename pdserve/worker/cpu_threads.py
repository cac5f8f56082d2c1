"""How many intra-op threads a CPU engine runs, step by step: all it was given while the cores are its own, one while
other processes want them.

Why: torch's CPU build runs its parallel regions on GNU OpenMP, whose threads spin between regions. A decode step
of a small model is hundreds of short regions, each ending in a barrier; when other busy processes share the cores,
the barrier waits for a thread the kernel has descheduled and every region costs a time slice. Measured on the two
cores here (tiny model, 8 rows, benchmarks/shared_cores.py): 3.8 ms a step alone, 115 ms beside two other
engines, 10.6 ms with one thread. One thread costs a fifth (tiny) to a half (small model) of the step when the
cores are free, so the engine keeps its threads then and gives them up only while the cores are contended.
vLLM's CPU worker instead keeps one core free for its engine-core process at all times.

A small step runs on one thread even when the cores are free (`SmallSteps`): a one-row decode of the tiny model is
~300 regions of microseconds each, as fast on one thread as on two, and on two each region's barrier also waits
out whatever the server and the client run beside it per streamed token (a single stream here: p99 ITL ~7 ms on
two threads, ~4 on one). Its gate is the step's work, tokens x the model's parameters: the small model's one-row
step is 1.3x faster on two threads and keeps them.

`CpuThreads.poll()` is called between steps; once per `interval` it reads the whole machine's busy time
(/proc/stat), subtracts its own process's (and the server process's, which shares its work) and so learns what the
rest of the machine used. Set OMP_NUM_THREADS to fix the count (or PDSERVE_ADAPTIVE_THREADS=0 to keep torch's),
and this is off: a GEMM's float32 rounding can change with its thread count, so runs that must repeat bit for bit
(tests comparing two runs) fix it. `SmallSteps` stays on under a fixed count: it picks one thread by the step's
tokens alone, so such a run still repeats.
"""
from __future__ import annotations

import logging
import os
import time
from contextlib import contextmanager
from typing import Callable, Optional

import torch

logger = logging.getLogger("pdserve.worker")

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def machine_busy_seconds(path: str = "/proc/stat") -> Optional[float]:
    """CPU seconds all cores spent busy since boot (user, nice, system, irq, softirq, steal), or None off Linux."""
    try:
        with open(path) as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[1:9])
    return (user + nice + system + irq + softirq + steal) / _TICK


def process_cpu_seconds(pid: Optional[int] = None) -> float:
    """CPU seconds of a process (all its threads): this one, or `pid` from /proc (0.0 if it is gone)."""
    if pid is None:
        t = os.times()
        return t.user + t.system
    try:
        with open(f"/proc/{pid}/stat") as f:
            rest = f.read().rsplit(")", 1)[1].split()
        return (int(rest[11]) + int(rest[12])) / _TICK  # utime, stime: fields 14 and 15
    except (OSError, IndexError, ValueError):
        return 0.0


class CpuThreads:
    """Chooses the intra-op thread count between 1 and `max_threads` from what other processes use.

    `others` (cores' worth the rest of the machine used over the last interval) more than `high` over what our
    threads leave free means a thread of ours would be descheduled inside a barrier: drop to what the free cores hold
    (at least 1). Up one thread a reading, and only while one more would overlap the others by less than `low`, so
    a load near the line does not flap it.

    `crowded` says other processes hold about half the machine or more (on above `cores / 2 + band` cores, off
    below `cores / 2 - band`): the server's engine then overlaps its steps (async scheduling, `LLMEngine.
    want_async_scheduling`), which a quiet machine measured slower and a crowded one faster (docs/cpu-notes.md)."""

    def __init__(self, max_threads: int, interval: float = 0.5, partner_pid: Optional[int] = None,
                 high: float = 0.3, low: float = 0.15, band: float = 0.25,
                 set_threads: Callable[[int], None] = torch.set_num_threads,
                 clock: Callable[[], float] = time.monotonic,
                 busy: Callable[[], Optional[float]] = machine_busy_seconds,
                 own: Callable[[Optional[int]], float] = process_cpu_seconds):
        self.max_threads = max_threads
        self.threads = max_threads
        self.interval, self.high, self.low, self.band = interval, high, low, band
        self.partner_pid = partner_pid
        self._set, self._clock, self._busy, self._own = set_threads, clock, busy, own
        self.cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        self.others = 0.0  # last reading, in cores
        self.crowded = False  # others hold half the cores or more (with `band` either way against flapping)
        self.switches = 0
        self._last = self._sample()

    def _sample(self) -> Optional[tuple[float, float, float]]:
        busy = self._busy()
        if busy is None:
            return None
        mine = self._own(None) + (self._own(self.partner_pid) if self.partner_pid else 0.0)
        return self._clock(), busy, mine

    def poll(self) -> int:
        """Re-reads the machine at most once an interval; returns the thread count in force."""
        if self._last is None or self.max_threads <= 1 or self._clock() - self._last[0] < self.interval:
            return self.threads
        now = self._sample()
        (t0, busy0, mine0), (t1, busy1, mine1) = self._last, now
        self._last = now
        self.others = max(0.0, (busy1 - busy0) - (mine1 - mine0)) / max(t1 - t0, 1e-9)
        half = self.cores / 2
        self.crowded = self.others > half - self.band if self.crowded else self.others > half + self.band
        free = self.cores - self.others
        want = self.threads
        if self.threads > 1 and self.others > self.cores - self.threads + self.high:
            want = max(1, min(self.max_threads, int(free + self.low)))
        elif self.threads < self.max_threads and self.others < self.cores - self.threads - 1 + self.low:
            want = min(self.max_threads, self.threads + 1)
        if want != self.threads:
            logger.info("CPU threads %d -> %d: other processes used %.2f of %d cores", self.threads, want,
                        self.others, self.cores)
            self._set(want)
            self.threads = want
            self.switches += 1
        return self.threads


def adaptive_threads(device_type: str, partner_pid: Optional[int] = None,
                     set_threads: Callable[[int], None] = torch.set_num_threads) -> Optional[CpuThreads]:
    """The governor for an engine on `device_type`, or None where the count stays as it is: a GPU engine, one
    thread, OMP_NUM_THREADS set (the user chose), PDSERVE_ADAPTIVE_THREADS=0, or no /proc/stat to read.
    `set_threads` must set the count on the thread that runs the model: OpenMP's count is per thread
    (`LLMEngine.set_num_threads`)."""
    if device_type != "cpu" or os.environ.get("OMP_NUM_THREADS") or torch.get_num_threads() <= 1 or \
            os.environ.get("PDSERVE_ADAPTIVE_THREADS", "1") == "0" or machine_busy_seconds() is None:
        return None
    return CpuThreads(torch.get_num_threads(), partner_pid=partner_pid, set_threads=set_threads)


# A step whose tokens x model parameters is below this runs on one thread: the tiny model's (4.5M parameters) decode
# steps of up to 3 rows, no step of the small model's (116M). Chosen from step times on one and two threads, quiet
# and in process on the 2-core machine (the tiny model ties at 1-2 rows, two threads win from 8 rows and on the
# small model's one-row step); benchmarks/small_steps.py measures what it does served.
SMALL_STEP_WORK = 16e6


class SmallSteps:
    """One thread for the steps of less than SMALL_STEP_WORK tokens x parameters, the count in force for the rest.
    On in every CPU engine a server runs, the count set by the governor (`adaptive_threads`) or pinned by
    OMP_NUM_THREADS (a cap the rule stays under); PDSERVE_SMALL_STEP_THREADS=0 turns it off."""

    def __init__(self, params: int, work: float = SMALL_STEP_WORK):
        self.params, self.work = params, work

    def small(self, num_tokens: int) -> bool:
        return num_tokens * self.params < self.work

    @staticmethod
    @contextmanager
    def one_thread():
        """Run the block on one OpenMP thread of the calling thread, then give the count back (set it per step,
        never per op: the first region after raising it wakes the other threads, ~40 us)."""
        n = torch.get_num_threads()
        if n <= 1:
            yield
            return
        torch.set_num_threads(1)
        try:
            yield
        finally:
            torch.set_num_threads(n)


def small_steps(params: int) -> Optional[SmallSteps]:
    """The small-step rule for a model of `params` parameters, unless PDSERVE_SMALL_STEP_THREADS=0."""
    return None if os.environ.get("PDSERVE_SMALL_STEP_THREADS", "1") == "0" else SmallSteps(params)
