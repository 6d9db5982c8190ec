"""The executor `--distributed-executor-backend` names: mp (engine/executor/executor.py)
or ray (engine/executor/ray_executor.py, an optional extra, imported only when named)."""

from __future__ import annotations

from engine.executor.executor import Executor, MultiprocExecutor
from ipc.engine_config import EngineConfig


def make_executor(config: EngineConfig, model_config, num_kv_blocks: int, max_model_len: int, device) -> Executor:
    """The executor `config.distributed_executor_backend` names."""
    if config.distributed_executor_backend == "ray":
        from engine.executor.ray_executor import RayExecutor  # Ray is an optional extra

        return RayExecutor(config, model_config, num_kv_blocks, max_model_len, device)
    return MultiprocExecutor(config, model_config, num_kv_blocks, max_model_len, device)
