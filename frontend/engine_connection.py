"""One engine core as the frontend sees it: a DEALER socket, maybe a child process, its requests.

Death detection: a local core is our child, so its exit is death. Any core, local or
remote, is dead once its socket disconnects after the handshake (a ZMQ monitor reports
it: a killed process closes its end and the peer sees EOF), or once it has sent nothing
for the engine timeout: a busy core sends a message every step and an idle one a
heartbeat every second, so silence means it is hung (stopped, deadlocked, swapping).
A core going down on purpose also says so first with `EngineError(is_fatal=True)`.

The output pumps: what the frontend runs per engine core while the core serves. Each core
gets two tasks: its output pump (`ipc.sockets.serve_messages`) hands every `EngineOutputs`
to the `OutputProcessor` and each resulting delta to its request's queue, and every
`EngineError` to the request it names; its death watch reports a core that exited or went
silent for `engine_timeout_s`. A fatal error or a death goes to the client's
`on_engine_dead` (fail the core's requests, maybe restart it).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import sys
import time
from typing import Callable

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from frontend.background_tasks import cancel_and_wait
from frontend.errors import FrontendError, InvalidRequestError, RequestFailedError
from frontend.metrics import FrontendMetrics
from frontend.request_state import RequestState
from frontend.step_timeline import StepTimeline
from ipc.codec import DecodeError
from ipc.messages import (
    AbortRequests, EngineError, EngineOutputs, EngineReady, FinishReason, Hello, SchedulerStats, Shutdown, WatchSteps,
)
from ipc.sockets import connect_dealer, new_ipc_address, send_message, serve_messages, unpack_frames
from ipc.text.output_processor import OutputProcessor

logger = logging.getLogger(__name__)

DEFAULT_ENGINE_COMMAND = (sys.executable, "-m", "engine.loop.core_process")
# Time a local core gets to exit after Shutdown before it is terminated, then killed.
SHUTDOWN_GRACE_S = 5.0
# After a disconnect, time to wait for a local core's exit code so the error can name it.
EXIT_CODE_GRACE_S = 1.0


class EngineStartError(RuntimeError):
    """A core never became ready: it exited, or sent no EngineReady in time."""


class EngineConnection:
    """The link to one engine core. `index` is its place in the frontend's engine list."""

    def __init__(self, index: int, address: str, ctx: zmq.asyncio.Context,
                 process: asyncio.subprocess.Process | None = None):
        self.index = index
        self.address = address
        self.process = process
        self.socket = connect_dealer(ctx, address)
        self._monitor = self.socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.ready: EngineReady | None = None
        self.request_ids: set[str] = set()  # in flight here: the least-loaded router counts these
        self.stats = SchedulerStats()
        self.is_alive = True
        self.is_hung = False  # silent past the engine timeout: close() kills it without waiting
        self.last_recv_time = time.monotonic()

    @classmethod
    async def start_local(cls, index: int, ctx: zmq.asyncio.Context, model: str, engine_args: list[str],
                          engine_command: tuple[str, ...] = DEFAULT_ENGINE_COMMAND) -> EngineConnection:
        """Start a core as our child on a private ipc:// address; it exits when we die."""
        address = new_ipc_address(f"engine{index}")
        command = [*engine_command, "--model", model, "--address", address, "--engine-id", str(index),
                   "--parent-pid", str(os.getpid()), *engine_args]
        logger.info("starting engine core %d: %s", index, " ".join(command))
        # Its own session: a Ctrl-C to the terminal's process group reaches only us, and we drain
        # before we shut the core down. Our death still reaches it (PDEATHSIG, parent-pid check).
        process = await asyncio.create_subprocess_exec(*command, start_new_session=True)
        return cls(index, address, ctx, process)

    @property
    def num_in_flight(self) -> int:
        return len(self.request_ids)

    def send(self, msg) -> None:
        # The DEALER's queue is unbounded (SNDHWM 0), so this never waits.
        send_message(self.socket, msg)

    def mark_alive(self) -> None:
        """The core sent something: it is not hung."""
        self.last_recv_time = time.monotonic()

    async def recv(self):
        """The next record from the core; raises DecodeError for a malformed one."""
        frames = await self.socket.recv_multipart()
        self.mark_alive()
        return unpack_frames(frames, is_routed=False)[1]

    async def handshake(self, frontend_id: str, timeout_s: float) -> EngineReady:
        """Send Hello and wait for EngineReady, failing early if a local core exits."""
        self.send(Hello(frontend_id))
        waiters = {asyncio.ensure_future(self._recv_ready())}
        ready_waiter = next(iter(waiters))
        if self.process is not None:
            waiters.add(asyncio.ensure_future(self.process.wait()))
        done, pending = await asyncio.wait(waiters, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        for waiter in pending:
            waiter.cancel()
        if ready_waiter in done:
            self.ready = ready_waiter.result()  # re-raises a fatal EngineError as EngineStartError
            self.stats = SchedulerStats(num_kv_blocks_free=self.ready.num_kv_blocks)  # until its first step
            logger.info("engine %d ready at %s: %s", self.index, self.address, self.ready)
            return self.ready
        if done:
            raise EngineStartError(f"engine {self.index} exited with code {self.process.returncode} before it was ready")
        raise EngineStartError(f"engine {self.index} at {self.address} sent no EngineReady within {timeout_s:.0f} s")

    async def _recv_ready(self) -> EngineReady:
        while True:
            msg = await self.recv()
            if isinstance(msg, EngineReady):
                return msg
            if isinstance(msg, EngineError) and msg.is_fatal:
                raise EngineStartError(f"engine {self.index} failed to start: {msg.message}")
            logger.warning("engine %d sent %s before EngineReady; ignored", self.index, type(msg).__name__)

    async def wait_for_death(self, timeout_s: float = 0.0) -> str:
        """Return (with a reason) once the core is gone: its process exited, its socket
        dropped, or (with `timeout_s`) it has sent nothing for that long."""
        waiters = [asyncio.ensure_future(self._wait_disconnected())]
        if timeout_s > 0:
            waiters.append(asyncio.ensure_future(self._wait_silent(timeout_s)))
        exited = None
        if self.process is not None:
            exited = asyncio.ensure_future(self._wait_exit())
            waiters.append(exited)
        try:
            done, _ = await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
            if exited is not None and not self.is_hung:
                # A local core's exit code says more than "disconnected": give it a moment to show.
                await asyncio.wait([exited], timeout=EXIT_CODE_GRACE_S)
                if exited.done():
                    return exited.result()
            return next(iter(done)).result()
        finally:
            for waiter in waiters:
                waiter.cancel()

    async def _wait_silent(self, timeout_s: float) -> str:
        while True:
            silent_s = time.monotonic() - self.last_recv_time
            if silent_s >= timeout_s:
                self.is_hung = True
                return f"engine {self.index} sent nothing for {silent_s:.0f} s (--engine-timeout): it is hung"
            await asyncio.sleep(min(1.0, timeout_s - silent_s + 0.01))

    async def _wait_exit(self) -> str:
        code = await self.process.wait()
        return f"engine {self.index} exited with code {code}"

    async def _wait_disconnected(self) -> str:
        while True:
            event = parse_monitor_message(await self._monitor.recv_multipart())
            if event["event"] == zmq.EVENT_DISCONNECTED:
                return f"engine {self.index} at {self.address} disconnected"

    async def close(self) -> None:
        """Shut a local core down (Shutdown, then terminate, then kill); abort our requests on a remote one."""
        process = self.process
        if process is not None and process.returncode is None and self.is_hung:
            logger.warning("engine %d is hung; killing it", self.index)
            process.kill()
            await process.wait()
        elif process is not None and process.returncode is None:
            self.send(Shutdown("frontend exiting"))
            try:
                await asyncio.wait_for(process.wait(), SHUTDOWN_GRACE_S)
            except asyncio.TimeoutError:
                logger.warning("engine %d did not exit after Shutdown; terminating it", self.index)
                process.terminate()
                try:
                    await asyncio.wait_for(process.wait(), SHUTDOWN_GRACE_S)
                except asyncio.TimeoutError:
                    process.kill()
                    await process.wait()
        elif process is None and self.is_alive and self.request_ids:
            # A remote core outlives us; free its slots rather than let our requests run on.
            self.send(AbortRequests(sorted(self.request_ids)))
        self.socket.disable_monitor()
        self._monitor.close(linger=0)
        self.socket.close(linger=500)  # give a last AbortRequests time to leave


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
