"""Step 4 of the logits pipeline: the grammar rows' tokens that their matchers reject get -inf.

One int32 bitmask ([num_rows, ceil(vocab_size / 32)], 1 = allowed) is kept and grown
as needed; each grammar row is filled by its matcher and applied by our CPU kernel
(engine/cpu/csrc/apply_token_bitmask.cpp), which skips whole words of allowed
tokens where xgrammar's CPU apply visits every token. Without the kernels, and off
the CPU, xgrammar's own apply (its triton or CUDA kernel on a GPU) does it.
"""

from __future__ import annotations

from types import ModuleType

import torch

MIN_BITMASK_ROWS = 64


class GrammarBitmask:
    def __init__(self, kernels: ModuleType | None = None) -> None:
        self._bitmask: torch.Tensor | None = None
        self._kernels = kernels  # engine/cpu/csrc's module, or None

    def apply(self, logits: torch.Tensor, rows: list[int], grammars: list) -> None:
        """logits: [num_rows, vocab_size] fp32, in place; grammars[i] masks logits[rows[i]]."""
        import xgrammar

        num_rows, vocab_size = logits.shape
        num_words = (vocab_size + 31) // 32
        if self._bitmask is None or self._bitmask.shape[0] < num_rows or self._bitmask.shape[1] != num_words:
            self._bitmask = xgrammar.allocate_token_bitmask(max(num_rows, MIN_BITMASK_ROWS), vocab_size)
        bitmask = self._bitmask[:num_rows]  # [num_rows, ceil(vocab_size / 32)] int32
        for row, grammar in zip(rows, grammars):
            grammar.fill_bitmask(bitmask, row)
        if (self._kernels is not None and logits.device.type == "cpu" and logits.dtype == torch.float32
                and logits.is_contiguous()):
            self._kernels.apply_token_bitmask(logits, bitmask, torch.tensor(rows, dtype=torch.int64))
        else:
            xgrammar.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True), indices=rows)
