"""The interface the attention backends implement side by side (torch_backend.py,
cpu_backend.py, triton_backend.py), as vLLM's attention backends do.

A step goes: the model runner calls `prepare(metadata)` once with the step's flat batch
(engine/attention/metadata.py), and the backend plans everything the step's layers need;
then each attention layer hands its new K/V to `store_kv` and calls `forward`.

The backend is the KV pool's one writer: it chooses the cache layout (`kv_cache_shape`)
and it alone puts K/V into a layer's cache. On the CPU fast path the store runs fused
with rotary (`rotary_store_kv`, one C++ pass over qkv), where `can_rotate_and_store`.
"""

from __future__ import annotations

from typing import Protocol

import torch

from engine.attention.metadata import NO_WINDOW, AttentionMetadata

KVCache = tuple[torch.Tensor, torch.Tensor]  # one layer's K and V pools, in the backend's block layout


class AttentionBackend(Protocol):
    name: str
    can_rotate_and_store: bool  # whether `rotary_store_kv` runs here (head-major caches, C++ kernels)

    @staticmethod
    def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        """One layer's K (or V) pool: num_blocks blocks of block_size tokens, in this backend's layout."""
        ...

    def prepare(self, metadata: AttentionMetadata) -> None:
        """A new step: plan it, once, for every layer and window to reuse."""
        ...

    def store_kv(
        self,
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: KVCache,
    ) -> None:
        """Write the step's new K/V into their slots (metadata.slot_mapping; negative slots: nowhere)."""
        ...

    def rotary_store_kv(
        self,
        qkv: torch.Tensor,  # [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim]
        cos_sin: tuple[torch.Tensor, torch.Tensor],  # [num_tokens, 1, head_dim] each
        kv_cache: KVCache,
        num_heads: int,
        num_kv_heads: int,
    ) -> torch.Tensor:  # rotated q: [num_tokens, num_heads, head_dim]
        """Rotate q and k (full rotary) and store k and v, in one pass; the rotated k replaces
        k inside `qkv`. Only where `can_rotate_and_store`."""
        ...

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor | None,  # [num_tokens, num_kv_heads, head_dim]: the step's own, already stored
        value: torch.Tensor | None,  # a backend may attend to them directly instead of reading them back
        kv_cache: KVCache,
        scale: float,
        window: int = NO_WINDOW,  # a sliding-window layer's window; NO_WINDOW: the whole context
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Attend over the prepared step's context, the new tokens included (already stored)."""
        ...
