"""The CPU attention backend: the torch backend's cache layout, with attention in C++ kernels.

Both kernels read each sequence's blocks in place through its block table
instead of gathering them into copies:

- decodes (one query token) in engine/kernels/cpu/paged_decode_attention.cpp,
  one (sequence, KV head) per task, the whole GQA group per K/V row;
- prefill chunks (a whole prompt, a chunk after earlier context or after a
  cached prefix) in engine/kernels/cpu/paged_prefill_attention.cpp, flash-style
  over tiles of queries, causal by position with no mask tensor. The torch path
  gathered every context block per layer and ran SDPA with a boolean mask, which
  on a short chunk after a long cached prefix reached a small part of the
  matmul rate.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch

from engine.attention.metadata import AttentionMetadata
from engine.attention.torch_backend import TorchAttentionBackend

@dataclass
class _KernelDecodePlan:
    rows: torch.Tensor | None  # [num_decode_seqs] query row of each decode sequence; None: row i is sequence i
    block_tables: torch.Tensor  # [num_decode_seqs, max_num_blocks] int32
    seq_lens: torch.Tensor  # [num_decode_seqs] int32


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    def __init__(self, kernels: ModuleType) -> None:
        super().__init__()
        self._kernels = kernels
        self._prefill_seq_indices: torch.Tensor | None = None  # [num_prefill_seqs] int32

    def prepare(self, metadata: AttentionMetadata, block_size: int) -> None:
        """Split the step, once, into decodes and prefill chunks; every layer reuses it."""
        self._metadata = metadata
        decode_seqs = [i for i, n in enumerate(metadata.query_lens_cpu) if n == 1]
        prefill_seqs = [i for i, n in enumerate(metadata.query_lens_cpu) if n > 1]
        self._prefill_seq_indices = torch.tensor(prefill_seqs, dtype=torch.int32) if prefill_seqs else None
        starts = metadata.query_start_loc.tolist() if decode_seqs and prefill_seqs else []
        self._decode = self._plan_decodes(decode_seqs, starts, metadata, block_size) if decode_seqs else None

    def forward(self, query, k_cache, v_cache, metadata: AttentionMetadata, scale: float, key=None, value=None) -> torch.Tensor:
        # query: [num_tokens, num_heads, head_dim] -> same shape; key and value unused (the kernels read the cache)
        if metadata is not self._metadata:
            self.prepare(metadata, k_cache.shape[2])
        if self._prefill_seq_indices is None:  # decode-only: query row i is sequence i
            return self._decode_attention(query, k_cache, v_cache, scale)
        out = torch.empty_like(query)
        if self._decode is not None:
            out[self._decode.rows] = self._decode_attention(query[self._decode.rows], k_cache, v_cache, scale)
        # Prefill chunks' rows, written in place; their keys are already in the cache.
        self._kernels.paged_prefill_attention(
            out, query, k_cache, v_cache, metadata.block_tables, metadata.seq_lens, metadata.query_start_loc,
            self._prefill_seq_indices, scale,
        )
        return out

    def _plan_decodes(
        self, seq_indices: list[int], starts: list[int], metadata: AttentionMetadata, block_size: int
    ) -> _KernelDecodePlan:
        device = metadata.block_tables.device
        if len(seq_indices) == metadata.num_seqs:  # decode-only step: every sequence, in order
            return _KernelDecodePlan(None, metadata.block_tables, metadata.seq_lens)
        rows = torch.tensor([starts[i] for i in seq_indices], device=device)
        index = torch.tensor(seq_indices, device=device)
        return _KernelDecodePlan(rows, metadata.block_tables[index], metadata.seq_lens[index])

    def _decode_attention(self, query, k_cache, v_cache, scale: float) -> torch.Tensor:
        # query: [num_decode_seqs, num_heads, head_dim] -> same shape
        plan = self._decode
        return self._kernels.paged_decode_attention(query, k_cache, v_cache, plan.block_tables, plan.seq_lens, scale)
