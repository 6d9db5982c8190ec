"""The plan for `--quantization int8|int4`: which kernels run the quantized matmuls on this CPU,
checked against the layouts they take.

- With AVX512_VNNI: our vpdpbusd kernels (both schemes in one extension,
  engine/cpu/csrc/quantized/), on the panels int8_linear.py and int4_linear.py pack.
- Without it, on AVX2 + FMA + F16C: the weights are quantized into llama.cpp blocks
  (int4 -> Q4_1, the very rounding the int4 panels hold; int8 -> Q8_0) and run on the GGUF
  block kernels (engine/cpu/gguf_linear.py, engine/cpu/block_quantize.py). docs/cpu-kernels.md
  has the measurement behind Q4_1 (and why not Q4_0, or Q4_K yet).
- With neither, quantization is refused with a message saying so.

The choice is a pure function of the CPU's features and of the block types the GGUF kernels
run here (tested on faked ones).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

PANEL = 32  # output rows per panel, both schemes (the kernels' kPanel)
INT8_GROUP = 64  # int8: inputs per scale (the kernel's kGroup)
INT4_BLOCK = 32  # int4: inputs per (d, m), and per activation scale (the kernel's kBlock)
SCHEMES = ("int8", "int4")
# Without VNNI, each scheme's llama.cpp block type: Q4_1 is int4's own format (w = d q + m, blocks
# of 32, rounded as quantize_row_q4_1_ref), so both paths hold the same weights; Q8_0 is int8 in
# blocks of 32 with an fp16 scale (the VNNI path's groups are 64 with an fp32 one).
BLOCK_TYPE_OF_SCHEME = {"int4": "Q4_1", "int8": "Q8_0"}


@dataclass(frozen=True)
class QuantizedPlan:
    """The quantized kernels' module and the scheme: "int8" (int8_linear.py) or "int4"
    (int4_linear.py); or, where `block_type` is set, the GGUF block kernels on that llama.cpp
    type (`kernels` is then None: gguf_linear.py loads its own)."""

    kernels: ModuleType | None
    scheme: str = "int8"
    block_type: str | None = None  # "Q4_1" or "Q8_0": AVX2's path, no VNNI


def check_quantization_supported(device_type: str, has_avx512_vnni: bool, scheme: str = "int8",
                                 block_types: frozenset[str] = frozenset()) -> str | None:
    """Raise, saying why, where int8 or int4 cannot run; else the llama.cpp block type the AVX2
    path takes (None: the VNNI kernels). `block_types`: the GGUF kernels' types on this CPU."""
    if device_type != "cpu":
        raise ValueError(f"quantization={scheme!r} runs on the CPU only (our vpdpbusd and AVX2 kernels)")
    if has_avx512_vnni:
        return None
    block_type = BLOCK_TYPE_OF_SCHEME[scheme]
    if block_type not in block_types:
        raise ValueError(f"quantization={scheme!r} needs a CPU with AVX512_VNNI (vpdpbusd) or with AVX2, FMA "
                         "and F16C (the GGUF block kernels); this CPU has neither: run without --quantization "
                         "(bf16 or fp32)")
    return block_type


def plan_quantization(device_type: str, has_avx512_vnni: bool, scheme: str = "int8",
                      block_types: frozenset[str] | None = None) -> QuantizedPlan:
    """The plan; `block_types` None: asked of the GGUF kernels (built on first use) when VNNI is missing."""
    if block_types is None and not has_avx512_vnni and device_type == "cpu":
        from engine.cpu.gguf_linear import kernel_types

        block_types = kernel_types()
    block_type = check_quantization_supported(device_type, has_avx512_vnni, scheme, block_types or frozenset())
    if block_type is not None:
        return QuantizedPlan(None, scheme=scheme, block_type=block_type)
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
