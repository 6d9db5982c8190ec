"""Rank 0's side of a tensor-parallel group: start the workers, send each step's inputs, watch them.

The engine core stays the one scheduler, as rank 0. Start-up:

    rank 0: TCP store at master_addr:master_port, a ROUTER for step inputs; publish its
            address and the pool's size in the store; start this host's other ranks
    worker: read the store, connect a DEALER, send WorkerHello       (rank 0 waits for all)
    all:    form the process group (gloo / NCCL)
    all:    load this rank's shard and allocate the KV pool; workers send WorkerReady

Each step rank 0 sends one `StepInputs` record (msgpack) to every worker, then every
rank runs the model on it, meeting in the all-reduces; rank 0 samples.

Faults: a worker that dies closes its sockets, so the next (or current) collective
raises on rank 0 at once, and its ZeroMQ link drops. Any step that raises under TP
is fatal (the ranks may no longer be in step): `run_step` raises `WorkerDeadError`,
which the core reports and exits on; the frontend answers 503 and, with
--restart-engine, starts a fresh core, which starts fresh workers. A hung worker
holds rank 0 in a collective until the collective timeout, or until the frontend's
--engine-timeout kills the core; workers die with the core (PDEATHSIG, and they exit
when rank 0's socket drops).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import subprocess
import sys
import time
import weakref

import zmq

from engine.distributed import messages
from engine.distributed.parallel_layers import check_tensor_parallel
from engine.distributed.parallel_state import RENDEZVOUS_TIMEOUT_S, create_group, create_store, num_local_ranks
from ipc.engine_config import EngineConfig, engine_argv

logger = logging.getLogger(__name__)

WORKER_MODULE = "engine.distributed.worker"
# Keys rank 0 publishes in the store for every worker, wherever it runs.
STEP_ADDRESS_KEY = "tokenloom/step_address"
NUM_KV_BLOCKS_KEY = "tokenloom/num_kv_blocks"
MAX_MODEL_LEN_KEY = "tokenloom/max_model_len"
POLL_MS = 100
STOP_GRACE_S = 3.0


class WorkerDeadError(RuntimeError):
    """A rank of the group is gone or the group fell out of step: the whole engine is dead."""


class TensorParallelExecutor:
    def __init__(self, config: EngineConfig, model_config, num_kv_blocks: int, max_model_len: int, device) -> None:
        check_tensor_parallel(model_config, config.tensor_parallel_size)
        self.size = config.tensor_parallel_size
        self.store = create_store(config.master_addr, config.master_port, self.size, is_master=True)
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a vanished worker raises
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port(f"tcp://{config.master_addr}")
        self.monitor = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.store.set(STEP_ADDRESS_KEY, f"tcp://{config.master_addr}:{port}")
        self.store.set(NUM_KV_BLOCKS_KEY, str(num_kv_blocks))
        self.store.set(MAX_MODEL_LEN_KEY, str(max_model_len))
        self.processes: dict[int, subprocess.Popen] = {}  # this host's workers, by rank
        self.identities: dict[int, bytes] = {}
        self._finalizer = weakref.finalize(self, _stop, self.ctx, self.sock, self.monitor, self.identities,
                                           self.processes)
        worker_config = dataclasses.replace(config, master_port=self.store.port)
        for rank in range(1, num_local_ranks(self.size, config.nnodes)):
            self.processes[rank] = start_worker(worker_config, model_config.path, rank)
        try:
            for hello in self._wait_for(messages.WorkerHello, "connect"):
                logger.info("tensor-parallel rank %d (pid %d) connected", hello.rank, hello.pid)
            self.group = create_group(self.store, 0, self.size, device)
        except BaseException:
            self.shutdown()
            raise
        logger.info("tensor-parallel group of %d ranks formed (master %s:%d)", self.size, config.master_addr,
                    self.store.port)

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
        except Exception as e:
            self.check_workers()  # name the dead rank if we can
            raise WorkerDeadError(f"a tensor-parallel step failed: {type(e).__name__}: {str(e)[:200]}") from e

    def check_workers(self) -> None:
        """Raise WorkerDeadError if a worker has exited or dropped its connection."""
        for rank, process in self.processes.items():
            if process.poll() is not None:
                raise WorkerDeadError(f"tensor-parallel worker rank {rank} exited with code {process.returncode}")
        if self.monitor.poll(0):
            self.monitor.recv_multipart()
            raise WorkerDeadError("a tensor-parallel worker disconnected")

    def shutdown(self) -> None:
        self._finalizer()

    def _wait_for(self, message_type: type, what: str):
        """Yield one `message_type` from each worker, failing fast if a local one exits."""
        waiting = set(range(1, self.size))
        deadline = time.monotonic() + RENDEZVOUS_TIMEOUT_S
        while waiting:
            for rank, process in self.processes.items():
                if process.poll() is not None:
                    raise RuntimeError(f"tensor-parallel worker rank {rank} exited with code {process.returncode} "
                                       f"before it could {what} (see its log above)")
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


def start_worker(config: EngineConfig, model_path: str, rank: int) -> subprocess.Popen:
    """A worker of this host as our child; it dies with us (PDEATHSIG, parent-pid check)."""
    flags = engine_argv(argparse.Namespace(**dataclasses.asdict(config)))
    command = [sys.executable, "-m", WORKER_MODULE, "--model", model_path, "--rank", str(rank),
               "--parent-pid", str(os.getpid()), "--allow-remote", *flags]  # rank 0 checked the address
    logger.info("starting tensor-parallel worker rank %d", rank)
    return subprocess.Popen(command, start_new_session=True)


def _stop(ctx, sock, monitor, identities: dict, processes: dict) -> None:
    """Tell every worker to stop, give this host's a moment, then make sure they are gone."""
    for identity in identities.values():
        try:
            sock.send_multipart([identity, messages.encode(messages.StopWorker("engine shutting down"))],
                                zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
    deadline = time.monotonic() + STOP_GRACE_S
    for process in processes.values():
        try:
            process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    sock.disable_monitor()
    monitor.close(linger=0)
    sock.close(linger=200)  # the StopWorker records may still be leaving
    ctx.term()
