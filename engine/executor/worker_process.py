"""A worker rank (tensor- and/or pipeline-parallel): load this rank's shard, then run each step rank 0 sends.

    python -m engine.executor.worker_process --model PATH --tensor-parallel-size N [--pipeline-parallel-size P] \\
        [--nnodes K --node-rank R] --master-addr HOST --master-port PORT [--rank r] [engine flags]

Rank 0's executor starts its own host's workers with --rank. On another host,
`tokenloom engine --node-rank R` runs this without --rank: it becomes the host's
first rank and starts the host's other ranks as its children (torchrun's layout:
ranks R * N/K ... (R + 1) * N/K - 1 on host R).

    loop:  wait for a record from rank 0 (or its disconnection)
           StepInputs -> ModelRunner.forward_step (meets the other ranks in the all-reduces)
           StopWorker, rank 0 gone, parent gone -> exit

A worker whose step raises exits, which fails the step on rank 0 at once (its
collective sees the closed connection): the engine never runs with ranks out of step.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

import zmq

from engine.executor import messages
from engine.executor.executor import (
    MAX_MODEL_LEN_KEY, NUM_KV_BLOCKS_KEY, STEP_ADDRESS_KEY, start_worker,
)
from engine.parallel.parallel_state import create_group, create_store, num_local_ranks
from engine.executor.process_checks import check_master_addr, die_with_parent, host_id
from ipc.engine_config import DEFAULT_MODEL, EngineConfig, add_engine_args, engine_config_from_args

logger = logging.getLogger(__name__)

IDLE_POLL_MS = 500  # how often an idle worker checks that its parent is alive
STAGE_DELAY_ENV = "TOKENLOOM_TEST_STAGE_DELAY"


def stage_delay_s(rank: int, value: str | None = None) -> float:
    """A test hook: the seconds this rank sleeps in each step before its forward, from
    TOKENLOOM_TEST_STAGE_DELAY="rank=R,seconds=S" (a worker's rank, 1 or more; S may be a
    fraction). It makes one stage slow on purpose, whatever the machine's speed, so tests can
    tell a slow step from a lost peer (tests/reliability/test_stage_faults.py). Unset or
    empty: 0, no effect. Another rank's setting: 0. Malformed: ValueError, at the worker's start."""
    value = os.environ.get(STAGE_DELAY_ENV, "") if value is None else value
    if not value:
        return 0.0
    try:
        fields = dict(part.split("=", 1) for part in value.split(","))
        delay_rank, seconds = int(fields.pop("rank")), float(fields.pop("seconds"))
    except (KeyError, ValueError) as e:
        raise ValueError(f'{STAGE_DELAY_ENV}={value!r}: expected "rank=R,seconds=S"') from e
    if fields or seconds < 0:
        raise ValueError(f'{STAGE_DELAY_ENV}={value!r}: expected "rank=R,seconds=S", S >= 0')
    return seconds if delay_rank == rank else 0.0


def run_worker(config: EngineConfig, rank: int, parent_pid: int = 0, device_index: int | None = None) -> int:
    """`device_index`: this rank's CUDA device (default: its place among its host's ranks; a Ray
    actor sees only its own GPU, device 0)."""
    import torch

    from engine.loader.model_files import resolve_model
    from engine.worker.device_and_dtype import resolve_device_and_dtype
    from engine.worker.model_runner import ModelRunner
    from engine.models.config import ModelConfig

    if parent_pid:
        die_with_parent()
    size = config.world_size
    store = create_store(config.master_addr, config.master_port, size, is_master=False)
    address = store.get(STEP_ADDRESS_KEY).decode()
    num_kv_blocks = int(store.get(NUM_KV_BLOCKS_KEY))
    max_model_len = int(store.get(MAX_MODEL_LEN_KEY))
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    sock.connect(address)
    sock.send(messages.encode(messages.WorkerHello(rank, os.getpid(), host_id())))
    device, _ = resolve_device_and_dtype(config)
    if device.type == "cuda":
        torch.cuda.set_device(rank % num_local_ranks(size, config.nnodes) if device_index is None else device_index)
    group = create_group(store, rank, config.tensor_parallel_size, device, config.pipeline_parallel_size)
    model_config = ModelConfig.from_folder(resolve_model(config.model))
    runner = ModelRunner(config, model_config, num_kv_blocks, max_model_len, tp=group)
    sock.send(messages.encode(messages.WorkerReady(rank)))
    logger.info("tensor-parallel rank %d of %d ready", rank, size)
    try:
        return _serve_steps(runner, sock, monitor, parent_pid, rank)
    finally:
        sock.disable_monitor()
        monitor.close(linger=0)
        sock.close(linger=0)
        ctx.term()


def _serve_steps(runner, sock: zmq.Socket, monitor: zmq.Socket, parent_pid: int, rank: int) -> int:
    delay_s = stage_delay_s(rank)
    if delay_s:
        logger.warning("rank %d: every step sleeps %.1f s first (%s, a test hook)", rank, delay_s, STAGE_DELAY_ENV)
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    poller.register(monitor, zmq.POLLIN)
    while True:
        events = dict(poller.poll(IDLE_POLL_MS))
        if monitor in events:
            logger.warning("rank %d: rank 0 disconnected; exiting", rank)
            return 1
        if parent_pid and os.getppid() != parent_pid:
            logger.warning("rank %d: parent process %d is gone; exiting", rank, parent_pid)
            return 1
        if sock not in events:
            continue
        message = messages.decode(sock.recv(copy=False).buffer)
        if isinstance(message, messages.StepInputs):
            if delay_s:
                time.sleep(delay_s)  # rank 0 and the other stages wait for this one mid-step
            runner.forward_step(message)
        elif isinstance(message, messages.StopWorker):
            logger.info("rank %d: stopping (%s)", rank, message.reason)
            return 0


def run_worker_node(config: EngineConfig, parent_pid: int = 0) -> int:
    """Host `node_rank`'s ranks: the first here, the others as children."""
    num_local = num_local_ranks(config.world_size, config.nnodes)
    first_rank = config.node_rank * num_local
    children = [start_worker(config, config.model, rank) for rank in range(first_rank + 1, first_rank + num_local)]
    try:
        return run_worker(config, first_rank, parent_pid)
    finally:
        for child in children:
            child.terminate()
            child.wait()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="tokenloom tensor-parallel worker")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--rank", type=int, default=None, help="default: this node's first rank, starting the rest")
    parser.add_argument("--parent-pid", type=int, default=0, help="exit when this process dies (0: never)")
    parser.add_argument("--allow-remote", action="store_true", help="allow a non-loopback --master-addr")
    parser.add_argument("--log-level", default=os.environ.get("TOKENLOOM_LOG_LEVEL", "info"),
                        type=str.lower, choices=["debug", "info", "warning", "error"])
    add_engine_args(parser.add_argument_group("engine"))
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rank_name = "node" if args.rank is None else f"rank {args.rank}"
    logging.basicConfig(level=args.log_level.upper(),
                        format=f"%(asctime)s %(levelname)s [tp-{rank_name}] %(name)s: %(message)s")
    config = check_master_addr(engine_config_from_args(args), args.allow_remote)
    try:
        if args.rank is None:
            code = run_worker_node(config, args.parent_pid)
        else:
            code = run_worker(config, args.rank, args.parent_pid)
    except Exception:
        logger.exception("tensor-parallel worker failed")
        code = 1
    sys.exit(code)


if __name__ == "__main__":
    main()
