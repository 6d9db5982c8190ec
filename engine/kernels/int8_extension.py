"""Builds and loads the int8 matmul kernel (engine/kernels/cpu_int8/int8_linear.cpp).

A module of its own, beside engine/kernels/cpu_extension.py's (same compiler flags, same
per-CPU cache folders): it is only needed with `--quantization int8`, and editing it
rebuilds it alone (seconds) rather than every kernel (minutes)."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

from engine.kernels.cpu_extension import load_extension

SOURCES = [Path(__file__).parent / "cpu_int8" / "int8_linear.cpp"]

_module: ModuleType | None = None


def load_int8_kernels() -> ModuleType:
    """The compiled module; raises if this machine cannot build it (no compiler, say)."""
    global _module
    if _module is None:
        _module = load_extension("tokenloom_int8_kernels", SOURCES, [])
    return _module
