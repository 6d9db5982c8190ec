"""The plan for `--quantization int8|int4`: the quantized kernels' module (both schemes' kernels
are in one extension, engine/cpu/csrc/quantized/), checked against this CPU and against the
layouts int8_linear.py and int4_linear.py pack.

The plan is a pure function of the CPU's features (tested on faked ones): the kernels need
AVX512_VNNI; without it, quantization is refused with a message saying so.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

PANEL = 32  # output rows per panel, both schemes (the kernels' kPanel)
INT8_GROUP = 64  # int8: inputs per scale (the kernel's kGroup)
INT4_BLOCK = 32  # int4: inputs per (d, m), and per activation scale (the kernel's kBlock)
SCHEMES = ("int8", "int4")


@dataclass(frozen=True)
class QuantizedPlan:
    """The quantized kernels' module and the scheme: "int8" (int8_linear.py) or "int4"
    (int4_linear.py)."""

    kernels: ModuleType
    scheme: str = "int8"


def check_quantization_supported(device_type: str, has_avx512_vnni: bool, scheme: str = "int8") -> None:
    """Raise, saying why, where int8 or int4 (the same instructions) cannot run."""
    if device_type != "cpu":
        raise ValueError(f"quantization={scheme!r} runs on the CPU only (our vpdpbusd kernel)")
    if not has_avx512_vnni:
        raise ValueError(f"quantization={scheme!r} needs a CPU with AVX512_VNNI (vpdpbusd); this CPU has none: "
                         "run without --quantization (bf16 or fp32)")


def plan_quantization(device_type: str, has_avx512_vnni: bool, scheme: str = "int8") -> QuantizedPlan:
    check_quantization_supported(device_type, has_avx512_vnni, scheme)
    from engine.cpu.quantized_extension import load_quantized_kernels

    kernels = load_quantized_kernels()
    if not kernels.has_int8_linear():  # built without VNNI: the compiler's target disagrees with the probe
        raise ValueError(f"quantization={scheme!r}: the kernel was built without AVX512_VNNI on this CPU")
    # the packing in int8_linear.py and int4_linear.py and the kernels must agree
    if kernels.group_size() != INT8_GROUP:
        raise ValueError(f"quantization={scheme!r}: the kernel's groups are {kernels.group_size()} inputs, not {INT8_GROUP}")
    if kernels.q4_block_size() != INT4_BLOCK:
        raise ValueError(f"quantization={scheme!r}: the int4 kernel's blocks are {kernels.q4_block_size()} inputs, "
                         f"not {INT4_BLOCK}")
    return QuantizedPlan(kernels, scheme=scheme)
