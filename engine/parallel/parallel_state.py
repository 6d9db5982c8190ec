"""The tensor-parallel group: rendezvous, rank and size, and the two collectives the model needs.

torchrun's conventions: rank 0 hosts a `TCPStore` at master_addr:master_port and
every rank meets there; the group is gloo on the CPU, NCCL on CUDA. The process
group is built straight from that store rather than through
`init_process_group`, so there is no global default group: one process can hold
several engines (tests build one `LLM` after another) and each engine's group is
the `TensorParallelGroup` it was given.

At TP = 1 the model is built with `NO_TP`, and nothing here runs. With pipeline
parallelism (engine.parallel.pipeline) each stage is a tensor-parallel group of its own,
and the group carries this rank's `PipelineStage`.
"""

from __future__ import annotations

import datetime
import os
import time
from typing import Callable

import torch
import torch.distributed as dist

from engine.parallel.peer_wait import wait_for_peers
from engine.parallel.pipeline import WHOLE_MODEL, PipelineStage

# A rank that waits longer than this in a collective or a stage's hand-off gives up (gloo
# raises): the longest a stage may compute while the next one waits for it, so far above
# any step (torch's default). A killed peer is noticed at once (its socket closes), a stopped
# one on rank 0's host within a second (engine.parallel.peer_wait); this bounds only a
# peer that runs but never arrives.
COLLECTIVE_TIMEOUT_S = 1800.0
# Time every rank gets to reach the rendezvous (a second host may start later).
RENDEZVOUS_TIMEOUT_S = 300.0


class TensorParallelGroup:
    """This rank's place in its group and the group's collectives, with the time spent in them."""

    def __init__(self, rank: int, size: int, process_group=None, stage: PipelineStage = WHOLE_MODEL,
                 check_alive: Callable[[], None] | None = None) -> None:
        self.rank = rank  # within this group (this stage's)
        self.size = size
        self.process_group = process_group
        self.stage = stage
        self.check_alive = check_alive  # rank 0's check between slices of a wait (engine.parallel.peer_wait)
        self.num_all_reduces = 0
        self.all_reduce_seconds = 0.0  # includes waiting for the slowest rank

    @property
    def is_first_rank(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place."""
        start = time.perf_counter()
        wait_for_peers(self.process_group.allreduce([x]), self.check_alive)
        self.all_reduce_seconds += time.perf_counter() - start
        self.num_all_reduces += 1
        return x

    def gather_to_first(self, x: torch.Tensor) -> torch.Tensor | None:
        """Rank 0 gets every rank's `x` concatenated along the last dimension; the others None."""
        options = dist.GatherOptions()
        options.rootRank = 0
        if self.rank == 0:
            parts = [torch.empty_like(x) for _ in range(self.size)]
            wait_for_peers(self.process_group.gather([parts], [x], options), self.check_alive)
            return torch.cat(parts, dim=-1)
        wait_for_peers(self.process_group.gather([], [x], options), self.check_alive)
        return None


NO_TP = TensorParallelGroup(rank=0, size=1)


def create_store(master_addr: str, master_port: int, world_size: int, is_master: bool) -> dist.TCPStore:
    """Rank 0 hosts the store (port 0: any free port, read back as `store.port`); the others connect."""
    timeout = datetime.timedelta(seconds=RENDEZVOUS_TIMEOUT_S)
    return dist.TCPStore(master_addr, master_port, world_size, is_master=is_master, timeout=timeout,
                         wait_for_workers=False)


def create_group(store: dist.Store, rank: int, tensor_parallel_size: int, device: torch.device,
                 pipeline_parallel_size: int = 1, check_alive: Callable[[], None] | None = None) -> TensorParallelGroup:
    """Join this rank's groups (blocks until every rank has): its stage's tensor-parallel group
    and, with several stages, every rank's group for the sends between them. `check_alive`
    (rank 0's executor) runs while a collective waits, on the CPU (engine.parallel.peer_wait)."""
    if device.type == "cuda":
        check_alive = None
    stage_index, tp_rank = divmod(rank, tensor_parallel_size)
    process_group = None
    if tensor_parallel_size > 1:
        # Stage 0's prefix is the one a plain TP group has always used.
        prefix = "tp" if stage_index == 0 else f"tp{stage_index}"
        process_group = _process_group(dist.PrefixStore(prefix, store), tp_rank, tensor_parallel_size, device)
    stage = WHOLE_MODEL
    if pipeline_parallel_size > 1:
        world = _process_group(dist.PrefixStore("pp", store), rank, tensor_parallel_size * pipeline_parallel_size,
                               device)
        stage = PipelineStage(stage_index, pipeline_parallel_size, tp_rank, tensor_parallel_size, world, check_alive)
    return TensorParallelGroup(tp_rank, tensor_parallel_size, process_group, stage, check_alive)


def _process_group(store: dist.Store, rank: int, size: int, device: torch.device):
    """gloo on the CPU, NCCL on CUDA."""
    timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, options)
    return dist.ProcessGroupGloo(store, rank, size, timeout)


def num_local_ranks(world_size: int, nnodes: int) -> int:
    return world_size // nnodes


def threads_per_rank(world_size: int, nnodes: int) -> int:
    """This host's cores shared among its ranks, so they do not oversubscribe the CPU."""
    return max(1, len(os.sched_getaffinity(0)) // num_local_ranks(world_size, nnodes))
