"""Restart supervision: a dead local engine core is replaced by a fresh one in its slot.

`AsyncEngineClient` hands a dead core here when it runs with `restart_engine`; the
restarter stops the dead core's tasks, closes it (a hung one is killed first) and
starts a new core with back-off between tries. Only the first start of a core carries
the test-only fault flags, so a restarted core is a clean one. Once the new core is
ready the client puts it back in service; after every try has failed the slot stays
dead (and the server answers 503).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Awaitable, Callable

import zmq.asyncio

from frontend.background_tasks import BackgroundTasks
from frontend.engine_connection import EngineConnection, EngineStartError

logger = logging.getLogger(__name__)

# The wait before each try; once every try has failed the core stays dead.
RESTART_BACKOFF_S = (0.0, 1.0, 2.0, 5.0, 10.0)


@dataclass
class EngineRestarter:
    """Starts replacement cores (as the client started the first ones, less the fault flags);
    `cancel` stops every restart in progress (shutdown)."""

    ctx: zmq.asyncio.Context
    model_folder: str
    frontend_id: str
    engine_args: list[str]
    engine_command: tuple[str, ...]
    ready_timeout_s: float
    _restarts: BackgroundTasks = field(default_factory=BackgroundTasks, init=False)

    def restart(self, dead: EngineConnection, stop_tasks: Callable[[int], Awaitable[None]],
                on_ready: Callable[[EngineConnection], None]) -> None:
        """Replace `dead` in the background: `stop_tasks(index)` first, `on_ready(new core)` once it is ready."""
        self._restarts.start(self._restart(dead, stop_tasks, on_ready), name=f"restart-{dead.index}")

    async def cancel(self) -> None:
        await self._restarts.cancel()

    async def _restart(self, dead: EngineConnection, stop_tasks: Callable[[int], Awaitable[None]],
                       on_ready: Callable[[EngineConnection], None]) -> None:
        index = dead.index
        await stop_tasks(index)
        await dead.close()
        for attempt, backoff_s in enumerate(RESTART_BACKOFF_S, 1):
            await asyncio.sleep(backoff_s)
            logger.warning("restarting engine %d (try %d of %d)", index, attempt, len(RESTART_BACKOFF_S))
            engine = None
            try:
                engine = await EngineConnection.start_local(index, self.ctx, self.model_folder, self.engine_args,
                                                            self.engine_command)
                await engine.handshake(self.frontend_id, self.ready_timeout_s)
            except (EngineStartError, OSError) as e:
                logger.error("engine %d did not restart: %s", index, e)
                if engine is not None:
                    await engine.close()
                continue
            except BaseException:  # cancelled by shutdown: do not leave the new core behind
                if engine is not None:
                    await engine.close()
                raise
            on_ready(engine)
            logger.warning("engine %d restarted; serving again", index)
            return
        logger.error("engine %d failed to restart %d times; staying down", index, len(RESTART_BACKOFF_S))
