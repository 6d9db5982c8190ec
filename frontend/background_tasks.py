"""Tasks the frontend starts to run on their own, and how it stops them.

A core's restart (`frontend.engine_restarter`), a Ray actor's reconnect
(`frontend.ray_engines`), a core's output pump and death watch (`frontend.engine_connection`)
and a local client's requests (`frontend.local_socket`) each run as an asyncio task
that nobody awaits until shutdown. Shutdown cancels them and waits until each has
finished its cleanup (a half-started core closes itself), so nothing runs on after.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Iterable


async def cancel_and_wait(tasks: Iterable[asyncio.Task]) -> None:
    """Cancel every task, then wait for all of them to end; their errors are theirs to log."""
    tasks = list(tasks)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


class BackgroundTasks:
    """Tasks started and forgotten, kept referenced while they run (asyncio holds only a weak one)."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task] = set()

    def start(self, coroutine: Coroutine, name: str) -> None:
        task = asyncio.create_task(coroutine, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def cancel(self) -> None:
        """Stop every task still running (shutdown)."""
        await cancel_and_wait(self._tasks)
