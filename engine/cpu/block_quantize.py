"""`--quantization int4|int8` on a CPU without AVX512_VNNI: the weights quantized into llama.cpp
blocks and run on the GGUF block kernels (engine/cpu/gguf_linear.py, AVX2), not in fp32.

int4 takes Q4_1, the format the VNNI path's panels hold (w = d q + m per block of 32, rounded
as llama.cpp's quantize_row_q4_1_ref), so both paths serve the same weights; int8 takes Q8_0
(symmetric, an fp16 scale per block of 32). The quantizer is gguf-py's (`gguf.quants.quantize`,
llama.cpp's reference rounding), so a weight here is the weight `llama-quantize` would write.
GgufLinear repacks Q4_1 rows eight to a group for its x8 kernel (engine/cpu/gguf_repack.py):
the same bits, moved.
A GGUF's own blocks (engine/loader/gguf_blocks.py: Q4_0 as Q4_1 with m = -8 d, Q4_1, Q8_0) are
written back into the type's bytes as they are, with no second rounding.

The kernels take whole blocks: a matmul whose inputs are not a multiple of 32 stays a plain
nn.Linear (the caller logs it).
"""

from __future__ import annotations

import gguf
import numpy as np
import torch
from torch import nn

from engine.cpu.gguf_linear import GgufLinear

BLOCK = 32  # inputs per block, Q4_1 and Q8_0 alike


def quantize_to_blocks(weight: torch.Tensor, type_name: str) -> torch.Tensor:
    """[out, in] float -> uint8 [out, in / 32 * bytes per block]: `type_name`'s blocks, row by row."""
    values = weight.detach().float().contiguous().numpy()
    return torch.from_numpy(np.ascontiguousarray(gguf.quants.quantize(values, gguf.GGMLQuantizationType[type_name])))


def pack_blocks(codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, type_name: str) -> torch.Tensor:
    """Unpacked blocks (codes [rows, nb * 32]: uint8 0..15 for Q4_1, int8 for Q8_0; d, m [rows, nb]
    fp16) -> uint8 [rows, nb * bytes per block] in ggml's layout (ggml-common.h's block_q4_1:
    d, m, then byte j holding codes j (low nibble) and j + 16 (high); block_q8_0: d, then 32 int8)."""
    rows, num_blocks = d.shape
    scale_bytes = d.contiguous().view(torch.uint8).view(rows, num_blocks, 2)  # [rows, nb, 2]
    if type_name == "Q8_0":
        values = codes.contiguous().view(torch.uint8).view(rows, num_blocks, BLOCK)  # [rows, nb, 32]
        parts = [scale_bytes, values]
    elif type_name == "Q4_1":
        nibbles = codes.to(torch.uint8).view(rows, num_blocks, 2, BLOCK // 2)  # [rows, nb, 2, 16]
        packed = nibbles[:, :, 0] | (nibbles[:, :, 1] << 4)  # [rows, nb, 16]
        parts = [scale_bytes, m.contiguous().view(torch.uint8).view(rows, num_blocks, 2), packed]
    else:
        raise ValueError(f"no packing into {type_name}: Q4_1 and Q8_0 only")
    return torch.cat(parts, dim=2).reshape(rows, -1)


def block_linear(weight: torch.Tensor, bias: torch.Tensor | None, type_name: str, blocks=None) -> nn.Module | None:
    """A GgufLinear of `weight` quantized to `type_name` ("Q4_1" or "Q8_0"); of a GGUF's `blocks`
    (engine.loader.gguf_blocks.GgufBlocks: codes, d, m) as they are where given. None where the
    inputs are not whole blocks."""
    out_features, in_features = weight.shape
    if in_features % BLOCK:
        return None
    if blocks is not None:
        rows = pack_blocks(blocks.codes, blocks.d, blocks.m, type_name)
    else:
        rows = quantize_to_blocks(weight, type_name)
    linear = GgufLinear([(type_name, rows)], in_features, bias)
    linear.from_gguf = blocks is not None  # fast_paths counts the GGUF's own blocks
    return linear
