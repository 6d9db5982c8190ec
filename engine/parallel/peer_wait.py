"""Rank 0's waits on the other ranks: as long as the step takes, asking every second whether they still live.

Rank 0 must tell a slow step (a stage still computing: wait on) from a lost peer (fail the
step, naming it). gloo fails an op at once when a peer's process exits (its sockets close);
a peer that is stopped (SIGSTOP), or that its launcher reports gone before its process has
exited (a Ray actor after `ray.kill`), keeps its sockets open, and rank 0 would wait for it
until the group's timeout, past the frontend's --engine-timeout (a hung core, not a 503
naming the worker). So rank 0 runs the executor's check every PEER_CHECK_S while it waits,
which raises WorkerDeadError (engine.executor.executor.check_workers). Workers wait
plainly: they die with rank 0.

How to wait without bounding the step depends on the op, because gloo's timed waits differ:

    collective (all-reduce, gather, broadcast: gloo's queued work)   wait_for_peers
        `work.wait(timeout)` that times out raises "Operation timed out!" and leaves the work
        pending: wait again. A work found completed after its wait raised either finished as the
        slice ran out or failed; a plain wait tells which (it returns, or raises the op's error).
    point-to-point (send, recv)                                        run_with_peers
        a timed-out `wait(timeout)` completes the work with an error ("Timed out waiting
        <timeout> for recv operation to complete") and closes the pair ("Application timeout
        caused pair closure"): the group is broken, a wait cannot be resumed. So the op
        waits untimed (to the group's own timeout) on a helper thread, and rank 0 waits
        for that thread in slices instead (c10d's `wait` releases the GIL).

Either way nothing here bounds a step: a stage may compute for as long as the group's timeout
(parallel_state.COLLECTIVE_TIMEOUT_S); the checks decide whether the peers live.
CPU (gloo) only: a timed wait on an NCCL work blocks the host and may abort the communicator.
"""

from __future__ import annotations

import datetime
import queue
import threading
from typing import Callable

PEER_CHECK_S = 1.0  # a wait shorter than this costs nothing extra; a longer one, a check a second


def wait_for_peers(work, check_alive: Callable[[], None] | None) -> None:
    """Wait for a collective's `work` (a c10d Work); with `check_alive`, call it every PEER_CHECK_S
    until done. Not for send/recv: a timed-out slice of those breaks the group (run_with_peers)."""
    if check_alive is None:
        work.wait()
        return
    slice_ = datetime.timedelta(seconds=PEER_CHECK_S)
    while True:
        try:
            work.wait(slice_)
            return
        except RuntimeError:
            if work.is_completed():
                # Done since: the slice ran out as the collective finished (then this returns), or
                # the collective itself failed, a peer's socket closed (then this raises its error).
                work.wait()
                return
        check_alive()


def run_with_peers(transfer: Callable[[], None], check_alive: Callable[[], None] | None) -> None:
    """Run `transfer` (point-to-point ops, each posted and waited untimed); with `check_alive`, on a
    helper thread while this one calls `check_alive` every PEER_CHECK_S until it is done.

    When the check raises, the helper stays blocked until the engine's shutdown kills the
    workers (their sockets close and its op fails); it is a daemon, and its error is dropped."""
    if check_alive is None:
        transfer()
        return
    try:
        inbox = _idle_helpers.get_nowait()
    except queue.Empty:
        inbox = _start_helper()
    outcome: list[BaseException | None] = []
    done = threading.Event()
    inbox.put((transfer, outcome, done))
    while not done.wait(PEER_CHECK_S):
        check_alive()
    if outcome[0] is not None:
        raise outcome[0]


# Idle helpers' inboxes. A helper is reused (starting a thread costs ~0.3 ms on a busy 2-core host,
# twice a PP step); one still blocked in a lost peer's transfer is not idle, so the next transfer
# (a fresh engine in the same process) gets a new one.
_idle_helpers: queue.SimpleQueue = queue.SimpleQueue()


def _start_helper() -> queue.SimpleQueue:
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    threading.Thread(target=_run_helper, args=(inbox,), name="peer-transfer", daemon=True).start()
    return inbox


def _run_helper(inbox: queue.SimpleQueue) -> None:
    while True:
        transfer, outcome, done = inbox.get()
        try:
            transfer()
            outcome.append(None)
        except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
            outcome.append(e)
        _idle_helpers.put(inbox)
        done.set()
