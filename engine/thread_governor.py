"""Fewer matmul threads while other processes want the CPUs the core's threads run on.

A CPU step is a few hundred OpenMP parallel regions (each linear, each layer's
attention), each ending at a barrier. When the machine has fewer free cores than the
core has threads, say a frontend tokenizing hostile prompts on a 2-core host, the
scheduler keeps taking one thread's core away, and every barrier then waits for that
thread's next time slice: steps of 20 ms take a second, and every stream stalls
(issue #30). One thread fewer has no barrier to wait at and keeps its core.

So the served core's loop asks `ThreadGovernor.update` before each step. Every
WINDOW_S it reads how much CPU time the rest of the machine used (all CPUs' busy
time from /proc/stat, less this process's own): when others used more than
HIGH_OTHER_CORES, it runs with the cores they leave free (at least one thread);
after HOLD_S with others below LOW_OTHER_CORES it gives the threads back. The
frontend's normal work (detokenizing, streaming) stays well below the high mark.
Two file reads per window, no cost per step. Off with --no-adaptive-threads.
"""

from __future__ import annotations

import logging
import math
import os
import resource
import time

logger = logging.getLogger(__name__)

WINDOW_S = 0.2  # one measurement; short enough to react within a stream's gap target (0.3 s)
HOLD_S = 2.0  # how long the machine must be quiet before the threads come back
HIGH_OTHER_CORES = 0.6  # others' CPU use (in cores) that takes threads away
LOW_OTHER_CORES = 0.3  # ... and below which, for HOLD_S, they come back
USER_HZ = os.sysconf("SC_CLK_TCK")


def machine_busy_s() -> float:
    """CPU seconds all CPUs spent busy since boot (the first line of /proc/stat)."""
    with open("/proc/stat", "rb") as f:
        fields = f.readline().split()[1:]
    user, nice, system, idle, iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    return (user + nice + system + irq + softirq + steal) / USER_HZ  # guest time is inside user


def own_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)  # every thread of this process
    return usage.ru_utime + usage.ru_stime


class ThreadGovernor:
    """Picks the intra-op thread count for the next step from what the rest of the machine uses."""

    def __init__(self, max_threads: int, set_num_threads, num_cpus: int | None = None,
                 read_machine=machine_busy_s, read_own=own_cpu_s, clock=time.monotonic) -> None:
        self.max_threads = max_threads
        self.num_cpus = num_cpus or os.cpu_count() or 1
        self.set_num_threads = set_num_threads
        self.read_machine, self.read_own, self.clock = read_machine, read_own, clock
        self.num_threads = max_threads
        self.num_changes = 0
        self.other_cores = 0.0  # the last window's reading
        self._start = self._sample()
        self._quiet_since: float | None = None

    def _sample(self) -> tuple[float, float, float]:
        return self.clock(), self.read_machine(), self.read_own()

    def update(self) -> int:
        """The thread count to step with; changes torch's when the reading says so."""
        now = self.clock()
        elapsed = now - self._start[0]
        if elapsed < WINDOW_S:
            return self.num_threads
        sample = (now, self.read_machine(), self.read_own())
        if elapsed > 10 * WINDOW_S:
            self._start = sample  # the core was idle: a window this long says nothing about now
            return self.num_threads
        _, machine_before, own_before = self._start
        self._start = sample
        self.other_cores = max(0.0, (sample[1] - machine_before) - (sample[2] - own_before)) / elapsed
        if self.other_cores > HIGH_OTHER_CORES:
            self._quiet_since = None
            free = self.num_cpus - math.ceil(self.other_cores - 0.25)  # a core 3/4 used by others is theirs
            self._set(max(1, min(self.max_threads, free)))
        elif self.other_cores < LOW_OTHER_CORES and self.num_threads < self.max_threads:
            if self._quiet_since is None:
                self._quiet_since = now
            elif now - self._quiet_since >= HOLD_S:
                self._set(self.max_threads)
        return self.num_threads

    def _set(self, num_threads: int) -> None:
        if num_threads == self.num_threads:
            return
        logger.info("%d intra-op threads (others use %.1f of %d CPUs)", num_threads, self.other_cores, self.num_cpus)
        self.set_num_threads(num_threads)
        self.num_threads = num_threads
        self.num_changes += 1
        if num_threads == self.max_threads:
            self._quiet_since = None
