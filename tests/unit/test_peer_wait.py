"""Rank 0's waits on its peers (engine.parallel.peer_wait) on a real gloo group of two processes:
every op it waits on (all-reduce, gather, broadcast, send, recv) survives a peer slower than
several liveness checks, a failing check ends the wait; how rank 0 watches a worker on its host
(process_checks.WatchedProcess); and the slow-stage test hook's setting (engine.executor.worker_process).

The peer sleeps DELAY_S before each op, five times the check interval set here, so the checks run
between slices whatever this machine's speed (a slower machine only makes the slices longer).
"""

from __future__ import annotations

import datetime
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist

from engine.parallel import peer_wait
from engine.parallel.peer_wait import run_with_peers, wait_for_peers
from engine.executor.process_checks import WatchedProcess
from engine.executor.worker_process import STAGE_DELAY_ENV, stage_delay_s
from tests.helpers.server import wait_for

CHECK_S = 0.2
DELAY_S = 1.0
TIMEOUT = datetime.timedelta(seconds=60)
PEER = r"""
import datetime, sys, time
import torch, torch.distributed as dist
port, delay = int(sys.argv[1]), float(sys.argv[2])
timeout = datetime.timedelta(seconds=60)
group = dist.ProcessGroupGloo(dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=timeout), 1, 2, timeout)
x = torch.full((4,), 2.0)
time.sleep(delay); group.allreduce([x]).wait()                                      # x: 3
options = dist.GatherOptions(); options.rootRank = 0
time.sleep(delay); group.gather([], [x], options).wait()
time.sleep(delay); group.broadcast([x], dist.BroadcastOptions()).wait()             # x: rank 0's 7
time.sleep(delay); group.recv([x], 0, 0).wait()                                     # x: rank 0's 5
time.sleep(delay); group.send([x * 10], 0, 0).wait()
time.sleep(delay); group.send([x], 0, 0).wait()                                     # after rank 0 gave up
"""


class PeerLost(Exception):
    pass


def test_every_op_waits_out_a_slow_peer_and_a_failing_check_ends_the_wait(monkeypatch):
    monkeypatch.setattr(peer_wait, "PEER_CHECK_S", CHECK_S)
    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, timeout=TIMEOUT, wait_for_workers=False)
    peer = subprocess.Popen([sys.executable, "-c", PEER, str(store.port), str(DELAY_S)])
    try:
        group = dist.ProcessGroupGloo(store, 0, 2, TIMEOUT)
        checks = []

        def check_alive() -> None:
            checks.append(time.monotonic())

        def waited(op: str, wait) -> None:
            num_checks = len(checks)
            wait()
            print(f"{op}: {len(checks) - num_checks} checks")
            assert len(checks) > num_checks, f"{op} returned before the peer took part"

        num_helpers = sum(thread.name == "peer-transfer" for thread in threading.enumerate())
        x = torch.ones(4)
        waited("all-reduce", lambda: wait_for_peers(group.allreduce([x]), check_alive))
        assert x.tolist() == [3.0] * 4
        options = dist.GatherOptions()
        options.rootRank = 0
        parts = [torch.empty(4), torch.empty(4)]
        waited("gather", lambda: wait_for_peers(group.gather([parts], [x], options), check_alive))
        assert torch.cat(parts).tolist() == [3.0] * 8
        x.fill_(7.0)
        waited("broadcast", lambda: wait_for_peers(group.broadcast([x], dist.BroadcastOptions()), check_alive))
        waited("send", lambda: run_with_peers(lambda: group.send([torch.full((4,), 5.0)], 1, 0).wait(), check_alive))
        y = torch.zeros(4)
        waited("recv", lambda: run_with_peers(lambda: group.recv([y], 1, 0).wait(), check_alive))
        assert y.tolist() == [50.0] * 4
        # One helper thread carried both transfers (an earlier test's idle one, or a new one).
        assert sum(thread.name == "peer-transfer" for thread in threading.enumerate()) <= num_helpers + 1

        def lost() -> None:
            raise PeerLost("rank 1 is gone")

        started = time.monotonic()
        with pytest.raises(PeerLost):
            run_with_peers(lambda: group.recv([y], 1, 0).wait(), lost)  # the peer sends only after DELAY_S
        assert time.monotonic() - started < DELAY_S
        assert peer.wait(60) == 0  # its late send still found the receive the helper thread had posted
    finally:
        peer.kill()
        peer.wait()


def test_a_watched_worker_is_reported_stopped_then_exited():
    process = subprocess.Popen(["sleep", "60"])
    try:
        watched = WatchedProcess(3, process.pid)
        assert watched.find_gone() is None  # asleep: alive
        os.kill(process.pid, signal.SIGSTOP)
        reason = wait_for(watched.find_gone, 10, 0.01, what="the stop")
        assert reason == f"tensor-parallel worker rank 3 (pid {process.pid}) is stopped (SIGSTOP): its peers cannot go on"
        os.kill(process.pid, signal.SIGCONT)
        assert wait_for(lambda: watched.find_gone() is None, 10, 0.01, what="the continue")
        process.kill()
        assert wait_for(lambda: "exited" in (watched.find_gone() or ""), 10, 0.01)  # a zombie, not yet reaped
        process.wait()
        assert watched.find_gone() == f"tensor-parallel worker rank 3 (pid {process.pid}) exited"  # no such pid
    finally:
        process.kill()
        process.wait()
    other = WatchedProcess(3, os.getpid())
    other.start_time += 1  # as if the worker's pid had been reused by another process
    assert "exited" in other.find_gone()


def test_the_stage_delay_hook_reads_its_rank_and_seconds(monkeypatch):
    assert stage_delay_s(1, "rank=1,seconds=3") == 3.0
    assert stage_delay_s(2, "rank=1,seconds=0.5") == 0.0  # another rank's
    assert stage_delay_s(1, "") == 0.0
    monkeypatch.delenv(STAGE_DELAY_ENV, raising=False)
    assert stage_delay_s(1) == 0.0  # unset: no effect
    monkeypatch.setenv(STAGE_DELAY_ENV, "rank=1,seconds=0.5")
    assert stage_delay_s(1) == 0.5
    for bad in ("rank=1", "seconds=3", "rank=x,seconds=3", "rank=1,seconds=3,steps=2", "rank=1,seconds=-1", "3"):
        with pytest.raises(ValueError, match=STAGE_DELAY_ENV):
            stage_delay_s(1, bad)


class RacingWork:
    """A c10d Work whose timed wait ran out just as it finished: the slice raises, and by then the
    work is completed, with `error` (a peer gone) or without (the collective simply finished)."""

    def __init__(self, error: Exception | None):
        self.error = error
        self.num_plain_waits = 0

    def wait(self, timeout=None):
        if timeout is not None:
            raise RuntimeError("Operation timed out!")
        self.num_plain_waits += 1
        if self.error is not None:
            raise self.error
        return True

    def is_completed(self):
        return True


def test_a_collective_done_as_its_slice_ran_out_is_not_taken_for_a_failure():
    """Seen in the TP=2 fault test under load: a step that finished as its slice ran out was
    failed with "Operation timed out!" (is_completed() was taken to mean the op had failed)."""
    checks = []
    work = RacingWork(error=None)
    wait_for_peers(work, check_alive=lambda: checks.append(1))
    assert work.num_plain_waits == 1 and checks == []
    failed = RacingWork(error=RuntimeError("Connection closed by peer"))
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        wait_for_peers(failed, check_alive=lambda: checks.append(1))
