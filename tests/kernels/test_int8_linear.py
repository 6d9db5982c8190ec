"""int8 W8A8 linears (engine/cpu/csrc/quantized/int8_linear.cpp, engine/cpu/int8_linear.py):
the activations' quantization against torch's, the kernel against an fp32 matmul of the
dequantized weights and activations at every step size and odd shapes, the panels read
back, the plan on faked CPU features and the config's checks."""

import pytest
import torch

from engine.cpu.host import CpuFeatures
from engine.cpu.int8_linear import (GGUF_GROUP, GROUP, Int8Linear, dequantize_rows, gather_panels_on_huge_pages,
                                     pack_panels, quantize_weight, unpack_rows)
from ipc.engine_config import EngineConfig

from engine.cpu.host import detect_cpu_features
from engine.cpu.quantized_plan import check_quantization_supported, plan_quantization
from tests.helpers.prefetch_switch import outputs_both_ways

# Without VNNI the refusal and packing tests below still run; with it the kernel must build
# (a build failure fails here rather than skipping the kernel's tests).
PLAN = plan_quantization("cpu", True) if detect_cpu_features().has_avx512_vnni else None
needs_kernel = pytest.mark.skipif(PLAN is None, reason="int8 needs AVX512_VNNI, which this CPU lacks")


def dequantized_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """fp64 matmul of the kernel's own quantized activations and the dequantized weights."""
    q, scales = quantize_weight(weight)  # [out, num_groups * 64] int8, [out, num_groups]
    num_groups = scales.shape[1]
    x_bytes, x_scales, _ = PLAN.kernels.quantize_activations(x, num_groups)
    xq = x_bytes.double().view(len(x), num_groups, GROUP) * x_scales.double()[:, :, None]
    wq = q.double().view(len(q), num_groups, GROUP) * scales.double()[:, :, None]
    return (xq.flatten(1) @ wq.flatten(1).t()).float()  # [num_tokens, out_features]


def test_refused_without_vnni():
    with pytest.raises(ValueError, match="AVX512_VNNI"):
        check_quantization_supported("cpu", CpuFeatures(has_avx512_bf16=True).has_avx512_vnni)
    with pytest.raises(ValueError, match="CPU only"):
        check_quantization_supported("cuda", True)


def test_config_checks_the_quantization():
    assert EngineConfig().quantization is None  # bf16 (the dtype policy's choice) stays the default
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(quantization="int3")
    with pytest.raises(ValueError, match="compile"):
        EngineConfig(quantization="int8", compile=True)


def test_weights_quantize_per_group_and_read_back_from_the_panels():
    weight = torch.randn(40, 70)
    weight[3, 5] = 50.0  # an outlier coarsens its own group only
    q, scales = quantize_weight(weight)
    assert q.shape == (40, 128) and scales.shape == (40, 2)
    assert not q[:, 70:].any()  # K padded with zeros to the group
    assert scales[3, 0] == 50.0 / 127 and scales[3, 1] < 1.0
    packed = pack_panels(q, scales, 70)
    assert packed.panels.shape == (2, 32, 32) and packed.scales.shape == (2, 2, 32)  # 40 rows -> 64
    rows = torch.arange(40)
    q_back, scales_back = unpack_rows(packed, rows)
    assert torch.equal(q_back, q[:, :70]) and torch.equal(scales_back, scales)
    error = (dequantize_rows(packed, rows) - weight).abs()  # [40, 70]
    assert (error <= scales.repeat_interleave(GROUP, dim=1)[:, :70] / 2 + 1e-6).all()


@needs_kernel
@pytest.mark.parametrize("in_features", [1, 63, 64, 65, 577])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_activations_quantize_per_group_as_torch_does(in_features, dtype):
    x = torch.randn(5, in_features, generator=torch.Generator().manual_seed(in_features)).to(dtype)
    x[2, 0] = 40.0
    x[4] = 0.0  # an all-zero token: scale 1, no division by zero
    num_groups = -(-in_features // GROUP)
    q, scales, corrections = PLAN.kernels.quantize_activations(x, num_groups)
    padded = torch.zeros(5, num_groups * GROUP)
    padded[:, :in_features] = x.float()
    groups = padded.view(5, num_groups, GROUP)
    max_abs = groups.abs().amax(2)  # [5, num_groups]
    inverse = torch.where(max_abs > 0, 127 / max_abs, torch.zeros_like(max_abs))
    expected = torch.round(groups * inverse[:, :, None]).to(torch.int8).flatten(1)
    # -ffast-math divides by 127 as a product with 1 / 127: within an ulp.
    torch.testing.assert_close(scales, torch.where(max_abs > 0, max_abs / 127, torch.ones_like(max_abs)),
                               rtol=2**-23, atol=0)
    assert (q.int() - expected.int()).abs().max() <= 1  # a product rounded at .5 may land either way
    assert torch.equal(corrections, 128 * q.view(5, num_groups, GROUP).sum(2, dtype=torch.int32))


@needs_kernel
@pytest.mark.parametrize("num_tokens", [1, 2, 3, 4, 5, 6, 7, 11, 12, 13, 17, 31, 64, 127, 1024])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_matches_the_dequantized_matmul(num_tokens, dtype):
    gen = torch.Generator().manual_seed(num_tokens)
    weight = torch.randn(96, 192, generator=gen)
    x = torch.randn(num_tokens, 192, generator=gen).to(dtype)
    out = Int8Linear(weight, None, PLAN)(x)
    assert out.shape == (num_tokens, 96) and out.dtype == dtype
    expected = dequantized_reference(x, weight)
    # Integer sums are exact: only the epilogues' fp32 scaling and the output's rounding differ.
    rtol = 2**-8 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(out.float(), expected, atol=1e-3, rtol=rtol)


@needs_kernel
def test_every_step_size_up_to_1024_gives_each_token_the_same_row():
    """A token's row is its own: the same bits whichever pass (1 to 6 tokens) computes it."""
    gen = torch.Generator().manual_seed(7)
    weight, bias = torch.randn(40, 70, generator=gen), torch.randn(40, generator=gen)
    linear = Int8Linear(weight, bias, PLAN)
    x = torch.randn(1024, 70, generator=gen).bfloat16()
    full = linear(x)  # [1024, 40]
    torch.testing.assert_close(full.float(), dequantized_reference(x, weight) + bias, atol=1e-2, rtol=2**-8)
    for num_tokens in range(1, 1024):
        assert torch.equal(linear(x[:num_tokens]), full[:num_tokens]), num_tokens


@needs_kernel
@pytest.mark.parametrize("shape", [(1, 17, 5), (7, 33, 70), (5, 65, 130), (3, 31, 1), (9, 1, 8), (2, 100, 577),
                                   (6, 32, 64), (13, 96, 65)])
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
def test_an_outlier_coarsens_its_own_group_only():
    gen = torch.Generator().manual_seed(0)
    weight, x = torch.randn(64, 256, generator=gen), torch.randn(4, 256, generator=gen)
    x[:, 3] = 30.0  # one large input: one scale per token would coarsen all 256
    out = Int8Linear(weight, None, PLAN)(x)
    exact = x @ weight.t()  # [4, 64]
    token_scales = x.abs().amax(1, keepdim=True) / 127  # [4, 1]
    per_token = (torch.round(x / token_scales) * token_scales) @ linear_weight(weight).t()
    assert (out - exact).abs().mean() < 0.7 * (per_token - exact).abs().mean()
    assert (out - exact).abs().max() < 0.03 * exact.abs().max()


def linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """`weight` as the kernel holds it: rounded to its groups' int8 steps."""
    q, scales = quantize_weight(weight)
    return (q.float().view(len(q), -1, GROUP) * scales[:, :, None]).flatten(1)[:, : weight.shape[1]]


@needs_kernel
def test_panels_gathered_on_huge_pages_give_the_same_outputs(monkeypatch):
    """fast_paths moves every layer's panels into one tensor on huge pages (as the bf16 slabs):
    one storage, the same words, the same outputs; the tied embedding reads the moved ones."""
    generator = torch.Generator().manual_seed(0)
    model = torch.nn.ModuleList(Int8Linear(torch.randn(n, k, generator=generator), None, PLAN)
                                for n, k in [(32, 64), (48, 577), (4096, 64)])
    inputs = [torch.randn(3, linear.in_features, generator=generator) for linear in model]
    before = [linear(x) for linear, x in zip(model, inputs)]
    old_panels = [linear.panels.clone() for linear in model]
    monkeypatch.setattr("engine.cpu.huge_pages.huge_pages_on_request", lambda: True)
    assert gather_panels_on_huge_pages(model) == sum(p.numel() * 4 for p in old_panels)
    storage = model[0].panels.untyped_storage().data_ptr()
    for linear, old, x, out in zip(model, old_panels, inputs, before):
        assert linear.panels.untyped_storage().data_ptr() == storage
        assert linear.quantized.panels is linear.panels
        assert torch.equal(linear.panels, old) and torch.equal(linear(x), out)
    monkeypatch.setattr("engine.cpu.huge_pages.huge_pages_on_request", lambda: False)
    assert gather_panels_on_huge_pages(model) == 0


def q8_0_blocks(out_features: int, in_features: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A GGUF Q8_0 weight's blocks, as engine/loader/gguf_blocks.py unpacks them: int8 values and an
    fp16 d per 32 inputs."""
    q = torch.randint(-127, 128, (out_features, in_features), generator=gen, dtype=torch.int8)
    d = (torch.rand(out_features, in_features // GGUF_GROUP, generator=gen) * 0.01 + 1e-4).half()
    return q, d


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_q8_0_blocks_run_in_groups_of_32(dtype):
    """Q8_0's groups of 32 (three here: not a whole group of 64) on the same kernel: the
    blocks read back exactly, activations quantize per 32, the matmul is the dequantized one
    and each token's row is the same bits at every step size."""
    gen = torch.Generator().manual_seed(32)
    q, d = q8_0_blocks(72, 96, gen)
    bias = torch.randn(72, generator=gen)
    linear = Int8Linear(torch.empty(72, 96), bias, PLAN, blocks=(q, d))
    assert linear.quantized.group_size == GGUF_GROUP and linear.from_gguf
    weight = q.float() * d.float().repeat_interleave(GGUF_GROUP, dim=1)  # exact: fp16 d times a small integer
    assert torch.equal(linear.dequantize_rows(torch.arange(72)), weight)
    assert torch.equal(dequantize_rows(linear.quantized, torch.arange(72)), weight)
    x = torch.randn(300, 96, generator=gen).to(dtype)
    x_bytes, x_scales, corrections = PLAN.kernels.quantize_activations(x, 3, GGUF_GROUP)
    groups = x.float().view(300, 3, GGUF_GROUP)
    torch.testing.assert_close(x_scales, groups.abs().amax(2) / 127, rtol=2**-23, atol=0)
    assert torch.equal(corrections, 128 * x_bytes.view(300, 3, GGUF_GROUP).sum(2, dtype=torch.int32))
    xq = x_bytes.double().view(300, 3, GGUF_GROUP) * x_scales.double()[:, :, None]
    expected = (xq.flatten(1) @ weight.double().t()).float() + bias
    full = linear(x)  # [300, 72]
    rtol = 2**-8 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(full.float(), expected, atol=1e-3, rtol=rtol)
    for num_tokens in range(1, 300):
        assert torch.equal(linear(x[:num_tokens]), full[:num_tokens]), num_tokens


@needs_kernel
def test_groups_other_than_64_and_32_are_refused():
    with pytest.raises(ValueError, match="groups must be"):
        pack_panels(torch.zeros(32, 96, dtype=torch.int8), torch.ones(32, 6), 96)  # 16 inputs a group
    with pytest.raises(RuntimeError, match="groups are 64"):
        PLAN.kernels.quantize_activations(torch.randn(2, 96), 6, 16)


@needs_kernel
def test_one_tokens_prefetch_switch_leaves_the_bits():
    """set_one_token_prefetch (engine/cpu/prefetch_tuner.py steers it; int4_linear.cpp shares it)
    moves no data the kernel computes with: one token's outputs are the same bits either way,
    and so are several tokens' (they keep their prefetch)."""
    generator = torch.Generator().manual_seed(6)
    weight = torch.randn(1024, 512, generator=generator)
    linear = Int8Linear(weight, None, PLAN)
    for num_tokens in (1, 3):
        x = torch.randn(num_tokens, 512, generator=generator).bfloat16()
        on, off = outputs_both_ways(PLAN.kernels, linear, x)
        assert torch.equal(on, off)
    torch.testing.assert_close(on.float(), dequantized_reference(x, weight), atol=1e-3, rtol=2**-8)
