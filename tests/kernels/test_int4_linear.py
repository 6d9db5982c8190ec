"""The int4 (Q4_1-format W4A8) matmul: weights quantized as llama.cpp's quantize_row_q4_1 does,
packed and read back exactly; the kernel against the same arithmetic in fp64 (its own activation
quantization, checked apart against torch), at every step size from 1 to 1,024 and on odd
shapes, with bias and fp32 logits."""

from __future__ import annotations

import pytest
import torch

from engine.cpu.host import detect_cpu_features
from engine.cpu.int4_linear import BLOCK, Int4Linear, dequantize_rows, pack_panels, quantize_weight
from engine.cpu.quantized_plan import plan_quantization
from tests.helpers.prefetch_switch import outputs_both_ways

# With VNNI the kernel must build (a build failure fails here rather than skipping).
PLAN = plan_quantization("cpu", True, "int4") if detect_cpu_features().has_avx512_vnni else None
needs_kernel = pytest.mark.skipif(PLAN is None, reason="int4 needs AVX512_VNNI, which this CPU lacks")


def quantize_activations_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, K] -> (qx [T, num_blocks, 32] float, scales [T, num_blocks]): symmetric int8 per block of 32."""
    num_tokens, in_features = x.shape
    num_blocks = -(-in_features // BLOCK)
    padded = torch.zeros(num_tokens, num_blocks * BLOCK)
    padded[:, :in_features] = x.float()
    blocks = padded.view(num_tokens, num_blocks, BLOCK)
    max_abs = blocks.abs().amax(dim=2)  # [T, num_blocks]
    inverse = torch.where(max_abs > 0, 127 / max_abs, torch.zeros_like(max_abs))
    qx = torch.round(blocks * inverse[:, :, None])
    return qx, torch.where(max_abs > 0, max_abs / 127, torch.ones_like(max_abs))


def reference(x: torch.Tensor, linear: Int4Linear) -> torch.Tensor:
    """sum_b sx * (d * sum q qx + m * sum qx) in fp64, from the panels read back and the kernel's
    own quantized activations (checked against torch's apart: a product that lands exactly on
    .5 may round either way between two vector paths)."""
    num_blocks = -(-linear.in_features // BLOCK)
    qx, sx, _ = PLAN.kernels.quantize_activations_q4(x, num_blocks)  # [T, nb * 32] int8, [T, nb]
    qx = qx.float().view(x.shape[0], num_blocks, BLOCK)
    weight = linear.quantized
    values = dequantize_rows(weight, torch.arange(linear.out_features))  # [out, in]: d * q + m
    padded = torch.zeros(linear.out_features, num_blocks * BLOCK, dtype=torch.float64)
    padded[:, : linear.in_features] = values.double()
    # d * q + m per weight, so one fp64 dot per block gives d * sum q qx + m * sum qx.
    per_block = torch.einsum("tbk,obk->tob", qx.double(), padded.view(-1, num_blocks, BLOCK))
    out = (per_block * sx.double()[:, None, :]).sum(dim=2)
    if linear.bias.numel():
        out += linear.bias[: linear.out_features].double()
    return out


def test_weights_quantize_as_q4_1_and_read_back_from_the_panels():
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(45, 70, generator=generator)
    codes, d, m = quantize_weight(weight)
    assert codes.shape == (45, 96) and int(codes.max()) <= 15 and d.dtype == torch.float16
    blocks = torch.zeros(45, 96)
    blocks[:, :70] = weight
    blocks = blocks.view(45, 3, BLOCK)
    # llama.cpp's scheme: d spans the block's range in 15 steps, m is its minimum.
    assert torch.equal(m, blocks.amin(dim=2).half())
    assert torch.equal(d, ((blocks.amax(dim=2) - blocks.amin(dim=2)) / 15).half())
    packed = pack_panels(codes, d, m, 70)
    values = dequantize_rows(packed, torch.arange(45))
    expected = (codes.float().view(45, 3, BLOCK) * d.float()[:, :, None] + m.float()[:, :, None]).view(45, 96)[:, :70]
    assert torch.equal(values, expected)  # the panels hold exactly the codes, d and m
    # Each weight within half a step (plus fp16's rounding of d and m) of its value.
    step = d.float().repeat_interleave(BLOCK, dim=1)[:, :70]
    assert ((values - weight).abs() <= step * 0.5 + 2e-3 * weight.abs().max()).all()


@needs_kernel
@pytest.mark.parametrize("in_features", [1, 31, 32, 33, 577])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_activations_quantize_per_block_as_torch_does(in_features, dtype):
    x = (torch.randn(7, in_features, generator=torch.Generator().manual_seed(in_features)) * 3).to(dtype)
    num_blocks = -(-in_features // BLOCK)
    qx, scales, scaled_sums = PLAN.kernels.quantize_activations_q4(x, num_blocks)
    expected_qx, expected_scales = quantize_activations_reference(x)
    assert torch.equal(qx.float().view(7, num_blocks, BLOCK), expected_qx)
    assert torch.equal(scales, expected_scales)
    torch.testing.assert_close(scaled_sums, expected_scales * expected_qx.sum(dim=2), rtol=1e-6, atol=0)


@needs_kernel
@pytest.mark.parametrize("num_tokens", [1, 2, 3, 4, 5, 7, 8, 9, 17, 64, 1024])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_matches_the_same_arithmetic_in_fp64(num_tokens, dtype):
    generator = torch.Generator().manual_seed(num_tokens)
    linear = Int4Linear(torch.randn(96, 576, generator=generator), None, PLAN)
    x = torch.randn(num_tokens, 576, generator=generator).to(dtype)
    out = linear(x)
    assert out.dtype == dtype and out.shape == (num_tokens, 96)
    expected = reference(x, linear)
    tolerance = 1e-2 if dtype == torch.bfloat16 else 2e-4  # bf16: the output's own rounding
    torch.testing.assert_close(out.double(), expected, rtol=tolerance, atol=tolerance * expected.abs().max().item())


@needs_kernel
def test_every_step_size_up_to_1024_gives_each_token_the_same_row():
    """A token's row must not depend on how many others share its step (kMaxRows passes, tails)."""
    generator = torch.Generator().manual_seed(1)
    linear = Int4Linear(torch.randn(64, 128, generator=generator), None, PLAN)
    x = torch.randn(1024, 128, generator=generator)
    alone = linear(x[:1])
    for num_tokens in range(1, 1025):
        assert torch.equal(linear(x[:num_tokens])[:1], alone), num_tokens


@needs_kernel
@pytest.mark.parametrize("shape", [(1, 17, 5), (7, 33, 70), (5, 65, 130), (3, 31, 1), (9, 1, 8), (2, 100, 577)])
def test_odd_shapes_with_bias_and_fp32_logits(shape):
    num_tokens, out_features, in_features = shape
    generator = torch.Generator().manual_seed(sum(shape))
    linear = Int4Linear(torch.randn(out_features, in_features, generator=generator),
                        torch.randn(out_features, generator=generator), PLAN)
    x = torch.randn(num_tokens, in_features, generator=generator).bfloat16()
    linear.out_fp32 = True
    out = linear(x)
    assert out.dtype == torch.float32 and out.shape == (num_tokens, out_features)
    expected = reference(x, linear)
    torch.testing.assert_close(out.double(), expected, rtol=2e-4, atol=2e-4 * expected.abs().max().item())


@needs_kernel
def test_q4_1_blocks_pack_as_given():
    """A GGUF's Q4_1 blocks (codes, d, m) go in as they are: the layer computes with exactly those."""
    generator = torch.Generator().manual_seed(5)
    codes = torch.randint(0, 16, (40, 64), generator=generator, dtype=torch.uint8)
    d = (torch.rand(40, 2, generator=generator) * 0.1).half()
    m = (-torch.rand(40, 2, generator=generator)).half()
    weight = (codes.float().view(40, 2, BLOCK) * d.float()[:, :, None] + m.float()[:, :, None]).view(40, 64)
    linear = Int4Linear(weight, None, PLAN, blocks=(codes, d, m))
    assert torch.equal(dequantize_rows(linear.quantized, torch.arange(40)), weight)
    x = torch.randn(3, 64, generator=generator)
    expected = reference(x, linear)
    torch.testing.assert_close(linear(x).double(), expected, rtol=2e-4, atol=2e-4 * expected.abs().max().item())


@needs_kernel
def test_one_tokens_prefetch_switch_leaves_the_bits():
    """set_one_token_prefetch (engine/cpu/prefetch_tuner.py steers it) moves no data the kernel
    computes with: one token's outputs are the same bits either way, and so are several tokens'
    (they keep their prefetch)."""
    generator = torch.Generator().manual_seed(6)
    linear = Int4Linear(torch.randn(1024, 512, generator=generator), None, PLAN)
    for num_tokens in (1, 3):
        x = torch.randn(num_tokens, 512, generator=generator).bfloat16()
        on, off = outputs_both_ways(PLAN.kernels, linear, x)
        assert torch.equal(on, off)
    expected = reference(x, linear)
    torch.testing.assert_close(on.double(), expected, rtol=2e-2, atol=2e-2 * expected.abs().max().item())
