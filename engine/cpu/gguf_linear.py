"""A GGUF file's quantized linears, run in the file's own blocks (engine/cpu/csrc/gguf/).

`GgufLinear` holds each part's rows exactly as the file stores them (uint8 [rows, bytes per
row]; a slice of the memory-mapped file is kept as it is, not copied), so every weight
dequantizes bit for bit to the file's value: `dequantize()` is `gguf.quants.dequantize` of
those very bytes. A merged projection (q, k and v in one matmul) may stack parts of different
types along its outputs, each kept in its own.

The matmul quantizes the activations to int8 per block as llama.cpp does (Q8_K for the
K-quants, Q8_0 for the others) and runs on AVX2's vpmaddubsw: docs/cpu-kernels.md has the
measurement that chose this over fp32 activations and the layers' bytes/s. The kernel is the
torch op OP_NAME, which the decode stack (engine/cpu/decode_stack.py) calls too.

`GGUF_KERNEL_TYPES` names the types this CPU runs (AVX2, FMA and F16C needed); it is empty
where the extension cannot be built. It is worked out on first access (the first build takes
a minute), not on import.
"""

from __future__ import annotations

import logging

import gguf
import numpy as np
import torch
from torch import nn

logger = logging.getLogger(__name__)

KERNEL_TYPE_NAMES = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")  # the kernel's types (gguf_dot.h)
OP_NAME = "tokenloom_gguf::linear"

_kernel_types: frozenset[str] | None = None


def kernel_types() -> frozenset[str]:
    """The gguf type names the kernels run on this CPU; empty where they cannot build or run."""
    global _kernel_types
    if _kernel_types is None:
        try:
            from engine.cpu.gguf_extension import load_gguf_kernels

            runs = load_gguf_kernels().has_gguf_kernels()
            if not runs:
                logger.warning("gguf kernels: this CPU lacks AVX2, FMA or F16C; GGUF layers are dequantized")
        except Exception as exc:  # no compiler, say: the loader dequantizes instead
            logger.warning("gguf kernels could not be built (%s); GGUF layers are dequantized", exc)
            runs = False
        _kernel_types = frozenset(KERNEL_TYPE_NAMES) if runs else frozenset()
    return _kernel_types


def __getattr__(name: str):
    if name == "GGUF_KERNEL_TYPES":  # built on first access, not on import
        return kernel_types()
    raise AttributeError(name)


def _type(name: str) -> gguf.GGMLQuantizationType:
    return gguf.GGMLQuantizationType[name]


def _dequantize(blocks: torch.Tensor, type_name: str) -> torch.Tensor:
    """uint8 [rows, bytes per row] -> fp32 [rows, in]: gguf's own dequantization, so its values exactly."""
    values = gguf.quants.dequantize(blocks.contiguous().numpy(), _type(type_name))
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))


class GgufLinear(nn.Module):
    """y = x @ W^T (+ bias), W in GGUF blocks: `parts` of (type name, uint8 [rows_i, bytes per
    row_i]) stacked along the outputs in order; x [..., in_features] fp32 or bf16, y in x's dtype."""

    OP_NAME = OP_NAME

    def __init__(self, parts: list[tuple[str, torch.Tensor]], in_features: int,
                 bias: torch.Tensor | None = None) -> None:
        super().__init__()
        if not parts:
            raise ValueError("GgufLinear needs at least one part")
        runnable = kernel_types()
        self.type_names: list[str] = []
        self.type_ids: list[int] = []
        self.in_features = in_features
        blocks = []
        for type_name, part in parts:
            if type_name not in runnable:
                raise ValueError(f"no gguf kernel for {type_name} on this CPU (runs: {sorted(runnable) or 'none'})")
            block_inputs, block_bytes = gguf.GGML_QUANT_SIZES[_type(type_name)]
            if in_features % block_inputs or part.dim() != 2 or part.dtype != torch.uint8 \
                    or part.shape[1] != in_features // block_inputs * block_bytes:
                raise ValueError(f"a {type_name} part of {in_features} inputs is uint8 [rows, "
                                 f"{in_features // block_inputs * block_bytes}], not {part.dtype} {list(part.shape)}")
            # A row slice of the file is already row-major: kept as it is. Anything else is copied once.
            blocks.append(part if part.stride() == (part.shape[1], 1) else part.contiguous())
            self.type_names.append(type_name)
            self.type_ids.append(int(_type(type_name)))
        for i, block in enumerate(blocks):  # buffers, so the model's memory counts them like any tensor
            self.register_buffer(f"part{i}", block, persistent=False)
        self.num_parts = len(blocks)
        self.out_features = sum(p.shape[0] for p in blocks)
        self.register_buffer("bias", torch.empty(0) if bias is None else bias.detach().float().contiguous(),
                             persistent=False)
        self.out_fp32 = False  # logits: the fp32 result, unrounded

    @property
    def parts(self) -> list[torch.Tensor]:
        """The file's bytes, part by part: the only copy of the weight."""
        return [getattr(self, f"part{i}") for i in range(self.num_parts)]

    @property
    def num_weight_bytes(self) -> int:
        return sum(p.numel() for p in self.parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in_features] -> [..., out_features]
        rows = x.reshape(-1, self.in_features)  # [num_tokens, in_features]
        out = torch.ops.tokenloom_gguf.linear(rows, self.parts, self.type_ids, self.bias, self.out_features,
                                              self.out_fp32)  # [num_tokens, out_features]
        return out.view(*x.shape[:-1], self.out_features)

    def dequantize(self) -> torch.Tensor:
        """fp32 [out_features, in_features]: the file's values, bit for bit."""
        return torch.cat([_dequantize(p, name) for name, p in zip(self.type_names, self.parts)])

    def dequantize_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """[n] int64 -> fp32 [n, in_features]: those rows' values (a tied embedding's lookup)."""
        rows = rows.reshape(-1).long()
        out = torch.empty(len(rows), self.in_features)
        start = 0
        for name, part in zip(self.type_names, self.parts):
            inside = ((rows >= start) & (rows < start + part.shape[0])).nonzero().squeeze(1)
            if len(inside):
                out[inside] = _dequantize(part[rows[inside] - start], name)
            start += part.shape[0]
        return out

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, types={self.type_names}"
