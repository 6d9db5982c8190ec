"""GgufLinear: a GGUF's blocks kept as the file stores them (engine/cpu/gguf_linear.py) and
multiplied on the AVX2 kernels (engine/cpu/csrc/gguf/; a prompt's groups on AVX512-VNNI where the CPU
has it: tests/kernels/test_gguf_vnni.py holds that path to the same bits).

Weights of each type come from the `gguf` package's quantizer where it has one (Q4_0, Q4_1,
Q5_0, Q5_1, Q8_0), else as random valid blocks (random code and scale bytes, finite fp16 d and dmin).
They must dequantize bit for bit to `gguf.quants.dequantize`. The matmul quantizes its
activations to int8 per block (256 inputs for the K-quants, 32 for the others; scale
max|x| / 127), so it is checked two ways: against the same quantized activations times the
dequantized weight (only fp32 summation order differs), and against the plain x @ W^T within
the bound that quantization allows (each input moves by at most half its block's step).
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from engine.cpu.gguf_linear import KERNEL_TYPE_NAMES, GgufLinear, kernel_types
from engine.cpu.gguf_repack import GROUPED, pack_q4_k_x8, pack_q6_k_x8, unpack_q4_k_x8, unpack_q6_k_x8

# This CPU (AVX2) must build and run them: a build failure fails here rather than skipping.
assert kernel_types() == frozenset(KERNEL_TYPE_NAMES)

QUANTIZER_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")  # gguf.quants.quantize has these, not the K-quants


def make_blocks(type_name: str, rows: int, in_features: int, seed: int = 0, d_max: float = 0.02,
                centered: bool = False) -> torch.Tensor:
    """uint8 [rows, bytes per row] of valid `type_name` blocks (K-quants: d up to `d_max`; `centered`:
    dmin near d times the mean code, so the weights average about 0, as a trained model's)."""
    rng = np.random.default_rng(seed)
    qtype = gguf.GGMLQuantizationType[type_name]
    block_inputs, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    if type_name in QUANTIZER_TYPES:
        weight = rng.standard_normal((rows, in_features)).astype(np.float32)
        return torch.from_numpy(gguf.quants.quantize(weight, qtype))
    blocks = rng.integers(0, 256, (rows, in_features // block_inputs, block_bytes), dtype=np.uint8)
    shape = (rows, in_features // block_inputs, 1)
    d = rng.uniform(0.1, 1, shape).astype(np.float32) * d_max
    dmin = rng.uniform(-0.5, 1, shape).astype(np.float32) * d_max
    if centered:  # mean of d sc q - dmin m over uniform codes, scales and mins: 0
        dmin = d * (7.5 if type_name == "Q4_K" else 15.5)
    d, dmin = d.astype(np.float16).view(np.uint8), dmin.astype(np.float16).view(np.uint8)
    if type_name == "Q6_K":  # ql, qh, 16 int8 scales, then d
        blocks[..., 208:210] = d
    else:  # Q4_K, Q5_K: d, dmin, then scales and codes
        blocks[..., 0:2], blocks[..., 2:4] = d, dmin
    return torch.from_numpy(blocks.reshape(rows, -1))


def quantized_activations(x: torch.Tensor, block: int) -> torch.Tensor:
    """x [T, K] as the kernel sees it: round(x * 127 / max|x|) * max|x| / 127 per block, fp64."""
    blocks = x.double().view(x.shape[0], -1, block)
    amax = blocks.abs().amax(dim=2, keepdim=True).float().double()
    scale = (amax.float() / 127).double()
    # A tensor divided, not 127 / tensor: torch computes that as reciprocal times 127, another rounding.
    inverse = torch.where(amax > 0, (torch.full_like(amax, 127).float() / amax.float()).double(), torch.zeros_like(amax))
    q = torch.round((blocks.float() * inverse.float()).double())  # fp32 product, nearest even
    return (q * scale).view_as(x)


def block_of(type_name: str) -> int:
    return 256 if type_name.endswith("_K") else 32


CODE_BYTES = {"Q4_0": (2, 18), "Q4_1": (4, 20), "Q5_0": (2, 22), "Q5_1": (4, 24), "Q8_0": (2, 34),
              "Q4_K": (16, 144), "Q5_K": (16, 176), "Q6_K": (0, 192)}  # where each block's codes lie


def offsets(type_name: str, rows: torch.Tensor) -> torch.Tensor:
    """fp64 [rows, in]: each weight's value at code 0 (-8d, m, -dmin m, -32 d sc): the term the
    kernel adds apart from the codes' products, which may cancel most of them."""
    qtype = gguf.GGMLQuantizationType[type_name]
    block_bytes = gguf.GGML_QUANT_SIZES[qtype][1]
    start, end = CODE_BYTES[type_name]
    blocks = rows.numpy().reshape(rows.shape[0], -1, block_bytes).copy()
    blocks[..., start:end] = 0
    return torch.from_numpy(gguf.quants.dequantize(blocks.reshape(rows.shape), qtype)).double()


def check_matmul(linear: GgufLinear, x: torch.Tensor, y: torch.Tensor) -> None:
    """y against the quantized activations' exact product, and within quantization's bound of x @ W^T."""
    weight = linear.dequantize().double()
    x = x.float()
    start = 0
    for i, type_name in enumerate(linear.type_names):
        num_rows = linear.file_rows(i).shape[0]
        rows = slice(start, start + num_rows)
        block = block_of(type_name)
        exact = quantized_activations(x, block) @ weight[rows].T
        # The kernel sums the codes' products and the offsets' apart: both sizes bound its rounding.
        sizes = weight[rows].abs() + 2 * offsets(type_name, linear.file_rows(i)).abs()
        magnitude = quantized_activations(x, block).abs() @ sizes.T
        if linear.bias.numel():
            exact += linear.bias[rows].double()
        # fp32 sums of fp32-scaled blocks: a few roundings of 2^-24 each, relative to the terms' size.
        error = (y[:, rows].double() - exact).abs() / (magnitude + 1e-6)
        assert error.max() <= 1e-5, (type_name, float(error.max()))
        # Each input moves by at most half a step, max|x| / 254 over its block.
        step = x.abs().view(x.shape[0], -1, block).amax(dim=2, keepdim=True).double() / 254
        bound = step.expand(-1, -1, block).reshape(x.shape) @ weight[rows].abs().T
        plain = x.double() @ weight[rows].T + (linear.bias[rows].double() if linear.bias.numel() else 0)
        assert ((y[:, rows].double() - plain).abs() <= bound * 1.001 + 1e-4).all(), type_name
        start += num_rows


@pytest.mark.parametrize("type_name", KERNEL_TYPE_NAMES)
def test_dequantize_is_gguf_bit_for_bit(type_name):
    blocks = make_blocks(type_name, 13, 512)
    linear = GgufLinear([(type_name, blocks)], 512)
    expected = gguf.quants.dequantize(blocks.numpy(), gguf.GGMLQuantizationType[type_name])
    values = linear.dequantize()
    assert values.dtype == torch.float32 and values.shape == (13, 512)
    assert np.array_equal(values.numpy().view(np.uint32), expected.astype(np.float32).view(np.uint32))
    # The C++ row reader (a tied embedding's lookup) gives the same bits, every row, any order.
    assert np.array_equal(linear.dequantize_rows(torch.arange(13)).numpy().view(np.uint32),
                          values.numpy().view(np.uint32))
    rows = torch.tensor([12, 0, 5, 5])
    assert torch.equal(linear.dequantize_rows(rows), values[rows])
    with pytest.raises(RuntimeError, match="outside the weight"):
        linear.dequantize_rows(torch.tensor([13]))
    assert linear.num_weight_bytes == blocks.numel()  # held once, at the file's size
    if type_name in GROUPED:  # 8 rows repacked into one group, the last 5 the file's rows as they are
        assert linear.is_grouped == [True, False]
        assert torch.equal(torch.cat([linear.file_rows(0), linear.file_rows(1)]), blocks)
    else:
        assert linear.blocks.data_ptr() == blocks.data_ptr()  # the file's bytes, not a copy


@pytest.mark.parametrize("type_name", KERNEL_TYPE_NAMES)
@pytest.mark.parametrize("num_tokens", [1, 3, 6, 8, 37, 70])  # Q4_K groups: passes of 8, a 64-token tile and more
def test_matmul_matches_the_dequantized_weight(type_name, num_tokens):
    linear = GgufLinear([(type_name, make_blocks(type_name, 45, 768, seed=num_tokens))], 768)
    x = torch.randn(num_tokens, 768, generator=torch.Generator().manual_seed(num_tokens)) * 2
    x[0, :5] = 0  # a block's tail of zeros, and below a whole zero block
    x[-1, 256:512] = 0
    y = linear(x)
    assert y.shape == (num_tokens, 45) and y.dtype == torch.float32
    check_matmul(linear, x, y)
    # A token's row is the same computed alone as in the batch (each token's sums are its own).
    for t in (0, num_tokens - 1):
        assert torch.equal(linear(x[t:t + 1]), y[t:t + 1])


def test_mixed_parts_with_a_bias_and_odd_rows():
    """A merged projection: Q4_K rows (a group of 8 and 3 more), then Q6_K, then Q8_0, each its own type."""
    parts = [("Q4_K", make_blocks("Q4_K", 11, 512, 1)), ("Q6_K", make_blocks("Q6_K", 7, 512, 2)),
             ("Q8_0", make_blocks("Q8_0", 5, 512, 3))]
    bias = torch.randn(23)
    linear = GgufLinear(parts, 512, bias)
    assert linear.out_features == 23 and linear.type_names == ["Q4_K", "Q4_K", "Q6_K", "Q8_0"]
    x = torch.randn(6, 512, generator=torch.Generator().manual_seed(6))
    check_matmul(linear, x, linear(x))
    expected = torch.cat([torch.from_numpy(gguf.quants.dequantize(p.numpy(), gguf.GGMLQuantizationType[n]))
                          for n, p in parts])
    assert torch.equal(linear.dequantize(), expected)
    rows = torch.tensor([22, 2, 3, 9, 10, 17, 7, 8])  # across all the parts, out of order
    assert torch.equal(linear.dequantize_rows(rows), expected[rows])


def test_a_slice_is_kept_in_place_and_bf16_goes_through():
    """A lone part that is a row slice of a bigger buffer (a memory-mapped file) is used in place;
    several parts are copied into one buffer, held once. bf16 activations give bf16 outputs, the
    fp32 result rounded; out_fp32 keeps it."""
    buffer = make_blocks("Q5_K", 20, 256, 4)
    assert GgufLinear([("Q5_K", buffer[3:9])], 256).blocks.data_ptr() == buffer[3:].data_ptr()
    linear = GgufLinear([("Q5_K", buffer[:9]), ("Q5_K", buffer[9:])], 256)
    assert linear.num_weight_bytes == buffer.numel() and torch.equal(linear.blocks, buffer.reshape(-1))
    x = torch.randn(2, 3, 256, generator=torch.Generator().manual_seed(4)).bfloat16()
    y = linear(x)
    assert y.shape == (2, 3, 20) and y.dtype == torch.bfloat16
    linear.out_fp32 = True
    y32 = linear(x)
    assert y32.dtype == torch.float32 and torch.equal(y32.bfloat16(), y)
    check_matmul(linear, x.view(6, 256), y32.view(6, 20))


def test_q4_k_groups_hold_the_file_bits_exactly():
    """Repacking moves bits only: random bytes (every bit pattern, not just valid blocks) come back
    through numpy's unpack from the C++ pack, each group's set bits the same in number. A strided
    view packs as its contiguous copy; anything but whole groups of whole super-blocks is refused."""
    rows = torch.from_numpy(np.random.default_rng(5).integers(0, 256, (24, 3 * 144), dtype=np.uint8))
    groups = pack_q4_k_x8(rows)
    assert groups.shape == (3, 8 * 3 * 144) and torch.equal(unpack_q4_k_x8(groups), rows)
    bits = np.unpackbits(rows.numpy().reshape(3, -1), axis=1).sum(axis=1)
    assert np.array_equal(np.unpackbits(groups.numpy(), axis=1).sum(axis=1), bits)
    wide = torch.cat([rows, rows.flip(0)], dim=1)  # its left half is a strided view
    assert torch.equal(pack_q4_k_x8(wide[:, :432]), groups)
    for bad in (rows[:16 + 4], rows[:, :400], rows.view(torch.int8)):
        with pytest.raises(RuntimeError, match="rows"):
            pack_q4_k_x8(bad)


def test_q6_k_groups_hold_the_file_bits_exactly():
    """As Q4_K's: random bytes (every bit pattern) come back through numpy's unpack from the C++
    pack, and the groups are the same bytes moved (a permutation: the same multiset of set bits per
    group). A strided view packs as its contiguous copy; anything but whole groups of whole
    super-blocks is refused."""
    rows = torch.from_numpy(np.random.default_rng(6).integers(0, 256, (24, 2 * 210), dtype=np.uint8))
    groups = pack_q6_k_x8(rows)
    assert groups.shape == (3, 8 * 2 * 210) and torch.equal(unpack_q6_k_x8(groups), rows)
    bits = np.unpackbits(rows.numpy().reshape(3, -1), axis=1).sum(axis=1)
    assert np.array_equal(np.unpackbits(groups.numpy(), axis=1).sum(axis=1), bits)
    wide = torch.cat([rows, rows.flip(0)], dim=1)  # [24, 840]: its left half is a strided view
    assert torch.equal(pack_q6_k_x8(wide[:, :420]), groups)
    for bad in (rows[:20], rows[:, :400], rows.view(torch.int8)):
        with pytest.raises(RuntimeError, match="rows"):
            pack_q6_k_x8(bad)


@pytest.mark.parametrize("num_tokens", [1, 3, 8, 17])
def test_grouped_bf16_outputs_round_as_torch_does(num_tokens):
    """The groups' bf16 stores round in vectors: every value the bias gives (the weights all 0,
    so y = bias exactly) comes out as torch's float -> bf16, bit for bit: halfway cases both ways
    (to the even neighbour), values that round up into the next binade and to inf, subnormals,
    infinities; NaN as c10's scalar conversion gives it, 0x7fc0 (ATen's vectorized one gives
    0xffff). 16 Q4_K rows: two groups, taken as a pair from 8 tokens."""
    ties = [1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8), 2 - 2 ** -9, 3.3895313892515355e38, 1e-39]
    bias = torch.tensor(ties + [float("nan"), float("inf"), -float("inf"), 0.1, -7.75, 3.0e38, 65504.0,
                                -1e-40, 1.0 + 2 ** -7 + 2 ** -8, 123456.789], dtype=torch.float32)
    linear = GgufLinear([("Q4_K", torch.zeros(16, 144, dtype=torch.uint8))], 256, bias=bias)
    assert linear.is_grouped == [True]
    x = torch.randn(num_tokens, 256, generator=torch.Generator().manual_seed(num_tokens)).bfloat16()
    y = linear(x)
    expected = bias.bfloat16().view(torch.int16).clone()
    expected[bias.isnan()] = 0x7FC0
    assert y.dtype == torch.bfloat16 and torch.equal(y.view(torch.int16), expected.expand(num_tokens, 16))


@pytest.mark.parametrize("num_tokens", [*range(1, 10), 16, 17, 64, 65])
def test_q6_k_groups_match_for_every_token_count(num_tokens):
    """Q6_K's groups (gguf_dot_q6_k_x8.h) for 1..8 tokens a pass, several passes, a 64-token tile
    and past it; 21 rows: two groups and a tail of 5 rows taken row by row. Signed scales, codes
    at both ends (0 and 63) and full-scale activations test the int16 sums' headroom."""
    blocks = make_blocks("Q6_K", 21, 512, seed=40 + num_tokens)
    blocks.view(21, 2, 210)[0, 0, :192] = 0xFF  # row 0, block 0: every code 63
    blocks.view(21, 2, 210)[1, 0, :192] = 0  # row 1: every code 0 (q = -32)
    blocks.view(21, 2, 210)[2, 1, 192:208] = torch.tensor([-128, 127] * 8, dtype=torch.int8).view(torch.uint8)
    linear = GgufLinear([("Q6_K", blocks)], 512)
    assert linear.is_grouped == [True, False] and linear.type_names == ["Q6_K", "Q6_K"]
    x = torch.randn(num_tokens, 512, generator=torch.Generator().manual_seed(num_tokens))
    x[0, :256] = torch.where(torch.arange(256) % 2 == 0, 1.0, -1.0)  # every input at +-127 after quantizing
    y = linear(x)
    check_matmul(linear, x, y)
    for t in (0, num_tokens - 1):  # a token alone gives its row of the batch, bit for bit
        assert torch.equal(linear(x[t:t + 1]), y[t:t + 1])
    y16 = linear(x.bfloat16())  # bf16 in: the same sums on its fp32 values, the result rounded once
    assert y16.dtype == torch.bfloat16 and torch.equal(y16, linear(x.bfloat16().float()).bfloat16())


def test_q6_k_groups_in_a_merged_projection():
    """A merged qkv as a Q4_K_M file holds it: Q4_K rows for q and k, Q6_K rows for v (9: a group
    and one row), each part in its own layout; the tied-embedding reader crosses them all."""
    parts = [("Q4_K", make_blocks("Q4_K", 16, 256, 7)), ("Q6_K", make_blocks("Q6_K", 9, 256, 8)),
             ("Q8_0", make_blocks("Q8_0", 3, 256, 9))]
    linear = GgufLinear(parts, 256, torch.randn(28))
    assert linear.type_names == ["Q4_K", "Q6_K", "Q6_K", "Q8_0"] and linear.is_grouped == [True, True, False, False]
    x = torch.randn(11, 256, generator=torch.Generator().manual_seed(11))
    check_matmul(linear, x, linear(x))
    expected = torch.cat([torch.from_numpy(gguf.quants.dequantize(p.numpy(), gguf.GGMLQuantizationType[n]))
                          for n, p in parts])
    assert torch.equal(linear.dequantize(), expected)
    rows = torch.tensor([27, 16, 23, 24, 25, 0, 17, 15])
    assert np.array_equal(linear.dequantize_rows(rows).numpy().view(np.uint32), expected[rows].numpy().view(np.uint32))


def test_refuses_what_it_cannot_run():
    with pytest.raises(ValueError, match="no gguf kernel for Q2_K"):
        GgufLinear([("Q2_K", torch.zeros(2, 84, dtype=torch.uint8))], 256)
    with pytest.raises(ValueError, match="uint8"):
        GgufLinear([("Q4_K", torch.zeros(2, 100, dtype=torch.uint8))], 256)


def test_fast_paths_keep_gguf_linears_and_the_head_gives_fp32_logits():
    """The runner's fast paths pack the model's nn.Linears but leave its GgufLinears as they are."""
    from types import SimpleNamespace

    from engine.cpu.fast_paths import apply_fast_paths
    from engine.cpu.packing import PackedLinear

    model = torch.nn.Module()
    model.proj = GgufLinear([("Q6_K", make_blocks("Q6_K", 8, 256))], 256)
    model.other = torch.nn.Linear(256, 8)
    model.lm_head = GgufLinear([("Q4_K", make_blocks("Q4_K", 16, 256))], 256)
    proj, head = model.proj, model.lm_head
    notes = apply_fast_paths(model, batch_size_hint=4, slabs=None, fused_ops=None,
                             backend=SimpleNamespace(name="cpu"), is_compiled=False)
    assert model.proj is proj and model.lm_head is head and isinstance(model.other, PackedLinear)
    assert head.out_fp32 and not proj.out_fp32
    assert head(torch.randn(2, 256).bfloat16()).dtype == torch.float32
    assert "2 matmuls in the GGUF's own blocks (Q4_K, Q6_K" in " ".join(notes)


def test_gathering_blocks_onto_huge_pages_keeps_every_bit_and_output(monkeypatch):
    """gather_blocks_on_huge_pages copies every layer's blocks into one tensor (one run of huge
    pages): the same bytes, the same outputs, and the file's values still bit for bit."""
    from engine.cpu.gguf_linear import gather_blocks_on_huge_pages

    linears = [GgufLinear([("Q4_K", make_blocks("Q4_K", 16, 256)), ("Q6_K", make_blocks("Q6_K", 5, 256, seed=1))], 256),
               GgufLinear([("Q8_0", make_blocks("Q8_0", 9, 256, seed=2))], 256)]
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(0))
    before = [(linear(x), linear.dequantize(), linear.blocks.clone()) for linear in linears]
    monkeypatch.setattr("engine.cpu.huge_pages.huge_pages_on_request", lambda: True)
    assert gather_blocks_on_huge_pages(linears) == sum(old.numel() for _, _, old in before)
    storage = linears[0].blocks.untyped_storage().data_ptr()
    for linear, (y, weight, old) in zip(linears, before):
        assert linear.blocks.untyped_storage().data_ptr() == storage
        assert torch.equal(linear.blocks, old) and torch.equal(linear.dequantize(), weight)
        assert torch.equal(linear(x), y)
    monkeypatch.setattr("engine.cpu.huge_pages.huge_pages_on_request", lambda: False)
    assert gather_blocks_on_huge_pages(linears) == 0
