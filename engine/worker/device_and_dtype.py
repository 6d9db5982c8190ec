"""The device, dtype and KV cache dtype a `ModelRunner` for a config runs in, and one KV
block's bytes: the engine core sizes the KV pool from them before any runner exists.
The choices for "auto" are engine.worker.dtype_policy's; this module turns them into torch dtypes.
"""

from __future__ import annotations

import torch

from engine.config import EngineConfig
from engine.parallel.parallel_layers import num_local_kv_heads
from engine.cpu.host import CpuFeatures, detect_cpu_features
from engine.worker.dtype_policy import choose_dtype, choose_kv_cache_dtype
from engine.models.config import ModelConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(config: EngineConfig) -> torch.device:
    """cuda when present, else cpu, unless the config names one."""
    return torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))


def resolve_dtype(config: EngineConfig, device: torch.device, cpu: CpuFeatures) -> tuple[torch.dtype, str]:
    """(dtype, why): as asked, or by engine.worker.dtype_policy for "auto"."""
    name, reason = choose_dtype(config.dtype, device.type, cpu, config.quantization)
    return DTYPES[name], reason


def resolve_kv_cache_dtype(config: EngineConfig, device: torch.device, cpu: CpuFeatures,
                           dtype: torch.dtype) -> tuple[torch.dtype, str]:
    """(KV cache dtype, why) beside activations in `dtype`: as asked, or by engine.worker.dtype_policy for "auto"."""
    name, reason = choose_kv_cache_dtype(config.kv_cache_dtype, str(dtype).removeprefix("torch."), device.type, cpu,
                                         config.quantization)
    if DTYPES[name] != dtype and config.compile:
        raise ValueError("a KV cache dtype other than the activations' is not supported with compile")
    return DTYPES[name], reason


def cpu_features_of(device: torch.device) -> CpuFeatures:
    """The host CPU's bf16 support where the engine runs on it; none on a GPU."""
    return detect_cpu_features() if device.type == "cpu" else CpuFeatures()


def resolve_device_and_dtype(config: EngineConfig) -> tuple[torch.device, torch.dtype]:
    """The device and dtype a ModelRunner for `config` runs in."""
    device = resolve_device(config)
    return device, resolve_dtype(config, device, cpu_features_of(device))[0]


def resolve_kv_pool_dtype(config: EngineConfig) -> tuple[torch.device, torch.dtype]:
    """The device and KV pool dtype of a ModelRunner for `config` (the engine core sizes the pool by them)."""
    device, dtype = resolve_device_and_dtype(config)
    return device, resolve_kv_cache_dtype(config, device, cpu_features_of(device), dtype)[0]


def kv_bytes_per_block(model_config: ModelConfig, block_size: int, dtype: torch.dtype, tp_size: int = 1) -> int:
    """One block's K and V over every layer, on one rank (which holds its share of the KV heads)."""
    element_size = torch.tensor([], dtype=dtype).element_size()
    num_kv_heads = num_local_kv_heads(model_config.num_kv_heads, tp_size)
    return 2 * model_config.num_layers * block_size * num_kv_heads * model_config.head_dim * element_size
