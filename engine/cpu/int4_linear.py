"""`--quantization int4`: W4A8 linears in llama.cpp's Q4_1 format, on our vpdpbusd kernel
(engine/cpu/csrc/quantized/int4_linear.cpp).

A single user's decode step reads every weight once, so its speed is the weight bytes over the
memory's read rate: Q4_1 holds a weight in 0.625 bytes (a 4-bit code, and an fp16 scale d and
minimum m per block of 32: w = d * q + m), 0.31 of bf16's. Any bf16/fp32 checkpoint is quantized
at load time as llama.cpp's quantize_row_q4_1 does (d = (max - min) / 15, m = min, q rounded);
a GGUF's Q4_1 or Q4_0 blocks are packed as they are (engine/loader/gguf_blocks.py; Q4_0's
d (q - 8) is d q + m with m = -8 d), with no second rounding. Activations are quantized inside the kernel per token and block of 32, as
llama.cpp's Q8_1, and stay in fp32 between matmuls (engine/worker/dtype_policy.py).

`Int4Linear` replaces each nn.Linear (the LM head's too) through engine/cpu/fast_paths.py,
as Int8Linear does; a tied embedding reads its rows back out of the head's blocks
(int8_linear.QuantizedEmbedding), so the vocabulary is held once. Like int8 it needs AVX512_VNNI
(engine/cpu/quantized_plan.py, shared); without it int4 runs as the same Q4_1 blocks on the AVX2
GGUF kernels (engine/cpu/block_quantize.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.cpu.int8_linear import QuantizedLinear
from engine.cpu.quantized_plan import INT4_BLOCK, PANEL, QuantizedPlan

BLOCK = INT4_BLOCK  # inputs per (d, m), and per activation scale
WORDS_PER_BLOCK = BLOCK // 8  # a row's 32 codes in 4 words of 8 nibbles


@dataclass
class Q4Weight:
    """A weight in the kernel's layout, with what it needs to undo the quantization."""

    panels: torch.Tensor  # [padded_out / 32, num_blocks * 4, 32] int32: 8 codes of one row per word
    dm: torch.Tensor  # [padded_out / 32, num_blocks, 2, 32] fp16: a panel's d, then its m, block by block
    out_features: int
    in_features: int


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[out, in] float -> (codes [out, num_blocks * 32] uint8 in [0, 15], zeros past `in`;
    d, m [out, num_blocks] fp16), as llama.cpp's quantize_row_q4_1_ref."""
    out_features, in_features = weight.shape
    num_blocks = -(-in_features // BLOCK)
    w = torch.zeros(out_features, num_blocks * BLOCK)
    w[:, :in_features] = weight.detach().float()
    blocks = w.view(out_features, num_blocks, BLOCK)  # [out, num_blocks, 32]
    low, high = blocks.amin(dim=2), blocks.amax(dim=2)  # [out, num_blocks]
    d = (high - low) / 15
    inverse = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    # llama.cpp truncates (x - min) / d + 0.5, i.e. rounds halves up; the values are >= 0.
    codes = torch.floor((blocks - low[:, :, None]) * inverse[:, :, None] + 0.5).clamp_(0, 15).to(torch.uint8)
    return codes.view(out_features, num_blocks * BLOCK), d.half(), low.half()


def pack_panels(codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor, in_features: int) -> Q4Weight:
    """(codes [out, num_blocks * 32] uint8, d and m [out, num_blocks] fp16) -> the kernel's panels:
    byte c of word (p, 4 b + i, j) holds inputs 8 i + c (low nibble) and 8 i + 4 + c (high) of
    block b, row 32 p + j; rows padded with zero codes, d and m."""
    out_features, padded_in = codes.shape
    num_blocks = padded_in // BLOCK
    padded_out = -(-out_features // PANEL) * PANEL
    num_panels = padded_out // PANEL
    padded = torch.zeros(padded_out, num_blocks, WORDS_PER_BLOCK, 2, 4, dtype=torch.uint8)
    padded[:out_features] = codes.view(out_features, num_blocks, WORDS_PER_BLOCK, 2, 4)
    nibbles = padded[:, :, :, 0] | (padded[:, :, :, 1] << 4)  # [padded_out, num_blocks, 4, 4] bytes
    words = nibbles.view(torch.int32).view(num_panels, PANEL, num_blocks * WORDS_PER_BLOCK)
    dm = torch.zeros(padded_out, num_blocks, 2, dtype=torch.float16)
    dm[:out_features, :, 0], dm[:out_features, :, 1] = d, m
    return Q4Weight(words.transpose(1, 2).contiguous(),
                    dm.view(num_panels, PANEL, num_blocks, 2).permute(0, 2, 3, 1).contiguous(),
                    out_features, in_features)


def dequantize_rows(weight: Q4Weight, rows: torch.Tensor) -> torch.Tensor:
    """[n] int64 -> [n, in_features] fp32: d * q + m, read back from the panels."""
    words = weight.panels[rows // PANEL, :, rows % PANEL].contiguous()  # [n, num_blocks * 4] int32
    nibbles = words.view(torch.uint8).view(len(rows), -1, WORDS_PER_BLOCK, 1, 4)  # [n, num_blocks, 4, 1, 4]
    codes = torch.cat([nibbles & 15, nibbles >> 4], dim=3).reshape(len(rows), -1, BLOCK)  # [n, num_blocks, 32]
    dm = weight.dm[rows // PANEL, :, :, rows % PANEL].float()  # [n, num_blocks, 2]
    values = codes.float() * dm[:, :, 0:1] + dm[:, :, 1:2]
    return values.reshape(len(rows), -1)[:, : weight.in_features]


class Int4Linear(QuantizedLinear):
    """y = x @ W^T (+ bias), W in Q4_1 blocks of 32 inputs, x int8 per block; y in x's dtype.
    Its `scales` are the blocks' d and m."""

    OP_NAME = "tokenloom_int8::linear_q4"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, plan: QuantizedPlan,
                 blocks: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> None:
        """`blocks`: (codes, d, m) already in Q4_1's form (a GGUF's), packed as they are; else `weight` is quantized."""
        codes, d, m = blocks if blocks is not None else quantize_weight(weight)
        quantized = pack_panels(codes, d, m, weight.shape[1])
        super().__init__(plan.kernels.int4_linear, plan.kernels.int4_rows, quantized.panels, quantized.dm,
                         *weight.shape, bias)
        self.quantized = quantized
        self.from_gguf = blocks is not None
