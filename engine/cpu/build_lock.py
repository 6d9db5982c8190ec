"""One build of a kernel folder at a time, and no hang on a build that was killed.

torch.utils.cpp_extension guards a build folder with a `lock` file it creates and
deletes itself (FileBaton). An engine killed mid-build leaves that file behind, and
every later start then waits on it forever, silently. `exclusive_build` takes an
flock on a sidecar file first: the kernel releases an flock when its holder dies, so
once we hold it no other build is running, and a `lock` file still there is a dead
build's, safe to remove.
"""

from __future__ import annotations

import fcntl
import logging
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

logger = logging.getLogger(__name__)

TORCH_LOCK_NAME = "lock"  # torch.utils.cpp_extension's FileBaton in build_directory
FLOCK_NAME = "tokenloom-build.flock"


@contextmanager
def exclusive_build(build_dir: Path) -> Iterator[None]:
    """Hold the folder's build flock (waiting, with a log line, while another process builds)."""
    build_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(build_dir / FLOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for another process's kernel build in %s", build_dir)
            fcntl.flock(fd, fcntl.LOCK_EX)
        stale = build_dir / TORCH_LOCK_NAME
        if stale.exists():
            logger.warning("removing %s, left by a kernel build that was killed", stale)
            stale.unlink(missing_ok=True)
        yield
    finally:
        os.close(fd)  # releases the flock
