"""A real Ray cluster on this machine for the Ray tests: `ray.cluster_utils.Cluster`, nodes of
one CPU each (at most three, so CI's two cores carry it), one per test module."""

from __future__ import annotations

import contextlib
import os
from types import SimpleNamespace

import pytest

NODE_ARGS = {"num_cpus": 1, "object_store_memory": 80 * 1024 * 1024}


def import_ray():
    """Ray, or a skip where it is not installed (a failure under CI, where requirements-cpu.txt has it)."""
    try:
        import ray
    except ImportError:
        if os.environ.get("CI"):
            pytest.fail("ray is not installed (requirements-cpu.txt lists ray[default])")
        pytest.skip("ray is not installed: pip install tokenloom[ray]")
    return ray


@contextlib.contextmanager
def local_cluster(num_nodes: int):
    """`num_nodes` one-CPU nodes (the head with the dashboard, for ray.util.state), this
    process connected as a driver; RAY_ADDRESS set so that processes we start join it."""
    ray = import_ray()
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args=NODE_ARGS)
    old_address = os.environ.get("RAY_ADDRESS")
    try:
        for _ in range(num_nodes - 1):
            cluster.add_node(**NODE_ARGS)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, logging_level="WARNING")
        os.environ["RAY_ADDRESS"] = cluster.address
        yield cluster
    finally:
        if old_address is None:
            os.environ.pop("RAY_ADDRESS", None)
        else:
            os.environ["RAY_ADDRESS"] = old_address
        ray.shutdown()
        cluster.shutdown()


def alive_actors() -> list:
    """Every actor the cluster still holds alive (what a test must not leave behind), each with
    `class_name`, `name` and `pid`. Through ray.util.state, which asks the head's dashboard; on a loaded
    machine the dashboard can be late or gone, so then from the GCS's own actor table."""
    from ray.util.state import list_actors

    try:
        return list_actors(filters=[("state", "=", "ALIVE")], raise_on_missing_output=False)
    except ConnectionError:
        import ray

        return [SimpleNamespace(class_name=actor["ActorClassName"], name=actor["Name"], pid=actor["Pid"])
                for actor in ray._private.state.actors().values() if actor["State"] == "ALIVE"]
