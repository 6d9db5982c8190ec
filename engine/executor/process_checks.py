"""What every engine process checks at start: it dies with its parent, and its ranks'
unauthenticated rendezvous stays on loopback unless allowed. Shared by the engine core
(engine/loop/core_process.py) and the ranks' workers (engine/executor/worker_process.py)."""

from __future__ import annotations

import ctypes
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
