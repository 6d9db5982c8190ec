"""Attention backends, chosen once at start-up: Triton on CUDA, torch on the CPU."""

from __future__ import annotations

BACKEND_NAMES = ("torch", "triton")


def get_attention_backend(name: str | None, device_type: str):
    if name is None:
        name = "triton" if device_type == "cuda" else "torch"
    if name == "torch":
        from engine.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend()
    if name == "triton":
        from engine.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    raise ValueError(f"attention backend must be one of {BACKEND_NAMES}, got {name!r}")
