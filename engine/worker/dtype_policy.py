"""Which dtype the engine runs in when not told: `dtype="auto"`.

Like vLLM's CPU build, an fp32 checkpoint runs in bf16 wherever the hardware
multiplies bf16 natively: it halves the bytes every matmul and every KV read
moves, and decode steps are bound by those bytes. "Natively" means AMX-BF16
tiles or AVX512_BF16 dot products; a CPU with neither (AVX2 only, say) would
emulate bf16 through fp32 conversions and gain nothing, so it stays in fp32.
CUDA GPUs run bf16. With `--quantization int8` the matmul weights are int8 whatever the
dtype, and the activations stay in fp32: bf16's rounding of every activation and of the
residual stream, on top of int8's, sends greedy answers elsewhere (SmolLM2 stops naming
Paris), and the bytes bf16 would save are the activations' and KV's, not the weights'.

The KV cache has a dtype of its own (`kv_cache_dtype="auto"`): the activations', except
beside int8 or int4 weights' fp32 activations on a CPU that multiplies bf16 natively,
where K and V are stored, and attention runs, in bf16 as a bf16 model's do. A decode step
reads every context token's K and V, so fp32 there doubled the attention's reads (a fifth
of a batched int8 run's time) and halved the tokens the pool holds; the rounding is the
bf16 model's, on attention alone, and the residual stream and matmuls stay as they were.

The decision is a pure function of the detected capabilities, so it is tested
on faked ones; engine.cpu.host's `detect_cpu_features` is the only part that looks at the machine.
"""

from __future__ import annotations

from engine.cpu.host import CpuFeatures
from ipc.engine_config import AUTO_DTYPE as AUTO, DTYPE_NAMES  # declared with the engine flags


def choose_dtype(requested: str | None, device_type: str, cpu: CpuFeatures,
                 quantization: str | None = None) -> tuple[str, str]:
    """(dtype name, why): an explicit float32/bfloat16/float16 wins; None or "auto" decides by
    device and quantization."""
    if requested not in (None, AUTO):
        if requested not in DTYPE_NAMES:
            raise ValueError(f"dtype must be one of {(AUTO, *DTYPE_NAMES)}, got {requested!r}")
        return requested, "requested"
    if quantization in ("int8", "int4"):
        return "float32", f"auto: {quantization} weights, fp32 activations (bf16 on top of int8 drifts too far)"
    if device_type == "cuda":
        return "bfloat16", "auto: CUDA"
    if cpu.has_amx_bf16:
        return "bfloat16", "auto: the CPU has AMX-BF16"
    if cpu.has_avx512_bf16:
        return "bfloat16", "auto: the CPU has AVX512_BF16"
    return "float32", "auto: the CPU has no native bf16 matmul (neither AMX-BF16 nor AVX512_BF16)"


def choose_kv_cache_dtype(requested: str | None, dtype: str, device_type: str, cpu: CpuFeatures,
                          quantization: str | None = None) -> tuple[str, str]:
    """(KV cache dtype name, why), given the activations' dtype name: an explicit choice wins;
    "auto" is the activations' dtype, or bf16 beside quantized weights (see the module's note)."""
    if requested not in (None, AUTO):
        if requested not in DTYPE_NAMES:
            raise ValueError(f"kv_cache_dtype must be one of {(AUTO, *DTYPE_NAMES)}, got {requested!r}")
        return requested, "requested"
    if (quantization in ("int8", "int4") and dtype == "float32" and device_type == "cpu"
            and (cpu.has_amx_bf16 or cpu.has_avx512_bf16)):
        return "bfloat16", f"auto: beside {quantization} weights, half fp32's bytes for every KV read"
    return dtype, "auto: the activations' dtype"
