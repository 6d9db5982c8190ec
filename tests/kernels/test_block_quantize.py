"""`--quantization int4|int8` without AVX512_VNNI (engine/cpu/block_quantize.py): the plan on
faked CPUs, the weights in llama.cpp's Q4_1 / Q8_0 blocks (int4's the very rounding of the VNNI
panels), a GGUF's own blocks written back as they were, and the matmul against fp32 on the
dequantized weights."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from engine.cpu import int4_linear
from engine.cpu.block_quantize import block_linear, pack_blocks, quantize_to_blocks
from engine.cpu.gguf_linear import kernel_types
from engine.cpu.quantized_plan import check_quantization_supported, plan_quantization
from engine.loader.gguf_blocks import unpack_blocks

AVX2_TYPES = frozenset({"Q4_1", "Q8_0", "Q4_K"})
needs_kernels = pytest.mark.skipif(not {"Q4_1", "Q8_0"} <= kernel_types(), reason="the GGUF kernels need AVX2")


def test_the_plan_takes_vnni_then_the_avx2_blocks_then_refuses():
    assert check_quantization_supported("cpu", True, "int4", AVX2_TYPES) is None  # the vpdpbusd panels
    assert check_quantization_supported("cpu", False, "int4", AVX2_TYPES) == "Q4_1"
    assert check_quantization_supported("cpu", False, "int8", AVX2_TYPES) == "Q8_0"
    plan = plan_quantization("cpu", False, "int4", AVX2_TYPES)
    assert plan.kernels is None and plan.block_type == "Q4_1" and plan.scheme == "int4"
    with pytest.raises(ValueError, match="AVX512_VNNI.*AVX2"):
        check_quantization_supported("cpu", False, "int4", frozenset())
    with pytest.raises(ValueError, match="CPU only"):
        check_quantization_supported("cuda", False, "int4", AVX2_TYPES)


def test_q4_1_blocks_hold_the_vnni_panels_rounding():
    """int4 on AVX2 serves the weights int4 on VNNI does: the same codes, d and m."""
    weight = torch.randn(48, 96, generator=torch.Generator().manual_seed(0))
    weight[5, 7] = 9.0  # an outlier sets its own block's step only
    codes, d, m = int4_linear.quantize_weight(weight)
    rows = quantize_to_blocks(weight, "Q4_1")
    assert rows.shape == (48, 96 // 32 * 20) and rows.dtype == torch.uint8
    blocks = unpack_blocks(rows.numpy(), "Q4_1")
    assert torch.equal(blocks.codes, codes) and torch.equal(blocks.d, d) and torch.equal(blocks.m, m)


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0"])
def test_a_gguf_s_own_blocks_are_written_back_as_they_were(type_name):
    """A GGUF's Q4_0 (as Q4_1 with m = -8 d), Q4_1 or Q8_0 blocks, unpacked by the loader and packed
    again, dequantize to the file's values bit for bit."""
    values = np.random.default_rng(1).standard_normal((24, 64)).astype(np.float32)
    raw = gguf.quants.quantize(values, gguf.GGMLQuantizationType[type_name])
    kept = "Q8_0" if type_name == "Q8_0" else "Q4_1"
    blocks = unpack_blocks(raw, type_name)
    rows = pack_blocks(blocks.codes, blocks.d, blocks.m, kept)
    if type_name != "Q4_0":
        assert torch.equal(rows, torch.from_numpy(raw))  # the file's very bytes
    back = gguf.quants.dequantize(rows.numpy(), gguf.GGMLQuantizationType[kept])
    assert np.array_equal(back, gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name]))


@needs_kernels
@pytest.mark.parametrize("type_name", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("num_tokens", [1, 3, 8, 33])
def test_the_matmul_is_fp32_on_the_dequantized_weights_within_the_activations_rounding(type_name, num_tokens):
    generator = torch.Generator().manual_seed(num_tokens)
    weight, bias = torch.randn(72, 256, generator=generator), torch.randn(72, generator=generator)
    linear = block_linear(weight, bias, type_name)
    dequantized = linear.dequantize()  # [72, 256] fp32: gguf-py's values of the blocks
    expected_blocks = gguf.quants.dequantize(quantize_to_blocks(weight, type_name).numpy(),
                                             gguf.GGMLQuantizationType[type_name])
    assert torch.equal(dequantized, torch.from_numpy(expected_blocks))
    assert torch.equal(linear.dequantize_rows(torch.tensor([0, 71, 5])), dequantized[[0, 71, 5]])
    error = (dequantized - weight).abs().max()
    assert error < (0.6 if type_name == "Q4_1" else 0.03)  # half a step of each type on N(0, 1) weights
    x = torch.randn(num_tokens, 256, generator=generator)
    want = x @ dequantized.t() + bias  # [num_tokens, 72]
    got = linear(x)
    # The activations are rounded to 8 bits a block of 32 (Q8_0/Q8_1): about 0.5% of a row's scale.
    assert (got - want).abs().max() < 0.02 * want.abs().max()
    assert linear(x[:1])[0].allclose(got[0], atol=1e-4)  # a row's result does not depend on its batch


def test_inputs_that_are_not_whole_blocks_stay_unquantized():
    assert block_linear(torch.randn(8, 40), None, "Q4_1") is None
