"""Q4_1 rows repacked eight to a group (engine/cpu/csrc/gguf/gguf_dot_q4_1_x8.h), the blocks
`--quantization int4` runs on a CPU without VNNI and a GGUF's own Q4_1 tensors: the groups hold
the file's bits exactly (the C++ pack against numpy's unpack), and the x8 kernel's matmul for
1..8 tokens a pass, several passes and past a 64-token tile matches the dequantized weights
(tests/kernels/test_gguf_linear.py's check_matmul), with the last rows (not a whole group) left
to the row kernel."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.cpu.block_quantize import block_linear
from engine.cpu.gguf_linear import GgufLinear
from engine.cpu.gguf_repack import GROUPED, pack_q4_1_x8, unpack_q4_1_x8
from tests.kernels.test_gguf_linear import check_matmul, make_blocks


def test_q4_1_groups_hold_the_file_bits_exactly():
    """Random bytes (every bit pattern, not just valid blocks) come back through numpy's unpack from
    the C++ pack, and each group is its rows' bytes moved (the same number of set bits). A strided
    view packs as its contiguous copy; anything but whole groups of whole blocks is refused."""
    rows = torch.from_numpy(np.random.default_rng(7).integers(0, 256, (24, 5 * 20), dtype=np.uint8))
    groups = pack_q4_1_x8(rows)
    assert groups.shape == (3, 8 * 5 * 20) and torch.equal(unpack_q4_1_x8(groups), rows)
    bits = np.unpackbits(rows.numpy().reshape(3, -1), axis=1).sum(axis=1)
    assert np.array_equal(np.unpackbits(groups.numpy(), axis=1).sum(axis=1), bits)
    # The layout itself (gguf_dot_q4_1_x8.h): row r's d at 2 r, m at 16 + 2 r, qs[4 l + c] at 32 + 32 l + 4 r + c.
    block = groups[1, 160:320].numpy()  # group 1, block 1
    for r in (0, 3, 7):
        file_block = rows[8 + r, 20:40].numpy()
        assert np.array_equal(block[2 * r:2 * r + 2], file_block[0:2])
        assert np.array_equal(block[16 + 2 * r:18 + 2 * r], file_block[2:4])
        assert all(block[32 + 32 * (j // 4) + 4 * r + j % 4] == file_block[4 + j] for j in range(16))
    wide = torch.cat([rows, rows.flip(0)], dim=1)  # its left half is a strided view
    assert torch.equal(pack_q4_1_x8(wide[:, :100]), groups)
    for bad in (rows[:20], rows[:, :90], rows.view(torch.int8)):
        with pytest.raises(RuntimeError, match="rows"):
            pack_q4_1_x8(bad)
    assert "Q4_1" in GROUPED


def extreme_blocks(num_rows: int, in_features: int, seed: int) -> torch.Tensor:
    """Q4_1 rows from gguf's quantizer with extremes written in: row 0's first two blocks every code
    15 (the int16 sums' most, 8 x 2 x 15 x 127), row 1's every code 0, row 2 a negative d and a
    large m, row 3 d = 0."""
    blocks = make_blocks("Q4_1", num_rows, in_features, seed=seed)
    view = blocks.view(num_rows, in_features // 32, 20)
    view[0, :2, 4:] = 0xFF
    view[1, :, 4:] = 0
    view[2, :, 0:2] = torch.from_numpy(np.full(in_features // 32, -1.5, np.float16).view(np.uint8).reshape(-1, 2))
    view[2, :, 2:4] = torch.from_numpy(np.full(in_features // 32, 40.0, np.float16).view(np.uint8).reshape(-1, 2))
    view[3, :, 0:2] = 0
    return blocks


@pytest.mark.parametrize("num_tokens", [*range(1, 10), 16, 17, 64, 65])
def test_q4_1_groups_match_for_every_token_count(num_tokens):
    """21 rows: two groups and a tail of 5 rows taken row by row. Full-scale activations of one
    sign (every input at 127, then -127) against row 0's codes 15 test the int16 sums' headroom."""
    blocks = extreme_blocks(21, 512, seed=60 + num_tokens)
    linear = GgufLinear([("Q4_1", blocks)], 512, torch.randn(21))
    assert linear.is_grouped == [True, False] and linear.type_names == ["Q4_1", "Q4_1"]
    assert torch.equal(torch.cat([linear.file_rows(0), linear.file_rows(1)]), blocks)  # the file's bits
    x = torch.randn(num_tokens, 512, generator=torch.Generator().manual_seed(num_tokens))
    x[0, :32], x[0, 32:64] = 1.0, -1.0
    x[-1, 64:96] = 0  # a zero block: its scale 0
    y = linear(x)
    assert y.shape == (num_tokens, 21)
    check_matmul(linear, x, y)
    for t in (0, num_tokens - 1):  # a token alone gives its row of the batch, bit for bit
        assert torch.equal(linear(x[t:t + 1]), y[t:t + 1])
    y16 = linear(x.bfloat16())  # bf16 in: the same sums on its fp32 values, the result rounded once
    assert y16.dtype == torch.bfloat16 and torch.equal(y16, linear(x.bfloat16().float()).bfloat16())
    linear.out_fp32 = True  # bf16 in, the fp32 result: the sums on bf16's values, unrounded
    check_matmul(linear, x.bfloat16().float(), linear(x.bfloat16()))


def test_q4_1_groups_agree_with_the_row_kernel():
    """The same rows as groups and one by one (a part of one row is never grouped): the same sums
    in another order, so equal to fp32's rounding of the terms."""
    blocks = extreme_blocks(16, 256, seed=3)
    grouped = GgufLinear([("Q4_1", blocks)], 256)
    rows = GgufLinear([("Q4_1", blocks[i:i + 1]) for i in range(16)], 256)
    assert grouped.is_grouped == [True] and not any(rows.is_grouped)
    x = torch.randn(11, 256, generator=torch.Generator().manual_seed(11))
    a, b = grouped(x), rows(x)
    assert (a - b).abs().max() <= 1e-4 * b.abs().max()
    assert torch.equal(grouped.dequantize(), rows.dequantize())


def test_int4_blocks_on_avx2_are_grouped_and_hold_the_same_weights():
    """--quantization int4 on AVX2 (block_quantize.block_linear): Q4_1 groups where the rows make
    whole groups, the tail rows as they are, and the quantizer's values bit for bit."""
    weight = torch.randn(44, 128, generator=torch.Generator().manual_seed(5))
    linear = block_linear(weight, None, "Q4_1")
    assert linear.type_names == ["Q4_1", "Q4_1"] and linear.is_grouped == [True, False]
    assert linear.dequantize_rows(torch.tensor([43, 0, 39, 40])).shape == (4, 128)
    assert torch.equal(linear.dequantize_rows(torch.arange(44)), linear.dequantize())
