"""Which attention backend a runner uses, chosen once at start-up: Triton on CUDA, the C++
kernel backend on the CPU (the plain torch one where it cannot be built, and for bf16 on a CPU
without AVX512_BF16, where the kernels' bf16 path drifts from fp32 further than transformers'
bf16 does: tests/models/test_bf16_fidelity.py)."""

from __future__ import annotations

import logging
from types import ModuleType

import torch

from engine.attention import BACKEND_NAMES
from engine.attention.backend import AttentionBackend
from engine.attention.metadata import NO_WINDOW
from engine.cpu.host import CpuFeatures

logger = logging.getLogger(__name__)


def resolve_attention_backend(name: str | None, device_type: str, dtype: torch.dtype | None,
                              cpu: CpuFeatures) -> str:
    """The backend's name: `name` if given, else the default for this device, dtype and CPU."""
    if name is not None:
        if name not in BACKEND_NAMES:
            raise ValueError(f"attention backend must be one of {BACKEND_NAMES}, got {name!r}")
        return name
    if device_type == "cuda":
        return "triton"
    if dtype == torch.bfloat16 and not cpu.has_avx512_bf16:
        logger.info("bf16 on a CPU without AVX512_BF16: attention runs the torch backend")
        return "torch"
    from engine.cpu.extension import load_cpu_kernels_or_none

    # No compiler, say: the torch path does the same work, slower.
    return "cpu" if load_cpu_kernels_or_none("attention runs the torch backend") is not None else "torch"


def make_attention_backend(name: str, block_size: int, windows: tuple[int, ...] = (NO_WINDOW,),
                           kernels: ModuleType | None = None) -> AttentionBackend:
    """`windows`: the sliding windows the model's layers use; `kernels`: the C++ module, for
    a torch backend to store K/V fused with rotary (the cpu backend always has it)."""
    if name == "torch":
        from engine.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend(block_size, windows, kernels)
    if name == "cpu":
        from engine.attention.cpu_backend import CpuAttentionBackend

        return CpuAttentionBackend(kernels if kernels is not None else _load_kernels(), block_size, windows)
    if name == "triton":
        from engine.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    raise ValueError(f"attention backend must be one of {BACKEND_NAMES}, got {name!r}")


def _load_kernels() -> ModuleType:
    from engine.cpu.extension import load_cpu_kernels

    return load_cpu_kernels()
