"""The output pumps: what the frontend runs per engine core while the core serves.

Each core gets two tasks: its output pump (`ipc.sockets.serve_messages`) hands every
`EngineOutputs` to the `OutputProcessor` and each resulting delta to its request's queue,
and every `EngineError` to the request it names; its death watch reports a core that
exited or went silent for `engine_timeout_s`. A fatal error or a death goes to the
client's `on_engine_dead` (fail the core's requests, maybe restart it).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from typing import Callable

from frontend.background_tasks import cancel_and_wait
from frontend.engine_connection import EngineConnection
from frontend.errors import FrontendError, InvalidRequestError, RequestFailedError
from frontend.metrics import FrontendMetrics
from frontend.request_state import RequestState
from frontend.step_timeline import StepTimeline
from ipc.codec import DecodeError
from ipc.messages import AbortRequests, EngineError, EngineOutputs, FinishReason, WatchSteps
from ipc.sockets import serve_messages
from ipc.text.output_processor import OutputProcessor

logger = logging.getLogger(__name__)


class OutputPumps:
    """Starts and stops each core's output pump and death watch; routes what the cores send."""

    def __init__(self, states: dict[str, RequestState], output_processor: OutputProcessor,
                 metrics: FrontendMetrics, timeline: StepTimeline, engine_timeout_s: float, *,
                 finish: Callable[[RequestState, FinishReason], None],
                 fail: Callable[[RequestState, FrontendError], None],
                 on_engine_dead: Callable[[EngineConnection, str], None]):
        self.states = states  # the client's requests in flight, by id
        self.output_processor = output_processor
        self.metrics = metrics
        self.timeline = timeline
        self.engine_timeout_s = engine_timeout_s
        self.finish = finish
        self.fail = fail
        self.on_engine_dead = on_engine_dead
        self._tasks: dict[int, list[asyncio.Task]] = {}  # per core: its output pump and death watch

    def start(self, engine: EngineConnection) -> None:
        if self.timeline.is_watched:  # a restarted core starts unwatched
            engine.send(WatchSteps(True))
        self._tasks[engine.index] = [
            asyncio.create_task(self._pump(engine), name=f"pump-{engine.index}"),
            asyncio.create_task(self._watch(engine), name=f"watch-{engine.index}"),
        ]

    async def stop(self, index: int) -> None:
        """Stop one core's tasks (before its restart)."""
        await cancel_and_wait(self._tasks.pop(index, []))

    async def stop_all(self) -> None:
        await cancel_and_wait(t for engine_tasks in self._tasks.values() for t in engine_tasks)

    async def _pump(self, engine: EngineConnection) -> None:
        handlers = {EngineOutputs: functools.partial(self._on_outputs, engine),
                    EngineError: functools.partial(self._on_error, engine)}

        def on_malformed(identity: bytes | None, payload: bytes | None, error: DecodeError) -> None:
            logger.error("engine %d sent a malformed message, dropped: %s", engine.index, error)

        await serve_messages(engine.socket, handlers, on_malformed, on_receive=engine.mark_alive)

    async def _watch(self, engine: EngineConnection) -> None:
        self.on_engine_dead(engine, await engine.wait_for_death(self.engine_timeout_s))

    def _on_outputs(self, engine: EngineConnection, msg: EngineOutputs) -> None:
        engine.stats = msg.stats
        if msg.step_counts is not None:
            self.timeline.record(engine.index, msg.step_counts, msg.outputs)
        now = time.monotonic()
        processed = self.output_processor.process_outputs(msg.outputs)
        for request_id in processed.failed_request_ids:
            self.fail(self.states[request_id], RequestFailedError("detokenizing the output failed"))
        for delta in processed.deltas:
            state = self.states[delta.request_id]
            self.metrics.num_generation_tokens += len(delta.token_ids)
            if delta.token_ids:
                if state.last_token_time is None:
                    self.metrics.time_to_first_token.observe(now - state.arrival_time)
                else:
                    self.metrics.inter_token_latency.observe(now - state.last_token_time)
                state.last_token_time = now
            if delta.finish_reason is not None:
                self.finish(state, delta.finish_reason)
            state.queue.put_nowait(delta)
        if processed.request_ids_to_abort:  # a stop string ended them: the core is still generating
            engine.send(AbortRequests(processed.request_ids_to_abort))

    def _on_error(self, engine: EngineConnection, msg: EngineError) -> None:
        level = logging.INFO if msg.is_request_error else logging.ERROR  # a client's bad request is not ours
        logger.log(level, "engine %d reported an error%s: %s", engine.index,
                   f" for request {msg.request_id}" if msg.request_id else "", msg.message)
        state = self.states.get(msg.request_id) if msg.request_id is not None else None
        if state is not None:
            error_type = InvalidRequestError if msg.is_request_error else RequestFailedError
            self.fail(state, error_type(msg.message))
        if msg.is_fatal:
            self.on_engine_dead(engine, f"engine {engine.index} failed: {msg.message}")
