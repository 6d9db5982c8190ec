"""What engine processes check of themselves and of each other: at start, a process dies with
its parent, and its ranks' unauthenticated rendezvous stays on loopback unless allowed (the
engine core, engine/loop/core_process.py, and the ranks' workers, engine/executor/worker_process.py);
while steps run, rank 0 watches its workers on this host through /proc (`WatchedProcess`)."""

from __future__ import annotations

import ctypes
import os
import signal

from ipc.sockets import is_loopback_host


def die_with_parent() -> None:
    """Ask Linux to SIGTERM us when the parent dies (covers SIGKILL of the parent)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass  # not Linux: the parent-pid check in the loop still catches it


def check_master_addr(config, allow_remote: bool):
    """The ranks' store and step socket have no authentication: loopback unless --allow-remote."""
    if config.world_size > 1 and not allow_remote and not is_loopback_host(config.master_addr):
        raise ValueError(f"--master-addr {config.master_addr} is not loopback; the tensor-parallel rendezvous "
                         "has no authentication: pass --allow-remote to serve it on a trusted network")
    return config


def host_id() -> str:
    """Which host and pid namespace this process runs in: two processes with the same id see each
    other's pids in /proc (several Ray nodes may share an IP, containers may share a boot)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot_id = f.read().strip()
        return f"{boot_id}/{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return ""  # no /proc: no process of ours is watched through it


def _read_stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start time in clock ticks) from /proc/<pid>/stat; None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    except (FileNotFoundError, ProcessLookupError):
        return None
    return fields[0], int(fields[19])


class WatchedProcess:
    """A worker on this host, watched through /proc: whether it has exited or is stopped.

    A stopped process (SIGSTOP, state T) keeps its sockets open, so its peers' ops would wait
    for it until the group's timeout; only its state tells it from a slow one. A traced stop
    (state t: a debugger, py-spy's sampling) is not reported: it is a pause someone chose. The start
    time read at construction tells a reused pid from the worker."""

    def __init__(self, rank: int, pid: int) -> None:
        self.rank = rank
        self.pid = pid
        stat = _read_stat(pid)
        self.start_time = None if stat is None else stat[1]

    def find_gone(self) -> str | None:
        """Why the worker is gone ("exited", "stopped"), or None while it runs (or sleeps)."""
        stat = _read_stat(self.pid)
        if stat is None or stat[1] != self.start_time or stat[0] in ("Z", "X"):
            return f"tensor-parallel worker rank {self.rank} (pid {self.pid}) exited"
        if stat[0] == "T":
            return f"tensor-parallel worker rank {self.rank} (pid {self.pid}) is stopped (SIGSTOP): its peers cannot go on"
        return None
