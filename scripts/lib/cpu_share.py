"""The CPU the rest of the host spends while a benchmark's server runs a request.

A run where it is high (another job on the machine, or an idle server that is not idle) is
suspect: llama.cpp's threads spin at barriers, so a rival process on one of two cores can slow
it several-fold. scripts/bench/single_user.py records it per request.
"""

from __future__ import annotations

import os
from pathlib import Path

from scripts.lib.bench_report import host_cpu_ticks

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")  # /proc's unit of CPU time


def host_busy_ticks() -> int:
    """All cores' non-idle time since boot, in clock ticks (the first line of /proc/stat)."""
    ticks = host_cpu_ticks()
    return sum(ticks) - ticks[3] - ticks[4]  # less idle and iowait


def process_tree_ticks(root_pid: int) -> int:
    """User + system ticks of `root_pid` and its descendants (our server's engine cores)."""
    parents, ticks = {}, {}
    for stat_path in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat_path.read_text()
        except OSError:
            continue  # exited meanwhile
        fields = text.rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
        pid = int(stat_path.parent.name)
        parents[pid], ticks[pid] = int(fields[1]), int(fields[11]) + int(fields[12])
    tree, total = {root_pid}, 0
    for pid in sorted(parents):  # children have larger pids, except after pid wrap-around
        if pid in tree or parents[pid] in tree:
            tree.add(pid)
            total += ticks[pid]
    return total


def cpu_snapshot(server_pid: int) -> tuple[float, float, float]:
    """CPU seconds so far: the host's, the server's process tree's and this process's own
    (not its children: the other servers are, and their CPU is what we look for)."""
    own = os.times()
    return (host_busy_ticks() / CLOCK_TICKS, process_tree_ticks(server_pid) / CLOCK_TICKS, own.user + own.system)


def other_cpu_share(before: tuple[float, float, float], after: tuple[float, float, float], wall_s: float) -> float:
    """Busy CPU not spent by the server or this client, as a share of all cores over `wall_s`."""
    host, server, client = (b - a for a, b in zip(before, after))
    return max(0.0, host - server - client) / (wall_s * (os.cpu_count() or 1))
