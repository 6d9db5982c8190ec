"""The GGUF block kernels as the loader sees them: which ggml types run as they are, and the
modules that run them (engine/loader/gguf_model.py builds the model with these).

`GgufLinear` (engine/cpu/gguf_linear.py) multiplies by a weight held in the file's own blocks,
rows of several types stacked (a Q4_K_M file's qkv_proj: Q4_K rows for q and k, Q6_K for v).
`GgufEmbedding` reads an embedding's rows back out of one (the LM head's, when tied), so the
vocabulary is held once, in its blocks, as int8_linear.QuantizedEmbedding does for int8.

Where the block kernels cannot be built or run here, no type has a kernel (GGUF_KERNEL_TYPES is
empty): every GGUF tensor is then dequantized into the model's dtype as it loads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

@dataclass(frozen=True)
class GgufKernels:
    types: frozenset[str]  # ggml type names with a kernel on this CPU ("Q4_K", "Q8_0")
    linear: Callable[..., nn.Module] | None  # GgufLinear(parts, in_features, bias=None)

    def embedding(self, table: nn.Module, dtype: torch.dtype, is_shared: bool) -> nn.Module:
        return GgufEmbedding(table, dtype, is_shared)


def load_gguf_kernels() -> GgufKernels:
    """engine/cpu/gguf_linear.py's types (none where its extension cannot build) and GgufLinear."""
    from engine.cpu import gguf_linear  # its kernels build on first use

    return GgufKernels(frozenset(gguf_linear.GGUF_KERNEL_TYPES), gguf_linear.GgufLinear)


class GgufEmbedding(nn.Module):
    """token ids -> their rows of a GgufLinear's weight, in `dtype`."""

    def __init__(self, table: nn.Module, dtype: torch.dtype, is_shared: bool) -> None:
        super().__init__()
        if is_shared:
            self._shared = [table]  # the LM head's: the model's module, listed once, as lm_head
        else:
            self.table = table
        self.dtype = dtype

    @property
    def rows(self) -> nn.Module:
        return self._shared[0] if hasattr(self, "_shared") else self.table

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = self.rows.dequantize_rows(input_ids.reshape(-1))  # [num_tokens, hidden] fp32
        return rows.to(self.dtype).view(*input_ids.shape, -1)
