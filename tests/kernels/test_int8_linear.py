"""int8 W8A8 linears (engine/kernels/cpu_int8/int8_linear.cpp, engine/models/int8_linear.py):
the kernel against an fp32 matmul of the dequantized weights and activations, at every
kind of step size and odd shapes; the plan on faked CPU features; the model's memory."""

import pytest
import torch

from engine.dtype_policy import CpuFeatures
from engine.models.int8_linear import Int8Linear, check_int8_supported, pack_panels, quantize_weight, unpack_rows
from ipc.engine_config import EngineConfig

try:
    from engine.models.int8_linear import plan_int8

    PLAN = plan_int8("cpu", CpuFeatures(has_avx512_vnni=True).has_avx512_vnni)
except Exception as exc:  # no VNNI or no compiler: the refusal tests below still run
    PLAN = None
    SKIP_REASON = str(exc)
needs_kernel = pytest.mark.skipif(PLAN is None, reason="no int8 kernel on this CPU")


def dequantized_reference(x, weight):
    """fp32 matmul of the kernel's own quantized activations and the dequantized weights."""
    q, scales = quantize_weight(weight)
    num_quads = -(-x.shape[1] // 4)
    x_bytes, x_scales = PLAN.kernels.quantize_activations(x, num_quads)
    xq = (x_bytes[:, : x.shape[1]].int() - 128).double() * x_scales.double()[:, None]
    return (xq @ (q.double() * scales.double()[:, None]).t()).float()  # [num_tokens, out_features]


def test_refused_without_vnni():
    with pytest.raises(ValueError, match="AVX512_VNNI"):
        check_int8_supported("cpu", CpuFeatures(has_avx512_bf16=True).has_avx512_vnni)
    with pytest.raises(ValueError, match="CPU only"):
        check_int8_supported("cuda", True)


def test_config_checks_the_quantization():
    assert EngineConfig().quantization is None  # bf16 (the dtype policy's choice) stays the default
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(quantization="int3")
    with pytest.raises(ValueError, match="compile"):
        EngineConfig(quantization="int8", compile=True)


def test_panels_hold_each_features_quads_and_read_back():
    weight = torch.randn(40, 10)
    q, scales = quantize_weight(weight)
    packed = pack_panels(q, scales)
    assert packed.panels.shape == (2, 3, 32)  # 40 features -> 64, 10 inputs -> 3 quads
    assert torch.equal(unpack_rows(packed, torch.arange(40)), q)
    assert packed.compensation[:40].tolist() == (128 * q.int().sum(1)).tolist()
    assert (q.float() * scales[:, None] - weight).abs().max() <= scales.max() / 2 + 1e-6


@needs_kernel
@pytest.mark.parametrize("num_tokens", [1, 2, 3, 8, 9, 15, 16, 17, 31, 64, 127, 1024])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_matches_the_dequantized_matmul(num_tokens, dtype):
    gen = torch.Generator().manual_seed(num_tokens)
    weight = torch.randn(96, 128, generator=gen)
    x = torch.randn(num_tokens, 128, generator=gen).to(dtype)
    out = Int8Linear(weight, None, PLAN)(x)
    assert out.shape == (num_tokens, 96) and out.dtype == dtype
    expected = dequantized_reference(x, weight)
    # Integer sums are exact: only the epilogue's fp32 scaling and the output's rounding differ.
    rtol = 2**-8 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(out.float(), expected, atol=1e-3, rtol=rtol)


@needs_kernel
@pytest.mark.parametrize("shape", [(1, 17, 5), (7, 33, 70), (5, 65, 130), (3, 31, 1), (9, 1, 8), (2, 100, 577)])
def test_odd_shapes_with_bias_and_fp32_logits(shape):
    num_tokens, out_features, in_features = shape
    gen = torch.Generator().manual_seed(out_features)
    weight = torch.randn(out_features, in_features, generator=gen)
    bias = torch.randn(out_features, generator=gen)
    x = torch.randn(num_tokens, in_features, generator=gen).bfloat16()
    linear = Int8Linear(weight, bias, PLAN)
    linear.out_fp32 = True
    out = linear(x)
    assert out.dtype == torch.float32 and out.shape == (num_tokens, out_features)
    torch.testing.assert_close(out, dequantized_reference(x, weight) + bias, atol=1e-4, rtol=1e-5)


@needs_kernel
def test_close_to_the_unquantized_matmul():
    gen = torch.Generator().manual_seed(0)
    weight, x = torch.randn(64, 256, generator=gen), torch.randn(4, 256, generator=gen)
    out = Int8Linear(weight, None, PLAN)(x)
    exact = x @ weight.t()
    assert (out - exact).abs().max() < 0.02 * exact.abs().max()  # two 8-bit roundings per product


@needs_kernel
@pytest.mark.slow
def test_default_model_int8_memory_and_answer(default_model_path):
    from engine import LLM, SamplingParams

    llm = LLM(default_model_path, quantization="int8")
    runner = llm.engine.model_runner
    model = runner.model
    resident = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    bf16_bytes = 2 * runner.num_params
    assert resident <= 0.55 * bf16_bytes, (resident, bf16_bytes)
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=30))
    assert out[0].token_ids  # fidelity: see the report (per-channel int8 does not yet answer "Paris")
