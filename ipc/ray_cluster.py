"""How our processes join one Ray cluster: the engine's tensor-parallel executor
(engine.executor.ray_executor) and the frontend's data-parallel cores (frontend.ray_engines)
both come through here. Ray is an optional extra; no torch here.

    init_ray          RAY_ADDRESS, or the cluster `ray start` made on this host; else a local one
    actor_runtime_env the actors import the code this process runs (its checkout) and keep our
                      log level and model cache
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

RAY_INSTALL_HINT = "pip install tokenloom[ray]"
# The checkout this process runs: actors import the same code (a host joining the cluster
# needs tokenloom at the same path, docs/scale-out.md).
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# TOKENLOOM_TEST_STAGE_DELAY: engine.executor.worker_process's test hook (a slow stage on purpose).
PASSED_ENV_VARS = ("TOKENLOOM_LOG_LEVEL", "TOKENLOOM_CACHE", "TOKENLOOM_TEST_STAGE_DELAY")


def import_ray():
    """Ray, or a RuntimeError that says how to install it."""
    try:
        import ray
    except ImportError as e:
        raise RuntimeError(f"--distributed-executor-backend ray needs Ray, which is not installed: "
                           f"{RAY_INSTALL_HINT}") from e
    return ray


def init_ray(min_num_cpus: int = 1) -> bool:
    """Connect to a running cluster; without one, start a local instance with at least
    `min_num_cpus` logical CPUs. True when it started one (its owner shuts it down)."""
    ray = import_ray()
    if ray.is_initialized():
        return False
    try:
        ray.init(address="auto", logging_level=logging.WARNING)
        return False
    except ConnectionError:
        logger.info("no running Ray cluster (RAY_ADDRESS, `ray start`): starting a local one")
    # No dashboard: this instance lives and dies with its owner, and its agents cost CPU every step.
    ray.init(num_cpus=max(os.cpu_count() or 1, min_num_cpus), include_dashboard=False, logging_level=logging.WARNING)
    return True


def actor_runtime_env() -> dict:
    python_path = os.pathsep.join(filter(None, [REPO_ROOT, os.environ.get("PYTHONPATH")]))
    env_vars = {"PYTHONPATH": python_path}
    env_vars.update({name: os.environ[name] for name in PASSED_ENV_VARS if name in os.environ})
    return {"env_vars": env_vars}
