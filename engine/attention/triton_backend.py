"""Attention backend on the paged Triton kernels in engine/kernels/.

Its blocks are token-major, [num_blocks, block_size, num_kv_heads, head_dim], as the
kernels read them. Each layer calls store_kv with the step's new K/V, then forward,
which reads the whole context (new tokens included) back from the paged cache; nothing
needs planning per step beyond keeping the metadata. A decode-only batch goes to the decode kernel, which
handles a GQA group per program and can split long contexts (flash-decoding);
anything else, including prefill chunks with decodes mixed in, goes to the
prefill/extend kernel, for which a decode is just a chunk of one token.
"""

from __future__ import annotations

import torch

from engine.attention.backend import KVCache
from engine.attention.metadata import NO_WINDOW, AttentionMetadata
from engine.kernels.decode_attention import paged_decode_attention
from engine.kernels.prefill_attention import paged_prefill_attention
from engine.kernels.store_kv import store_kv


class TritonAttentionBackend:
    name = "triton"
    can_rotate_and_store = False  # the fused kernel writes head-major blocks

    def __init__(self, num_splits: int | None = None) -> None:
        # None lets the decode kernel pick split-K per batch; tests and CUDA graphs pin it.
        self.num_splits = num_splits
        self._metadata: AttentionMetadata | None = None

    @staticmethod
    def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        return (num_blocks, block_size, num_kv_heads, head_dim)

    def prepare(self, metadata: AttentionMetadata) -> None:
        self._metadata = metadata

    def store_kv(
        self,
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: KVCache,  # [num_blocks, block_size, num_kv_heads, head_dim] each
    ) -> None:
        k_cache, v_cache = kv_cache
        store_kv(key, value, k_cache, v_cache, self._metadata.slot_mapping)

    def rotary_store_kv(self, qkv, cos_sin, kv_cache: KVCache, num_heads: int, num_kv_heads: int) -> torch.Tensor:
        raise NotImplementedError("the fused rotary + KV store kernel writes head-major blocks")

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor | None,  # unused: the kernels read the context from the cache
        value: torch.Tensor | None,
        kv_cache: KVCache,  # [num_blocks, block_size, num_kv_heads, head_dim] each
        scale: float,
        window: int = NO_WINDOW,  # a sliding-window layer's window: both kernels read only the blocks inside it
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        k_cache, v_cache = kv_cache
        metadata = self._metadata
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
