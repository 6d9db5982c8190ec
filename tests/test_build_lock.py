"""engine.kernels.build_lock: a killed kernel build no longer hangs every later engine start."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

from engine.kernels.build_lock import TORCH_LOCK_NAME, exclusive_build

REPO_ROOT = Path(__file__).resolve().parents[1]

# A build that takes the flock, leaves torch's lock file as a build in progress does, and hangs.
HOLDER = """
import sys, time
from pathlib import Path
from engine.kernels.build_lock import exclusive_build
with exclusive_build(Path(sys.argv[1])):
    (Path(sys.argv[1]) / "lock").touch()
    print("held", flush=True)
    time.sleep(120)
"""


def test_a_lock_file_left_by_a_dead_build_is_removed(tmp_path):
    (tmp_path / TORCH_LOCK_NAME).touch()  # a build killed before torch could delete it
    with exclusive_build(tmp_path):
        assert not (tmp_path / TORCH_LOCK_NAME).exists()


def test_waits_for_a_live_build_then_takes_over_when_it_is_killed(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                              cwd=REPO_ROOT, env={"PYTHONPATH": str(REPO_ROOT), "PATH": "/usr/bin:/bin"})
    try:
        assert holder.stdout.readline().strip() == "held"
        acquired = threading.Event()
        lock_seen_inside: list[bool] = []

        def build() -> None:
            with exclusive_build(tmp_path):
                lock_seen_inside.append((tmp_path / TORCH_LOCK_NAME).exists())
                acquired.set()

        thread = threading.Thread(target=build, daemon=True)
        thread.start()
        time.sleep(0.5)
        assert not acquired.is_set()  # the live build's lock file is left alone while it runs
        assert (tmp_path / TORCH_LOCK_NAME).exists()
        holder.kill()  # killed mid-build: its lock file stays, its flock goes
        assert acquired.wait(timeout=10)
        assert lock_seen_inside == [False]
        thread.join(timeout=5)
    finally:
        holder.kill()
        holder.wait()
