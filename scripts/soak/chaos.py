"""The soak's chaos: a core killed on a timer, and every HTTP answer counted against those kills.

    python -m scripts.soak.run --duration 600 --all-routes --kill-core-every 120

With --kill-core-every S the soak starts its server with --restart-engine and SIGKILLs the engine
core every S seconds. A kill opens a window that closes once /health is 200 again plus
WINDOW_GRACE_S: a 5xx (or an error event in a stream) from a request whose life overlaps a window
is what the kill must cost; one outside every window is a defect. `HttpTally` counts every
answer by status through aiohttp's tracing, so no request path has to remember to.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import aiohttp

WINDOW_GRACE_S = 2.0  # answers already on their way when /health turned 200
CORE_MODULE_SUFFIX = b".core_process"  # `python -m engine.<room>.core_process`, wherever the room is


@dataclass
class KillWindow:
    start: float  # monotonic
    end: float | None = None  # None: the core is not back yet
    pid: int | None = None

    def overlaps(self, start: float, end: float) -> bool:
        return start <= (self.end if self.end is not None else float("inf")) and end >= self.start


@dataclass
class HttpTally:
    """Every HTTP answer the soak got: by status, and the 5xx kept with their times."""

    by_status: Counter = field(default_factory=Counter)
    spans_5xx: list[tuple[float, float, str]] = field(default_factory=list)  # (start, end, path)
    num_no_answer: int = 0

    def trace_config(self) -> aiohttp.TraceConfig:
        config = aiohttp.TraceConfig()

        async def on_start(session, context: SimpleNamespace, params) -> None:
            context.start = time.monotonic()

        async def on_end(session, context: SimpleNamespace, params) -> None:
            status = params.response.status
            self.by_status[status] += 1
            if status >= 500:
                self.spans_5xx.append((context.start, time.monotonic(), params.url.path))

        async def on_exception(session, context: SimpleNamespace, params) -> None:
            self.num_no_answer += 1

        config.on_request_start.append(on_start)
        config.on_request_end.append(on_end)
        config.on_request_exception.append(on_exception)
        return config

    def summary(self, windows: list[KillWindow]) -> dict:
        outside = [(s, e, p) for s, e, p in self.spans_5xx if not any(w.overlaps(s, e) for w in windows)]
        return {
            "answered": sum(self.by_status.values()),
            "2xx": sum(n for s, n in self.by_status.items() if 200 <= s < 300),
            "4xx": sum(n for s, n in self.by_status.items() if 400 <= s < 500),
            "5xx": sum(n for s, n in self.by_status.items() if s >= 500),
            "5xx_outside_kill_windows": len(outside),
            "5xx_outside_kill_windows_paths": dict(Counter(p for _, _, p in outside)),
            "by_status": {str(s): n for s, n in sorted(self.by_status.items())},
            "no_answer": self.num_no_answer,  # connection errors, timeouts
        }


def core_pids(frontend_pid: int) -> list[int]:
    """The frontend's children that run an engine core (not its grammar checker or other helpers)."""
    children = Path(f"/proc/{frontend_pid}/task/{frontend_pid}/children")
    pids = []
    for pid in (children.read_text().split() if children.exists() else ()):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except FileNotFoundError:
            continue
        if any(arg.endswith(CORE_MODULE_SUFFIX) for arg in argv):
            pids.append(int(pid))
    return pids


def num_fds(pid: int) -> int | None:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except FileNotFoundError:
        return None


async def kill_core_every(url: str, frontend_pid: int, every_s: float, deadline: float,
                          windows: list[KillWindow], recovery_timeout_s: float = 300.0) -> None:
    """SIGKILL the core every `every_s` until `deadline` (monotonic); each kill's window closes
    WINDOW_GRACE_S after /health is 200 again with a new core."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        next_kill = time.monotonic() + every_s  # on a fixed beat, whatever each recovery took
        while next_kill < deadline:
            await asyncio.sleep(max(0.0, next_kill - time.monotonic()))
            next_kill += every_s
            pids = core_pids(frontend_pid)
            if not pids:
                continue  # still restarting from the last kill: wait for the next turn
            window = KillWindow(time.monotonic(), pid=pids[0])
            windows.append(window)
            os.kill(pids[0], signal.SIGKILL)
            give_up = time.monotonic() + recovery_timeout_s
            while time.monotonic() < give_up:
                await asyncio.sleep(0.2)
                new_pids = core_pids(frontend_pid)
                if new_pids and new_pids[0] != window.pid and await _health(session, url) == 200:
                    window.end = time.monotonic() + WINDOW_GRACE_S
                    break


async def _health(session: aiohttp.ClientSession, url: str) -> int:
    try:
        async with session.get(url + "/health") as response:
            return response.status
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return 0


def chaos_report(windows: list[KillWindow], error_spans: list[tuple[str, float, float]], started: float) -> dict:
    """The kills, and the soak's errors (kind, request start, end) outside their windows (the
    answers by status are HttpTally.summary's)."""
    outside = Counter(kind for kind, start, end in error_spans if not any(w.overlaps(start, end) for w in windows))
    return {
        "kills": [{"at_s": round(w.start - started, 1), "pid": w.pid,
                   "back_after_s": None if w.end is None else round(w.end - WINDOW_GRACE_S - w.start, 1)}
                  for w in windows],
        "errors_outside_kill_windows": dict(sorted(outside.items())),
    }
