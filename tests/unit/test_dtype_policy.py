"""dtype="auto" and kv_cache_dtype="auto": the decisions on faked CPU capabilities, and what
the engine config accepts."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.worker.device_and_dtype import resolve_device, resolve_dtype
from engine.cpu.host import CpuFeatures, detect_cpu_features
from engine.worker.dtype_policy import choose_dtype, choose_kv_cache_dtype

AMX = CpuFeatures(has_amx_bf16=True, has_avx512_bf16=True)  # Sapphire Rapids
AVX512_BF16_ONLY = CpuFeatures(has_avx512_bf16=True)  # Cooper Lake, Zen 4
AVX2_ONLY = CpuFeatures()  # no native bf16 dot product


@pytest.mark.parametrize("requested", [None, "auto"])
@pytest.mark.parametrize(
    "device_type, cpu, want",
    [
        ("cpu", AMX, "bfloat16"),
        ("cpu", AVX512_BF16_ONLY, "bfloat16"),
        ("cpu", AVX2_ONLY, "float32"),
        ("cuda", AVX2_ONLY, "bfloat16"),  # the host CPU does not matter on a GPU
    ],
)
def test_auto_picks_bf16_only_where_it_is_native(requested, device_type, cpu, want):
    dtype, reason = choose_dtype(requested, device_type, cpu)
    assert dtype == want
    assert reason.startswith("auto")


def test_auto_says_why():
    assert "AMX-BF16" in choose_dtype("auto", "cpu", AMX)[1]
    assert "AVX512_BF16" in choose_dtype("auto", "cpu", AVX512_BF16_ONLY)[1]
    assert "no native bf16" in choose_dtype("auto", "cpu", AVX2_ONLY)[1]


@pytest.mark.parametrize("cpu", [AMX, AVX512_BF16_ONLY])
def test_auto_keeps_fp32_activations_under_int8_weights(cpu):
    dtype, reason = choose_dtype("auto", "cpu", cpu, quantization="int8")
    assert dtype == "float32" and "int8" in reason
    assert choose_dtype("bfloat16", "cpu", cpu, quantization="int8") == ("bfloat16", "requested")


@pytest.mark.parametrize("quantization", ["int8", "int4"])
@pytest.mark.parametrize("cpu", [AMX, AVX512_BF16_ONLY])
def test_auto_kv_cache_is_bf16_beside_quantized_weights_on_native_bf16(quantization, cpu):
    kv, reason = choose_kv_cache_dtype("auto", "float32", "cpu", cpu, quantization)
    assert kv == "bfloat16" and quantization in reason


@pytest.mark.parametrize(
    "dtype, device_type, cpu, quantization",
    [
        ("float32", "cpu", AVX2_ONLY, "int8"),  # bf16 would be emulated: no gain
        ("bfloat16", "cpu", AMX, "int8"),  # --dtype bfloat16 asked for: already bf16
        ("float32", "cpu", AMX, None),  # fp32 asked for, no quantization: everything fp32
        ("bfloat16", "cpu", AVX512_BF16_ONLY, None),
        ("float32", "cuda", AVX2_ONLY, None),
    ],
)
def test_auto_kv_cache_is_otherwise_the_activations_dtype(dtype, device_type, cpu, quantization):
    assert choose_kv_cache_dtype(None, dtype, device_type, cpu, quantization) == (dtype, "auto: the activations' dtype")


def test_an_explicit_kv_cache_dtype_overrides():
    assert choose_kv_cache_dtype("float32", "float32", "cpu", AMX, "int8") == ("float32", "requested")
    assert choose_kv_cache_dtype("bfloat16", "float32", "cpu", AVX2_ONLY, None) == ("bfloat16", "requested")
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        choose_kv_cache_dtype("fp8", "float32", "cpu", AMX)
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineConfig(kv_cache_dtype="fp8")


@pytest.mark.parametrize("requested", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("device_type, cpu", [("cpu", AMX), ("cpu", AVX2_ONLY), ("cuda", AMX)])
def test_an_explicit_dtype_overrides(requested, device_type, cpu):
    assert choose_dtype(requested, device_type, cpu) == (requested, "requested")


def test_unknown_dtype_is_rejected():
    with pytest.raises(ValueError, match="dtype must be one of"):
        choose_dtype("fp8", "cpu", AMX)
    with pytest.raises(ValueError, match="dtype must be one of"):
        EngineConfig(dtype="float64")


def test_default_config_is_auto_and_follows_this_machine():
    assert EngineConfig().dtype == "auto"
    features = detect_cpu_features()
    want = torch.bfloat16 if (features.has_amx_bf16 or features.has_avx512_bf16) else torch.float32
    device = resolve_device(EngineConfig(device="cpu"))
    dtype, reason = resolve_dtype(EngineConfig(device="cpu"), device, features)
    assert (device.type, dtype) == ("cpu", want) and reason.startswith("auto")
    assert resolve_dtype(EngineConfig(device="cpu", dtype="float32"), device, features)[0] == torch.float32


def test_detected_features_agree_with_proc_cpuinfo():
    try:
        flags = {f for line in open("/proc/cpuinfo") if line.startswith("flags") for f in line.split(":", 1)[1].split()}
    except OSError:
        pytest.skip("no /proc/cpuinfo")
    if not flags:
        pytest.skip("/proc/cpuinfo lists no flags (not x86)")
    features = detect_cpu_features()
    assert features.has_amx_bf16 == ("amx_bf16" in flags)
    assert features.has_avx512_bf16 == ("avx512_bf16" in flags)
