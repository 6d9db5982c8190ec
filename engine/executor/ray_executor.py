"""`--distributed-executor-backend ray`: the tensor-parallel ranks as Ray actors, wherever a Ray
cluster places them (vLLM's RayDistributedExecutor, without its per-step Ray calls).

    ray.init          RAY_ADDRESS, or the cluster `ray start` made on this host; else a local one
    placement group   one bundle per rank: {"CPU": c}, or {"GPU": 1, "CPU": c} on CUDA (c: 1, or a
                      fraction where the cluster has fewer free CPUs than ranks, `bundle_num_cpus`); bundle 0
                      pinned to this node, whose rank 0 is this process (the engine core); on
                      CUDA a placeholder actor holds bundle 0's GPU, and rank 0 runs on that GPU
                      (Ray gives the other actors other GPUs), as vLLM's driver does
    actors            one `RayWorker` in each other bundle; ranks 1.. ordered by node, this one first
    rendezvous        rank 0's store on loopback when every rank is on this host, else on its IP
    each actor        engine.executor.worker_process.run_worker: mp's worker, mp's channel (executor.py)

Ray starts, places and watches the workers; every step goes over our own ZeroMQ channel.
A worker's actor is not restarted by Ray (a lost rank leaves the group out of step): the
core fails at once, as under mp, and the frontend's --restart-engine makes a fresh group.
The actors and the placement group are owned by this process, so Ray removes them
if it dies; `stop` removes them at shutdown.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time

from engine.executor.executor import Executor, Workers
from engine.parallel.parallel_state import RENDEZVOUS_TIMEOUT_S
from ipc.engine_config import EngineConfig
from ipc.ray_cluster import actor_runtime_env, init_ray

logger = logging.getLogger(__name__)

ACTOR_NAMESPACE = "tokenloom"  # workers are named in it, so `ray.get_actor` (and ray.kill) can reach them
PLACEMENT_TIMEOUT_S = 60.0  # a cluster without room for the group says so rather than hang
CHECK_INTERVAL_S = 0.5  # Ray's own view of the actors, at most this often (the sockets see a death at once)
LOOPBACK = "127.0.0.1"
FREE_CPUS_SETTLE_S = 15.0  # how long a busy cluster is asked again before whole CPUs are asked for
CPU_UNITS = 10_000  # Ray counts a resource in 1/10,000ths: a bundle's fraction is rounded down to them


class RayWorker:
    """One tensor-parallel rank in a Ray actor (wrapped with ray.remote where used: Ray is optional)."""

    def where(self) -> tuple[str, str, int]:
        """(node id, node IP, CPUs this host has)."""
        import ray

        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(), len(os.sched_getaffinity(0))

    def gpu_ids(self) -> list:
        """The GPUs Ray gave this actor (as the host numbers them)."""
        import ray

        return ray.get_gpu_ids()

    def run(self, config: EngineConfig, rank: int, device_index: int | None) -> int:
        """Serve steps until rank 0 says stop or goes away; the exit code."""
        from engine.executor.worker_process import run_worker

        logging.basicConfig(level=os.environ.get("TOKENLOOM_LOG_LEVEL", "info").upper(),
                            format=f"%(asctime)s %(levelname)s [tp-rank {rank}] %(name)s: %(message)s")
        return run_worker(config, rank, device_index=device_index)


class RayExecutor(Executor):
    def make_workers(self, config: EngineConfig, device) -> Workers:
        return RayActors(config.world_size, device.type == "cuda", config.ray_num_cpus_per_worker)


def bundle_num_cpus(size: int, free_cpus: dict[str, float], node_id: str) -> float | None:
    """CPUs per bundle: the largest of 1, 1/2, ..., 1/size with which `size` bundles fit the nodes'
    free CPUs, bundle 0 on `node_id`; None if none fits.

    Why a fraction at all: a Ray CPU only places a rank; its threads are its host's cores, shared
    among the host's ranks (`RayActors.start`), so ranks sharing a Ray CPU lose nothing but the
    claim. A whole CPU each where there is room keeps a host from carrying more ranks than it has
    Ray CPUs (PACK fills a node before the next); a fraction lets TP x PP ranks onto a small
    cluster (CI's three one-CPU nodes carry TP=2 x PP=2 at 1/2: two nodes of two ranks)."""
    for k in range(1, size + 1):
        unit = CPU_UNITS // k
        num_slots = {node: round(free * CPU_UNITS) // unit for node, free in free_cpus.items()}
        if num_slots.get(node_id, 0) >= 1 and sum(num_slots.values()) >= size:
            return unit / CPU_UNITS
    return None


def settle_bundle_num_cpus(size: int, node_id: str, timeout_s: float = FREE_CPUS_SETTLE_S) -> float:
    """bundle_num_cpus over the nodes' free CPUs, asked again while none fits for up to `timeout_s`:
    the actors of an engine just shut down give their CPUs back a moment later, and a choice made
    before that would ask for more than the cluster has. 1 if none fits by then (the placement then
    waits for room, and times out saying so)."""
    deadline = time.monotonic() + timeout_s
    while True:
        num_cpus = bundle_num_cpus(size, free_cpus_by_node(), node_id)
        if num_cpus is not None:
            return num_cpus
        if time.monotonic() >= deadline:
            return 1.0
        time.sleep(CHECK_INTERVAL_S)


def free_cpus_by_node() -> dict[str, float]:
    """Each node's free Ray CPUs (Ray's public API gives the cluster's sum only, or per node
    through the dashboard, which a local instance does not start)."""
    from ray._private.state import available_resources_per_node

    return {node_id: resources.get("CPU", 0.0) for node_id, resources in available_resources_per_node().items()}


class RayActors(Workers):
    """Placed at construction, started by `start`."""

    def __init__(self, size: int, is_cuda: bool, num_cpus: float | None = None) -> None:
        self.is_started_ray = init_ray(size)
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.ray = ray
        self.is_cuda = is_cuda
        self.run_refs: dict = {}  # ObjectRef of each rank's `run` -> rank
        self.actors: list = []
        self.last_check_time = 0.0
        node_id = ray.get_runtime_context().get_node_id()
        self.node_ip = ray.util.get_node_ip_address()
        if num_cpus is None:
            num_cpus = settle_bundle_num_cpus(size, node_id)
        self.bundle = bundle = {"CPU": num_cpus, "GPU": 1.0} if is_cuda else {"CPU": num_cpus}
        # Bundle 0 on this node by its id (several nodes may share an IP: raylets on one host).
        this_node = [{"ray.io/node-id": node_id}] + [{} for _ in range(size - 1)]
        self.placement_group = placement_group([dict(bundle) for _ in range(size)], strategy="PACK",
                                               bundle_label_selector=this_node)
        if not ray.wait([self.placement_group.ready()], timeout=PLACEMENT_TIMEOUT_S)[0]:
            ray.util.remove_placement_group(self.placement_group)
            raise RuntimeError(f"the Ray cluster has no room for {size} bundles of {bundle} within "
                               f"{PLACEMENT_TIMEOUT_S:.0f} s (available: {ray.available_resources()})")
        remote_worker = ray.remote(RayWorker)
        group_name = self.placement_group.id.hex()[:12]
        self.seat = None  # bundle 0's placeholder (CUDA): it holds the GPU rank 0 uses
        if is_cuda:
            self.seat = remote_worker.options(
                num_cpus=0, num_gpus=1, max_restarts=0, runtime_env=actor_runtime_env(),
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.placement_group,
                                                                     placement_group_bundle_index=0),
            ).remote()
            import torch

            torch.cuda.set_device(int(ray.get(self.seat.gpu_ids.remote(), timeout=RENDEZVOUS_TIMEOUT_S)[0]))
        actors = [remote_worker.options(
            name=f"tp-worker-{group_name}-{i}", namespace=ACTOR_NAMESPACE,
            num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0), max_restarts=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(self.placement_group, placement_group_bundle_index=i),
            runtime_env=actor_runtime_env(),
        ).remote() for i in range(1, size)]
        try:
            places = ray.get([actor.where.remote() for actor in actors], timeout=RENDEZVOUS_TIMEOUT_S)
        except BaseException:
            self.actors = actors
            self.stop(0.0)
            raise
        # Ranks by node, this node's first: a host's ranks are neighbours, as under torchrun.
        order = sorted(range(len(actors)), key=lambda i: (places[i][0] != node_id, places[i][1], places[i][0]))
        self.actors = [actors[i] for i in order]  # rank r is self.actors[r - 1]
        self.places = [places[i] for i in order]
        hosts = [self.node_ip] + [ip for _, ip, _ in self.places]
        self.ranks_per_host = {ip: hosts.count(ip) for ip in hosts}
        logger.info("Ray placed %d ranks, bundles of %s: %s", size, bundle,
                    ", ".join(f"rank {r}: node {n[:8]} ({ip})" for r, (n, ip, _) in enumerate(self.places, 1)))

    def master_addr(self, config: EngineConfig) -> str:
        return LOOPBACK if set(self.ranks_per_host) == {self.node_ip} else self.node_ip

    def start(self, config: EngineConfig, model_path: str) -> None:
        for rank, (actor, (_, ip, num_cpus)) in enumerate(zip(self.actors, self.places), 1):
            # The host's CPUs shared among its ranks, as mp's threads_per_rank does.
            num_threads = config.num_threads or max(1, num_cpus // self.ranks_per_host[ip])
            rank_config = dataclasses.replace(config, model=model_path, num_threads=num_threads)
            self.run_refs[actor.run.remote(rank_config, rank, 0 if self.is_cuda else None)] = rank

    def find_dead(self) -> str | None:
        now = time.monotonic()
        if not self.run_refs or now - self.last_check_time < CHECK_INTERVAL_S:
            return None
        self.last_check_time = now
        done, _ = self.ray.wait(list(self.run_refs), num_returns=1, timeout=0)
        if not done:
            return None
        rank = self.run_refs[done[0]]
        try:
            outcome = f"exited with code {self.ray.get(done[0])}"
        except Exception as e:  # RayActorError: killed, or its node died
            outcome = f"died ({type(e).__name__}: {str(e).splitlines()[0][:200]})"
        return f"tensor-parallel worker rank {rank} (Ray actor on {self.places[rank - 1][1]}) {outcome}"

    def stop(self, grace_s: float) -> None:
        try:
            self._stop(grace_s)
        except Exception as e:  # Ray already shut down (interpreter exit): its actors went with it
            logger.warning("stopping the Ray workers: %s", e)

    def _stop(self, grace_s: float) -> None:
        if self.run_refs:
            self.ray.wait(list(self.run_refs), num_returns=len(self.run_refs), timeout=grace_s)
        for actor in [*self.actors, *([self.seat] if self.seat is not None else [])]:
            self.ray.kill(actor)
        self.ray.util.remove_placement_group(self.placement_group)
        self.run_refs.clear()
        if self.is_started_ray:
            self.ray.shutdown()
