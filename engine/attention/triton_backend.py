"""Attention backend on the paged Triton kernels in engine/kernels/.

Same interface as the torch backend: the model calls store_kv with the step's
new K/V, then forward, which reads the whole context (new tokens included) back
from the paged cache. A decode-only batch goes to the decode kernel, which
handles a GQA group per program and can split long contexts (flash-decoding);
anything else, including prefill chunks with decodes mixed in, goes to the
prefill/extend kernel, for which a decode is just a chunk of one token.
"""

from __future__ import annotations

import torch

from engine.attention.metadata import NO_WINDOW, AttentionMetadata
from engine.kernels.decode_attention import paged_decode_attention
from engine.kernels.prefill_attention import paged_prefill_attention
from engine.kernels.store_kv import store_kv


class TritonAttentionBackend:
    name = "triton"

    def __init__(self, num_splits: int | None = None) -> None:
        # None lets the decode kernel pick split-K per batch; tests pin it.
        self.num_splits = num_splits

    @staticmethod
    def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        return (num_blocks, block_size, num_kv_heads, head_dim)

    def store_kv(
        self,
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        slot_mapping: torch.Tensor,  # [num_tokens] int64
    ) -> None:
        store_kv(key, value, k_cache, v_cache, slot_mapping)

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        scale: float,
        key: torch.Tensor | None = None,  # unused: the kernels read the context from the cache
        value: torch.Tensor | None = None,
        window: int = NO_WINDOW,  # a sliding-window layer's window: both kernels read only the blocks inside it
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        if metadata.is_decode_only:
            # One query token per sequence, so token i belongs to sequence i.
            assert query.shape[0] == metadata.num_seqs
            return paged_decode_attention(
                query, k_cache, v_cache, metadata.block_tables, metadata.seq_lens,
                metadata.max_seq_len, scale, num_splits=self.num_splits, window=window,
            )
        return paged_prefill_attention(
            query, k_cache, v_cache, metadata.block_tables, metadata.query_start_loc,
            metadata.seq_lens, metadata.max_query_len, scale, window=window,
        )
