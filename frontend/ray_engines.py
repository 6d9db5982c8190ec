"""Data-parallel engine cores as Ray actors (`serve --data-parallel N --distributed-executor-backend ray`).

    frontend ──ray.init──► cluster: N `EngineCoreActor`s, placed by Ray (one CPU each)
    each actor             starts the same core command a local core runs, bound at
                           tcp://(loopback, or its node's IP when remote):PORT, as its child
    frontend ──ZeroMQ────► each core's address: the same protocol, least-loaded routing

The actor is the core's anchor in Ray: it holds the resources and dies when its core
dies by accident (any exit but a clean Shutdown), and Ray restarts it (`max_restarts`),
which starts a fresh core at a new address. `reconnect` waits for that address and puts the
core back in service; while it is gone the other cores keep serving, and its in-flight
requests failed (503) as a local core's do. Killing an actor kills its core (PDEATHSIG).
No torch here: the actor starts the core as a process.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import subprocess
import threading
from typing import Awaitable, Callable

import zmq.asyncio

from frontend.background_tasks import BackgroundTasks
from frontend.engine_connection import EngineConnection, EngineStartError
from ipc.ray_cluster import actor_runtime_env, import_ray, init_ray

logger = logging.getLogger(__name__)

ACTOR_NAMESPACE = "tokenloom"  # named there (engine-core-PID-INDEX), so `ray.get_actor` finds a core's actor
MAX_RESTARTS = 3  # per core: a core that keeps dying is broken, and its slot stays dead
LOOPBACK = "127.0.0.1"


class EngineCoreActor:
    """One engine core's Ray actor (wrapped with ray.remote where used: Ray is optional)."""

    def __init__(self, command: list[str], frontend_ip: str) -> None:
        import ray

        node_ip = ray.util.get_node_ip_address()
        host = LOOPBACK if node_ip == frontend_ip else node_ip  # another host's core must be reachable
        self.address = f"tcp://{host}:{_free_port(host)}"
        argv = [*command, "--address", self.address, "--parent-pid", str(os.getpid()),
                *(["--allow-remote"] if host != LOOPBACK else [])]
        self.process = subprocess.Popen(argv)
        threading.Thread(target=self._exit_with_core, daemon=True).start()

    def get_address(self) -> str:
        return self.address

    def _exit_with_core(self) -> None:
        code = self.process.wait()
        if code != 0:  # a crash or a kill, not a Shutdown: this actor dies too, and Ray restarts it
            logger.error("engine core exited with code %s; restarting its actor", code)
            os._exit(1)


class RayEngineCores:
    """The frontend's handle on its Ray engine actors."""

    def __init__(self, engine_command: tuple[str, ...], model: str, engine_args: list[str]) -> None:
        self.engine_command = engine_command
        self.model = model
        self.engine_args = engine_args
        self.actors: list = []
        self._reconnects = BackgroundTasks()

    async def start(self, num_engines: int) -> list[str]:
        """Start the actors (connecting to a running Ray cluster, or starting a local one); their addresses."""
        ray = import_ray()
        await asyncio.get_running_loop().run_in_executor(None, init_ray, num_engines)
        frontend_ip = ray.util.get_node_ip_address()
        actor_class = ray.remote(EngineCoreActor)
        for index in range(num_engines):
            command = [*self.engine_command, "--model", self.model, "--engine-id", str(index), *self.engine_args]
            self.actors.append(actor_class.options(
                name=f"engine-core-{os.getpid()}-{index}", namespace=ACTOR_NAMESPACE, num_cpus=1,
                max_restarts=MAX_RESTARTS, max_task_retries=-1, runtime_env=actor_runtime_env(),
            ).remote(command, frontend_ip))
        return list(await asyncio.gather(*(actor.get_address.remote() for actor in self.actors)))

    def reconnect(self, dead: EngineConnection, ctx: zmq.asyncio.Context, frontend_id: str, ready_timeout_s: float,
                  stop_tasks: Callable[[int], Awaitable[None]], on_ready: Callable[[EngineConnection], None]) -> None:
        """Wait, in the background, for Ray to restart `dead`'s actor, then connect to its new core."""
        self._reconnects.start(self._reconnect(dead, ctx, frontend_id, ready_timeout_s, stop_tasks, on_ready),
                               name=f"reconnect-{dead.index}")

    async def _reconnect(self, dead: EngineConnection, ctx, frontend_id: str, ready_timeout_s: float,
                         stop_tasks, on_ready) -> None:
        index = dead.index
        await stop_tasks(index)
        await dead.close()
        engine = None
        try:
            # Answered by the restarted actor (Ray holds the call while it restarts); raises once
            # it is past max_restarts.
            address = await asyncio.wait_for(self.actors[index].get_address.remote(), ready_timeout_s)
            engine = EngineConnection(index, address, ctx)
            await engine.handshake(frontend_id, ready_timeout_s)
        except (EngineStartError, asyncio.TimeoutError, OSError) as e:
            logger.error("engine %d did not come back: %s", index, e)
            if engine is not None:
                await engine.close()
            return
        except Exception as e:  # RayActorError: past max_restarts
            logger.error("engine %d did not come back (Ray: %s); staying down", index, type(e).__name__)
            return
        on_ready(engine)
        logger.warning("engine %d restarted by Ray at %s; serving again", index, address)

    async def shutdown(self) -> None:
        """Stop reconnecting and remove the actors (their cores die with them)."""
        await self._reconnects.cancel()
        if self.actors:
            ray = import_ray()
            for actor in self.actors:
                ray.kill(actor, no_restart=True)
            self.actors.clear()


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
