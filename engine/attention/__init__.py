"""Attention backends, chosen once at start-up: Triton on CUDA, the C++ kernel backend on
the CPU (the plain torch one where it cannot be built, and for bf16 on a CPU without
AVX512_BF16, where the kernels' bf16 path drifts from fp32 further than transformers' bf16
does: tests/test_bf16_fidelity.py)."""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

BACKEND_NAMES = ("torch", "cpu", "triton")


def get_attention_backend(name: str | None, device_type: str, dtype=None):
    if name is None:
        if device_type == "cuda":
            name = "triton"
        elif _is_bf16_without_avx512_bf16(dtype):
            logger.info("bf16 on a CPU without AVX512_BF16: attention runs the torch backend")
            name = "torch"
        else:
            try:
                return _cpu_backend()
            except Exception as exc:  # no compiler, say: the torch path does the same work, slower
                logger.warning("CPU attention kernels unavailable (%s); using the torch backend", exc)
                name = "torch"
    if name == "torch":
        from engine.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend()
    if name == "cpu":
        return _cpu_backend()
    if name == "triton":
        from engine.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    raise ValueError(f"attention backend must be one of {BACKEND_NAMES}, got {name!r}")


def _is_bf16_without_avx512_bf16(dtype) -> bool:
    import torch

    from engine.dtype_policy import detect_cpu_features

    return dtype == torch.bfloat16 and not detect_cpu_features().has_avx512_bf16


def _cpu_backend():
    from engine.attention.cpu_backend import CpuAttentionBackend
    from engine.kernels.cpu_extension import load_cpu_kernels

    return CpuAttentionBackend(load_cpu_kernels())
