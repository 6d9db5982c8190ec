"""engine.thread_governor: the served core steps with fewer threads while others use the cores.

The decision rule runs on a scripted clock and scripted CPU readings; the readings
themselves (/proc/stat, getrusage) and the whole loop run for real against processes
that burn a core.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

from engine.thread_governor import HOLD_S, WINDOW_S, ThreadGovernor, machine_busy_s, own_cpu_s


class Readings:
    """A clock and CPU counters that a test moves by hand: `others` cores busy besides us."""

    def __init__(self) -> None:
        self.now = 0.0
        self.machine = 0.0
        self.own = 0.0

    def advance(self, seconds: float, others: float, own: float = 1.0) -> None:
        self.now += seconds
        self.machine += seconds * (others + own)
        self.own += seconds * own


def make_governor(readings: Readings, max_threads: int = 2, num_cpus: int = 2):
    calls: list[int] = []
    governor = ThreadGovernor(max_threads, calls.append, num_cpus=num_cpus, read_machine=lambda: readings.machine,
                              read_own=lambda: readings.own, clock=lambda: readings.now)
    return governor, calls


def run_windows(governor, readings: Readings, seconds: float, others: float) -> int:
    for _ in range(round(seconds / WINDOW_S)):
        readings.advance(WINDOW_S * 1.001, others)  # a step ends a little after the window
        governor.update()
    return governor.num_threads


def test_threads_go_while_others_use_a_core_and_come_back_after_a_quiet_hold():
    readings = Readings()
    governor, calls = make_governor(readings)
    assert run_windows(governor, readings, 1.0, others=0.2) == 2  # a frontend streaming: left alone
    assert calls == []
    assert run_windows(governor, readings, WINDOW_S, others=1.0) == 1  # one window of abuse is enough
    assert calls == [1]
    assert run_windows(governor, readings, HOLD_S - 2 * WINDOW_S, others=0.1) == 1  # quiet, but not for long
    assert run_windows(governor, readings, 3 * WINDOW_S, others=0.1) == 2
    assert calls == [1, 2] and governor.num_changes == 2


def test_middling_use_changes_nothing_either_way():
    readings = Readings()
    governor, calls = make_governor(readings)
    assert run_windows(governor, readings, 2.0, others=0.45) == 2  # between the marks: no flapping
    run_windows(governor, readings, WINDOW_S, others=0.9)
    assert run_windows(governor, readings, 2 * HOLD_S, others=0.45) == 1  # and no return while it lasts
    assert calls == [1]


def test_the_count_left_is_what_others_leave_free_and_at_least_one():
    readings = Readings()
    governor, calls = make_governor(readings, max_threads=8, num_cpus=8)
    assert run_windows(governor, readings, WINDOW_S, others=2.9) == 5  # 3 cores mostly theirs
    assert run_windows(governor, readings, WINDOW_S, others=20.0) == 1
    assert calls == [5, 1]


def test_an_idle_gap_starts_a_new_window():
    readings = Readings()
    governor, calls = make_governor(readings)
    readings.advance(60.0, others=2.0, own=0.0)  # the core sat idle while others worked
    assert governor.update() == 2 and calls == []
    assert run_windows(governor, readings, WINDOW_S, others=0.1) == 2


def test_the_readings_count_real_cpu_time():
    machine_before, own_before = machine_busy_s(), own_cpu_s()
    deadline = time.process_time() + 0.3
    while time.process_time() < deadline:
        pass
    assert own_cpu_s() - own_before >= 0.3
    assert machine_busy_s() - machine_before >= 0.25  # /proc/stat counts in ticks of 10 ms


BURN = "import time\nend = time.monotonic() + 30\nwhile time.monotonic() < end: pass\n"


def test_the_governor_sees_real_processes_take_the_cores():
    num_cpus = os.cpu_count() or 1
    calls: list[int] = []
    governor = ThreadGovernor(2, calls.append, num_cpus=num_cpus)
    burners = [subprocess.Popen([sys.executable, "-c", BURN]) for _ in range(max(1, num_cpus - 1))]
    try:
        deadline = time.monotonic() + 5
        while governor.num_threads == 2 and time.monotonic() < deadline:
            time.sleep(WINDOW_S / 4)
            governor.update()
        assert governor.num_threads == 1, governor.other_cores  # all but one core are the burners'
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()
    deadline = time.monotonic() + HOLD_S + 5
    while governor.num_threads == 1 and time.monotonic() < deadline:
        time.sleep(WINDOW_S / 4)
        governor.update()
    assert governor.num_threads == 2, governor.other_cores
    assert calls == [1, 2]
