"""The GGUF group kernels' AVX512-VNNI inner products (engine/cpu/csrc/gguf/, TL_GGUF_VNNI)
against their AVX2 ones, built side by side (gguf_extension.py's load_gguf_kernels_avx2): both
sum the same integers exactly, so every output must be the same bits, for each grouped type,
every token count a pass takes, several passes, past a 64-token tile, and rows left to the row
kernel. Codes at both ends and full-scale activations test the sums' headroom; the other
files' tests hold the native build to the dequantized weights."""

from __future__ import annotations

import pytest
import torch

from engine.cpu.gguf_extension import load_gguf_kernels, load_gguf_kernels_avx2
from engine.cpu.gguf_linear import GgufLinear
from tests.kernels.test_gguf_linear import make_blocks
from tests.kernels.test_gguf_q4_1_groups import extreme_blocks

pytestmark = pytest.mark.skipif(load_gguf_kernels().dot_isa() != "avx512_vnni",
                                reason="this CPU has no AVX512-VNNI: the kernels have one path")

NUM_TOKENS = [*range(1, 10), 16, 17, 64, 65, 130]


def extreme_k_blocks(type_name: str, num_rows: int, in_features: int, seed: int) -> torch.Tensor:
    """Valid blocks, row 0's first super-block every code at its most, row 1's at 0."""
    blocks = make_blocks(type_name, num_rows, in_features, seed=seed)
    view = blocks.view(num_rows, in_features // 256, -1)
    codes = slice(0, 192) if type_name == "Q6_K" else slice(16, 144)
    view[0, 0, codes] = 0xFF
    view[1, 0, codes] = 0
    return blocks


NUM_ROWS = 517  # 64 groups, so the threads' shares of them come in pieces of several, and a tail of 5 rows


def layer(type_name: str, seed: int, in_features: int) -> GgufLinear:
    if type_name == "Q4_1":
        return GgufLinear([("Q4_1", extreme_blocks(NUM_ROWS, in_features, seed))], in_features)
    return GgufLinear([(type_name, extreme_k_blocks(type_name, NUM_ROWS, in_features, seed))], in_features)


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K", "Q4_1"])
def test_vnni_and_avx2_give_the_same_bits(type_name):
    """512 inputs (1024 for Q4_1) take the pairs from 8 tokens a call; 4608 from 4, where a pass's
    activations outgrow L1 (gguf_linear.cpp's pairs_groups)."""
    native, avx2 = load_gguf_kernels(), load_gguf_kernels_avx2()
    assert avx2.dot_isa() == "avx2"
    cases = [(n, 1024 if type_name == "Q4_1" else 512) for n in NUM_TOKENS] + [(4, 4608), (5, 4608), (13, 4608)]
    for num_tokens, in_features in cases:
        linear = layer(type_name, num_tokens, in_features)
        assert linear.is_grouped == [True, False]
        x = torch.randn(num_tokens, linear.in_features, generator=torch.Generator().manual_seed(num_tokens)) * 3
        x[0, :256] = torch.where(torch.arange(256) % 2 == 0, 1.0, -1.0)  # every input at +-127 after quantizing
        for dtype in (torch.float32, torch.bfloat16):
            args = (x.to(dtype), linear.blocks, linear.layout, linear.bias, linear.out_features, False)
            y = native.gguf_linear(*args)
            assert torch.equal(y, avx2.gguf_linear(*args)), (type_name, num_tokens, in_features, dtype)
            assert torch.equal(y, linear(x.to(dtype)))  # the torch op is the native build
