"""Rank 0's side of a tensor-parallel group: start the workers, send each step's inputs, watch them.

The engine core stays the one scheduler, as rank 0. Who starts the other ranks is
the one thing the two executors differ in (`--distributed-executor-backend`):

    mp   `MultiprocExecutor`: this host's ranks as our child processes; other hosts'
         by hand (`tokenloom engine --node-rank R`, torchrun's layout)
    ray  `engine.executor.ray_executor.RayExecutor`: one Ray actor per rank,
         placed by a placement group anywhere in a Ray cluster

Both run the same worker code (`engine.executor.worker_process.run_worker`) and the same
per-step channel, ours, not Ray's: a Ray actor call costs an order of magnitude more than
a ZeroMQ send (figures in docs/scale-out.md), a sizeable share of a GPU's decode step. Ray places and starts the workers and restarts what it lost; steps never
go through it (vLLM does the same with its compiled graphs). Start-up:

    rank 0: TCP store at master_addr:master_port, a ROUTER for step inputs; publish its
            address and the pool's size in the store; start (or place) the other ranks
    worker: read the store, connect a DEALER, send WorkerHello       (rank 0 waits for all)
    all:    form the process group (gloo / NCCL)
    all:    load this rank's shard and allocate the KV pool; workers send WorkerReady

Each step rank 0 sends one `StepInputs` record (msgpack) to every worker, then every
rank runs the model on it, meeting in the all-reduces; rank 0 samples.

Faults: a worker that dies closes its sockets, so the next (or current) collective
raises on rank 0 at once, and its ZeroMQ link drops; rank 0 then names the rank (its
launcher's word, or its process's state here). While rank 0 waits on its peers, however
long a step takes, it asks every second (peer_wait.py) whether a launcher reports a worker
dead before its process has exited (Ray), or whether a worker on this host has exited or is
stopped (SIGSTOP: its sockets stay open; process_checks.WatchedProcess). Any step that raises
under TP or PP is fatal (the ranks may no longer be in step): `run_step` raises `WorkerDeadError`,
which the core reports and exits on; the frontend answers 503 and, with
--restart-engine, starts a fresh core, which starts fresh workers. A worker that runs
but never arrives (deadlocked, or stopped on another host) cannot be told from a slow
one: it holds rank 0 until the group's timeout, or until the frontend's
--engine-timeout kills the core; workers die with the core (PDEATHSIG, Ray's owner
fate-sharing, and they exit when rank 0's socket drops).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import logging
import os
import subprocess
import sys
import time
import weakref

import zmq

from engine.executor import messages
from engine.parallel.parallel_layers import check_tensor_parallel
from engine.parallel.pipeline import check_pipeline_parallel
from engine.parallel.parallel_state import RENDEZVOUS_TIMEOUT_S, create_group, create_store, num_local_ranks
from engine.executor.process_checks import WatchedProcess, host_id
from ipc.engine_config import EngineConfig, engine_argv

logger = logging.getLogger(__name__)

WORKER_MODULE = "engine.executor.worker_process"
# Keys rank 0 publishes in the store for every worker, wherever it runs.
STEP_ADDRESS_KEY = "tokenloom/step_address"
NUM_KV_BLOCKS_KEY = "tokenloom/num_kv_blocks"
MAX_MODEL_LEN_KEY = "tokenloom/max_model_len"
POLL_MS = 100
STOP_GRACE_S = 3.0
# After a failed step, how long to look for the rank to blame: a killed process closes its sockets
# (failing the step) a moment before it is a zombie, and Ray reports a lost actor a moment later.
NAME_DEAD_RANK_S = 2.0


class WorkerDeadError(RuntimeError):
    """A rank of the group is gone or the group fell out of step: the whole engine is dead."""


class Workers:
    """The other ranks, as one executor starts them. Kept apart from the executor so that its
    finalizer can stop them without holding the executor alive."""

    def master_addr(self, config: EngineConfig) -> str:
        """Where the ranks meet (rank 0's host, as the workers reach it)."""
        return config.master_addr

    def start(self, config: EngineConfig, model_path: str) -> None:
        raise NotImplementedError

    def find_dead(self) -> str | None:
        """Why a worker is gone, or None while all run."""
        raise NotImplementedError

    def stop(self, grace_s: float) -> None:
        """Make sure every worker is gone, waiting up to `grace_s` for them to exit by themselves."""
        raise NotImplementedError


class Executor:
    """Rank 0's channel to its workers; `make_workers` says how they are started."""

    def __init__(self, config: EngineConfig, model_config, num_kv_blocks: int, max_model_len: int, device) -> None:
        check_tensor_parallel(model_config, config.tensor_parallel_size)
        check_pipeline_parallel(model_config.num_layers, config.pipeline_parallel_size)
        self.size = config.world_size
        self.workers = self.make_workers(config, device)
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.identities: dict[int, bytes] = {}
        self.watched: list[WatchedProcess] = []  # the workers on this host (their hellos' host_id is ours)
        self._finalizer = weakref.finalize(self, _stop, self.ctx, self.sock, self.identities, self.workers)
        try:
            master_addr = self.workers.master_addr(config)
            self.store = create_store(master_addr, config.master_port, self.size, is_master=True)
            self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a vanished worker raises
            self.sock.setsockopt(zmq.LINGER, 0)
            port = self.sock.bind_to_random_port(f"tcp://{master_addr}")
            self.monitor = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            self.store.set(STEP_ADDRESS_KEY, f"tcp://{master_addr}:{port}")
            self.store.set(NUM_KV_BLOCKS_KEY, str(num_kv_blocks))
            self.store.set(MAX_MODEL_LEN_KEY, str(max_model_len))
            worker_config = dataclasses.replace(config, master_addr=master_addr, master_port=self.store.port)
            self.workers.start(worker_config, model_config.path)
            this_host = host_id()
            for hello in self._wait_for(messages.WorkerHello, "connect"):
                logger.info("tensor-parallel rank %d (pid %d) connected", hello.rank, hello.pid)
                if this_host and hello.host_id == this_host:
                    self.watched.append(WatchedProcess(hello.rank, hello.pid))
            # The check as a function of the workers and the monitor, not of self: the group must not
            # keep the executor alive past its finalizer.
            check_alive = functools.partial(check_workers, self.workers, self.monitor, self.watched)
            self.group = create_group(self.store, 0, config.tensor_parallel_size, device, config.pipeline_parallel_size,
                                      check_alive)
        except BaseException:
            self.shutdown()
            raise
        logger.info("tensor-parallel group of %d ranks formed (%s, master %s:%d)", self.size,
                    config.distributed_executor_backend, master_addr, self.store.port)

    def make_workers(self, config: EngineConfig, device) -> Workers:
        raise NotImplementedError

    def wait_until_ready(self) -> None:
        """Block until every worker has loaded its shard; raise if one dies first."""
        try:
            list(self._wait_for(messages.WorkerReady, "load the model"))
        except BaseException:
            self.shutdown()
            raise

    def run_step(self, inputs: messages.StepInputs, forward_step):
        """Send the step to every worker and run it here; any failure kills the group."""
        self.check_workers()
        payload = messages.encode(inputs)
        try:
            for identity in self.identities.values():
                self.sock.send_multipart([identity, payload])
            return forward_step(inputs)
        except WorkerDeadError:
            raise  # a wait found a rank gone (engine.parallel.peer_wait)
        except Exception as e:
            failure = f"a tensor-parallel step failed: {type(e).__name__}: {str(e)[:200]}"
            reason = self._find_dead_rank(NAME_DEAD_RANK_S)  # name the rank to blame if we can
            if reason is not None:
                raise WorkerDeadError(f"{reason} ({failure})") from e
            self.check_workers()
            raise WorkerDeadError(failure) from e

    def check_workers(self) -> None:
        """Raise WorkerDeadError if a worker has exited, is stopped or dropped its connection."""
        check_workers(self.workers, self.monitor, self.watched)

    def _find_dead_rank(self, timeout_s: float) -> str | None:
        """Why a worker is gone, asked until one is found or `timeout_s` has passed."""
        deadline = time.monotonic() + timeout_s
        while True:
            reason = find_dead_worker(self.workers, self.watched)
            if reason is not None or time.monotonic() >= deadline:
                return reason
            time.sleep(POLL_MS / 1000)

    def shutdown(self) -> None:
        self._finalizer()

    def _wait_for(self, message_type: type, what: str):
        """Yield one `message_type` from each worker, failing fast if one is gone."""
        waiting = set(range(1, self.size))
        deadline = time.monotonic() + RENDEZVOUS_TIMEOUT_S
        while waiting:
            reason = self.workers.find_dead()
            if reason is not None:
                raise RuntimeError(f"{reason} before it could {what} (see its log above)")
            if time.monotonic() > deadline:
                raise TimeoutError(f"tensor-parallel ranks {sorted(waiting)} did not {what} within "
                                   f"{RENDEZVOUS_TIMEOUT_S:.0f} s")
            if not self.sock.poll(POLL_MS):
                continue
            identity, payload = self.sock.recv_multipart()
            message = messages.decode(payload)
            if isinstance(message, message_type) and message.rank in waiting:
                waiting.discard(message.rank)
                self.identities[message.rank] = identity
                yield message


class MultiprocExecutor(Executor):
    """`--distributed-executor-backend mp`: this host's ranks as our children."""

    def make_workers(self, config: EngineConfig, device) -> Workers:
        return LocalProcesses()


class LocalProcesses(Workers):
    def __init__(self) -> None:
        self.processes: dict[int, subprocess.Popen] = {}  # this host's workers, by rank

    def start(self, config: EngineConfig, model_path: str) -> None:
        for rank in range(1, num_local_ranks(config.world_size, config.nnodes)):
            self.processes[rank] = start_worker(config, model_path, rank)

    def find_dead(self) -> str | None:
        for rank, process in self.processes.items():
            if process.poll() is not None:
                return f"tensor-parallel worker rank {rank} exited with code {process.returncode}"
        return None

    def stop(self, grace_s: float) -> None:
        deadline = time.monotonic() + grace_s
        for process in self.processes.values():
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def find_dead_worker(workers: Workers, watched: list[WatchedProcess]) -> str | None:
    """Why a worker is gone, by its launcher's word or, for this host's, by its process's state; else None."""
    reason = workers.find_dead()
    if reason is None:
        reason = next(filter(None, (process.find_gone() for process in watched)), None)
    return reason


def check_workers(workers: Workers, monitor: zmq.Socket, watched: list[WatchedProcess]) -> None:
    """Raise WorkerDeadError if a worker has exited (by its launcher's word or its state here), is
    stopped, or dropped its connection."""
    reason = find_dead_worker(workers, watched)
    if reason is not None:
        raise WorkerDeadError(reason)
    if monitor.poll(0):
        monitor.recv_multipart()
        raise WorkerDeadError("a tensor-parallel worker disconnected")


def start_worker(config: EngineConfig, model_path: str, rank: int) -> subprocess.Popen:
    """A worker of this host as our child; it dies with us (PDEATHSIG, parent-pid check)."""
    flags = engine_argv(argparse.Namespace(**dataclasses.asdict(config)))
    command = [sys.executable, "-m", WORKER_MODULE, "--model", model_path, "--rank", str(rank),
               "--parent-pid", str(os.getpid()), "--allow-remote", *flags]  # rank 0 checked the address
    logger.info("starting tensor-parallel worker rank %d", rank)
    return subprocess.Popen(command, start_new_session=True)


def _stop(ctx, sock, identities: dict, workers: Workers) -> None:
    """Tell every worker to stop, give them a moment, then make sure they are gone."""
    for identity in identities.values():
        try:
            sock.send_multipart([identity, messages.encode(messages.StopWorker("engine shutting down"))],
                                zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
    workers.stop(STOP_GRACE_S)
    try:
        sock.disable_monitor()
    except zmq.ZMQError:
        pass  # never monitored: the start failed first
    sock.close(linger=200)  # the StopWorker records may still be leaving
    ctx.destroy(linger=0)  # closes the monitor socket too
