"""Fewer matmul threads while other processes take the cores the core's threads run on.

A CPU step is a few hundred OpenMP parallel regions (each linear, each layer's
attention), each ending at a barrier. When long-running work elsewhere (a frontend
tokenizing hostile prompts on a 2-core host, say) keeps taking one thread's core, every
barrier waits for that thread's next time slice: a step then takes tens of times as long, and
every stream stalls (issue #30). One thread fewer has no barrier to wait at and keeps
its core.

So the served core's loop asks `ThreadGovernor.update` before each step. Every
WINDOW_S it reads two things: how busy our threads were (this process's CPU time over
the window, per thread) and how much CPU the rest of the machine used (all CPUs' busy
time in /proc/stat, less ours). Threads go only when both say so: ours were stalled
(below STALLED_SHARE busy) while others used more than HIGH_OTHER_CORES. A frontend's
normal work, short and once per step, takes as much CPU in a burst of streams but
leaves our threads busy, so it never costs a thread. They come back once others stay below
LOW_OTHER_CORES for a hold: MIN_HOLD_S at first, since a burst (64 requests arriving, their
prompts tokenized at once) passes within it, and a fixed 2 s hold cost such a round 8-11 steps
on one thread, 1.16x its time (issue #58); doubled, up to MAX_HOLD_S, each time the threads
must go again soon after they came back, so intermittent abuse is not met with a stall every
return. Processes at a higher nice value than ours yield their core to our threads and are not
counted as others (a niced build beside a served core would otherwise hold one thread forever),
unless the kernel's autogroup shares the CPU by session first: then nice yields nothing across
sessions, and they count. While every request waits for its grammar's compile the
core steps nothing and its threads sit idle by design: the loop calls `restart`, not
`update`, so that wait (beside the frontend's checker compiling the same grammar) never
reads as a stall (issue #58: it cost the whole constrained round a thread, 1.4x); nor does a
core with no requests at all (`idle`): the first step after it starts a new window. Two file
reads per window, nothing per step. Off with --no-adaptive-threads.
"""

from __future__ import annotations

import logging
import math
import os
import resource
import time

logger = logging.getLogger(__name__)

WINDOW_S = 0.2  # one measurement; short enough to react within a stream's gap target (0.3 s)
MIN_HOLD_S = 0.4  # how long the machine must be quiet before the threads come back, at first
MAX_HOLD_S = 3.2  # ... and at most, after threads were taken again and again
FLAP_S = 5.0  # threads taken again within this of their return: the hold doubles
HIGH_OTHER_CORES = 0.7  # others' CPU use (in cores) that, with our threads stalled, takes threads away
LOW_OTHER_CORES = 0.3  # ... and below which, for the hold, they come back
# Our CPU time over (window x threads) below this: our threads waited for a core. They spin at
# the pool's barriers, so a rival taking X cores of 2 leaves them busy about 1 - X / 2: at 0.6 it
# had to take 0.8 of a core, and one at 0.7-0.75 ran five steps at 2-3x their time first (issue #58).
STALLED_SHARE = 0.7
USER_HZ = os.sysconf("SC_CLK_TCK")


def is_autogroup_on() -> bool:
    """Whether the scheduler shares the CPU between sessions first (sched_autogroup): then a niced
    process of another session takes its session's full share, and nice gives way only inside one."""
    try:
        with open("/proc/sys/kernel/sched_autogroup_enabled", "rb") as f:
            return f.read().strip() == b"1"
    except OSError:
        return False


def niced_work_competes() -> bool:
    """Whether niced processes take CPU from our threads: when we are niced ourselves, or autogroup
    shares the CPU by session. Otherwise, at nice 0, they give way to our threads."""
    return os.getpriority(os.PRIO_PROCESS, 0) > 0 or is_autogroup_on()


def machine_busy_s(count_niced: bool | None = None) -> float:
    """CPU seconds all CPUs spent busy since boot (the first line of /proc/stat); niced processes'
    user time only where it competes (`niced_work_competes`) unless `count_niced` says."""
    if count_niced is None:
        count_niced = niced_work_competes()
    with open("/proc/stat", "rb") as f:
        fields = f.readline().split()[1:]
    user, nice, system, idle, iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    busy = user + system + irq + softirq + steal + (nice if count_niced else 0)  # guest time is inside user
    return busy / USER_HZ


def own_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)  # every thread of this process
    return usage.ru_utime + usage.ru_stime


class ThreadGovernor:
    """Picks the intra-op thread count for the next step from how busy our threads were and others are."""

    def __init__(self, max_threads: int, set_num_threads, num_cpus: int | None = None,
                 read_machine=machine_busy_s, read_own=own_cpu_s, clock=time.monotonic) -> None:
        self.max_threads = max_threads
        self.num_cpus = num_cpus or os.cpu_count() or 1
        self.set_num_threads = set_num_threads
        self.read_machine, self.read_own, self.clock = read_machine, read_own, clock
        self.num_threads = max_threads
        self.num_changes = 0
        self.other_cores = 0.0  # the last window's readings
        self.busy_share = 1.0
        self._start = self._sample()
        self._quiet_since: float | None = None
        self.hold_s = MIN_HOLD_S
        self._returned_at: float | None = None  # when the threads last came back
        self._was_idle = False

    def _sample(self) -> tuple[float, float, float]:
        return self.clock(), self.read_machine(), self.read_own()

    def restart(self) -> None:
        """Start a new window now, the time since the last one unread: the core stepped nothing
        with its threads (every request waited for its grammar's compile, which runs on a thread
        of its own), so our threads' idle time then was not a stall (issue #58)."""
        self._start = self._sample()

    def idle(self) -> None:
        """The core has nothing to step: the next update starts a new window rather than read this
        one. Our threads' idle time is not a stall, and a rival that ran meanwhile (a benchmark's
        memory probe between its requests, say) and stopped says nothing about the next steps.
        Reading a gap shorter than the long-idle cutoff cost the next request a thread for up to
        MAX_HOLD_S. No reads here: the idle loop calls it on every look."""
        self._was_idle = True

    def update(self) -> int:
        """The thread count to step with; changes torch's when the reading says so."""
        if self._was_idle:
            self._was_idle = False
            self.restart()
            return self.num_threads
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
        own = sample[2] - own_before
        self.other_cores = max(0.0, (sample[1] - machine_before) - own) / elapsed
        self.busy_share = own / (elapsed * self.num_threads)
        if self.other_cores > HIGH_OTHER_CORES and self.busy_share < STALLED_SHARE and self.num_threads > 1:
            self._quiet_since = None
            free = self.num_cpus - math.ceil(self.other_cores - 0.25)  # a core 3/4 used by others is theirs
            free = max(1, min(self.max_threads, free))
            if free < self.num_threads:
                flapping = self._returned_at is not None and now - self._returned_at < FLAP_S
                self.hold_s = min(MAX_HOLD_S, 2 * self.hold_s) if flapping else MIN_HOLD_S
            self._set(free)
        elif self.other_cores >= LOW_OTHER_CORES:
            self._quiet_since = None  # quiet means quiet for the whole hold
        elif self.num_threads < self.max_threads:
            if self._quiet_since is None:
                self._quiet_since = now
            elif now - self._quiet_since >= self.hold_s:
                self._set(self.max_threads)
                self._returned_at = now
        return self.num_threads

    def _set(self, num_threads: int) -> None:
        if num_threads == self.num_threads:
            return
        logger.info("%d intra-op threads (others use %.1f of %d CPUs; ours were %.0f%% busy)", num_threads,
                    self.other_cores, self.num_cpus, 100 * self.busy_share)
        self.set_num_threads(num_threads)
        self.num_threads = num_threads
        self.num_changes += 1
        if num_threads == self.max_threads:
            self._quiet_since = None
