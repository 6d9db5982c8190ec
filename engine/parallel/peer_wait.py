"""Rank 0's wait on a collective: in slices, asking between them whether every rank still lives.

gloo fails a collective at once when a peer's process exits (its sockets close). A peer that
its launcher reports gone while its process has not exited yet keeps its sockets open: a Ray
actor killed with `ray.kill` is dead in Ray's view (and to the executor's `find_dead`) before
its process ends, which on a loaded host has taken long enough for rank 0, blocked in an
all-reduce, to go silent past the frontend's --engine-timeout (a hung core, not a 503 naming
the worker). So rank 0 waits PEER_CHECK_S at a time and, between waits, runs the executor's
check, which raises WorkerDeadError. Workers wait plainly: they die with rank 0.

CPU (gloo) only: a timed wait on an NCCL work blocks the host and may abort the communicator.
"""

from __future__ import annotations

import datetime
from typing import Callable

PEER_CHECK_S = 1.0  # a collective faster than this costs nothing extra; a stalled one, a check a second
_PEER_CHECK = datetime.timedelta(seconds=PEER_CHECK_S)


def wait_for_peers(work, check_alive: Callable[[], None] | None) -> None:
    """Wait for `work` (a c10d Work); with `check_alive`, call it every PEER_CHECK_S until done."""
    if check_alive is None:
        work.wait()
        return
    while True:
        try:
            work.wait(_PEER_CHECK)
            return
        except RuntimeError:
            if work.is_completed():
                raise  # the collective itself failed (a peer's socket closed): not a timed-out slice
        check_alive()
