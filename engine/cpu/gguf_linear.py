"""A GGUF file's quantized linears, run in the file's own blocks (engine/cpu/csrc/gguf/).

`GgufLinear` holds each part's rows exactly as the file stores them (uint8 [rows, bytes per
row]; a slice of the memory-mapped file is kept as it is, not copied), but for Q4_K, Q6_K and Q4_1,
whose rows are repacked eight to a group (gguf_repack.py; only bits move, and the file's rows
are not kept beside them). Every weight dequantizes bit for bit to the file's value: `dequantize()`
is `gguf.quants.dequantize` of the file's bytes (unpacked where repacked). A merged projection
(q, k and v in one matmul) may stack parts of different types along its outputs, each kept in
its own.

Types: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K (KERNEL_TYPE_NAMES). The matmul
quantizes the activations to int8 per block as llama.cpp does (Q8_K for the K-quants, Q8_0 for
the others) and runs on AVX2's vpmaddubsw: docs/cpu-kernels.md has the measurement that chose
this over fp32 activations and the layers' bytes/s. The kernel is the torch op OP_NAME, which
the decode stack (engine/cpu/decode_stack.py) calls too.

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

from engine.cpu.gguf_repack import GROUP_ROWS, GROUPED
from engine.cpu.huge_pages import move_onto_huge_pages

logger = logging.getLogger(__name__)

KERNEL_TYPE_NAMES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")  # the kernel's types (gguf_dot.h)
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


def _kernels():
    from engine.cpu.gguf_extension import load_gguf_kernels

    return load_gguf_kernels()


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
        self.in_features = in_features
        # The kernel's parts, in row order: (type name, kernel type id, bytes, whether grouped by 8).
        kernel_parts: list[tuple[str, int, torch.Tensor, bool]] = []
        for type_name, part in parts:
            if type_name not in runnable:
                raise ValueError(f"no gguf kernel for {type_name} on this CPU (runs: {sorted(runnable) or 'none'})")
            block_inputs, block_bytes = gguf.GGML_QUANT_SIZES[_type(type_name)]
            if in_features % block_inputs or part.dim() != 2 or part.dtype != torch.uint8 \
                    or part.shape[1] != in_features // block_inputs * block_bytes:
                raise ValueError(f"a {type_name} part of {in_features} inputs is uint8 [rows, "
                                 f"{in_features // block_inputs * block_bytes}], not {part.dtype} {list(part.shape)}")
            num_grouped = part.shape[0] // GROUP_ROWS * GROUP_ROWS if type_name in GROUPED else 0
            if num_grouped:  # repacked into a copy: the file's rows are not kept beside it
                pack, _, type_id = GROUPED[type_name]
                kernel_parts.append((type_name, getattr(_kernels(), type_id)(), pack(part[:num_grouped]), True))
            if num_grouped < part.shape[0]:
                rest = part[num_grouped:]
                # A row slice of the file is already row-major: kept as it is. Anything else is copied once.
                kernel_parts.append((type_name, int(_type(type_name)),
                                     rest if rest.stride() == (rest.shape[1], 1) else rest.contiguous(), False))
        self.type_names = [name for name, _, _, _ in kernel_parts]
        self.is_grouped = [grouped for _, _, _, grouped in kernel_parts]
        self.num_parts = len(kernel_parts)
        # One buffer holds every part (the op's and the decode stack's one weight tensor): a lone
        # part as it came (a slice of the file, in place), several parts copied into one.
        pieces = [block.reshape(-1) for _, _, block, _ in kernel_parts]
        blocks = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        del kernel_parts, pieces  # the copies' sources are not kept
        self._shapes = []  # each part's [rows or groups, bytes a row or group]
        layout, offset = [], 0
        for (name, type_id, rows_or_groups, line_bytes), grouped in zip(self._describe(parts, in_features),
                                                                       self.is_grouped):
            self._shapes.append((offset, rows_or_groups, line_bytes))
            layout.append([type_id, offset, rows_or_groups * (GROUP_ROWS if grouped else 1)])
            offset += rows_or_groups * line_bytes
        assert offset == blocks.numel()
        self.register_buffer("blocks", blocks, persistent=False)  # a buffer: the model's memory counts it
        self.register_buffer("layout", torch.tensor(layout, dtype=torch.int64), persistent=False)
        self.out_features = int(self.layout[:, 2].sum())
        self.register_buffer("bias", torch.empty(0) if bias is None else bias.detach().float().contiguous(),
                             persistent=False)
        self.out_fp32 = False  # logits: the fp32 result, unrounded

    def _describe(self, parts: list[tuple[str, torch.Tensor]], in_features: int):
        """(type name, kernel type id, rows or groups, bytes a row or group) of each kernel part."""
        for type_name, part in parts:
            block_inputs, block_bytes = gguf.GGML_QUANT_SIZES[_type(type_name)]
            row_bytes = in_features // block_inputs * block_bytes
            num_grouped = part.shape[0] // GROUP_ROWS * GROUP_ROWS if type_name in GROUPED else 0
            if num_grouped:
                yield type_name, getattr(_kernels(), GROUPED[type_name][2])(), num_grouped // GROUP_ROWS, \
                    GROUP_ROWS * row_bytes
            if num_grouped < part.shape[0]:
                yield type_name, int(_type(type_name)), part.shape[0] - num_grouped, row_bytes

    @property
    def parts(self) -> list[torch.Tensor]:
        """The kernel's parts in row order, views of `blocks`, the only copy of the weight (a Q4_K, Q6_K or
        Q4_1 part's groups of 8 rows repacked, gguf_repack.py; its last rows and other types the file's rows)."""
        return [self.blocks[offset:offset + n * line].view(n, line) for offset, n, line in self._shapes]

    def _num_rows(self, i: int) -> int:
        return int(self.layout[i, 2])

    def file_rows(self, i: int) -> torch.Tensor:
        """Kernel part i as the file's rows (uint8 [rows, bytes per row]), the grouped ones unpacked."""
        part = self.parts[i]
        return GROUPED[self.type_names[i]][1](part) if self.is_grouped[i] else part

    @property
    def num_weight_bytes(self) -> int:
        return self.blocks.numel()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in_features] -> [..., out_features]
        rows = x.reshape(-1, self.in_features)  # [num_tokens, in_features]
        out = torch.ops.tokenloom_gguf.linear(rows, self.blocks, self.layout, self.bias, self.out_features,
                                              self.out_fp32)  # [num_tokens, out_features]
        return out.view(*x.shape[:-1], self.out_features)

    def dequantize(self) -> torch.Tensor:
        """fp32 [out_features, in_features]: the file's values, bit for bit."""
        return torch.cat([_dequantize(self.file_rows(i), self.type_names[i]) for i in range(self.num_parts)])

    def dequantize_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """[n] int64 -> fp32 [n, in_features]: those rows' values (a tied embedding's lookup, each
        step), read by the kernels' library with numpy's own fp32 operations (gguf_rows.cpp), so
        the same bits as dequantize() at a few µs a row where numpy took about a millisecond a call."""
        return _kernels().gguf_rows(self.blocks, self.layout, rows.reshape(-1).long(), self.in_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, types={self.type_names}"


def gather_blocks_on_huge_pages(linears: list[GgufLinear]) -> int:
    """Every GgufLinear's blocks copied into one tensor on huge pages, where Linux gives them
    (engine.cpu.huge_pages), each old buffer freed as its copy is placed; returns the bytes moved
    (0: nothing moved). A one-token step streams every weight once: on 4 KB pages each page
    missed the TLB and the hardware prefetcher stopped at its end (docs/cpu-kernels.md has the
    figures). Before the decode stack is built: it holds the buffers it was given."""
    return move_onto_huge_pages(linears, lambda m: m.blocks, _put_blocks)


def _put_blocks(module: GgufLinear, blocks: torch.Tensor) -> None:
    module.blocks = blocks  # the registered buffer; the layout's offsets are relative to it
