"""The CPU attention backend: the torch backend with decodes in a C++ kernel.

Decode attention dominates a CPU decode step once the matmuls run on prepacked
weights: the torch path gathers every block of every sequence into a fresh
tensor, then runs thousands of tiny per-block matmuls over it. The kernel
(engine/kernels/cpu/paged_decode_attention.cpp) reads each sequence's blocks
in place through its block table instead, one (sequence, KV head) per task.
Prefill chunks keep the torch path (SDPA over the gathered context), whose
blocked matmuls already suit long queries.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch

from engine.attention.metadata import AttentionMetadata
from engine.attention.torch_backend import TorchAttentionBackend


@dataclass
class _KernelDecodePlan:
    rows: torch.Tensor  # [num_decode_seqs] query row of each decode sequence
    block_tables: torch.Tensor  # [num_decode_seqs, max_num_blocks] int32
    seq_lens: torch.Tensor  # [num_decode_seqs] int32


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    def __init__(self, kernels: ModuleType) -> None:
        super().__init__()
        self._kernels = kernels

    def _plan_decodes(
        self, seq_indices: list[int], starts: list[int], metadata: AttentionMetadata, block_size: int
    ) -> _KernelDecodePlan:
        device = metadata.block_tables.device
        rows = torch.tensor([starts[i] for i in seq_indices], device=device)
        if len(seq_indices) == metadata.num_seqs:  # decode-only step: every sequence, in order
            return _KernelDecodePlan(rows, metadata.block_tables, metadata.seq_lens)
        index = torch.tensor(seq_indices, device=device)
        return _KernelDecodePlan(rows, metadata.block_tables[index], metadata.seq_lens[index])

    def _decode_attention(self, query, k_cache, v_cache, scale: float) -> torch.Tensor:
        # query: [num_decode_seqs, num_heads, head_dim] -> same shape
        plan = self._decode
        return self._kernels.paged_decode_attention(query, k_cache, v_cache, plan.block_tables, plan.seq_lens, scale)
