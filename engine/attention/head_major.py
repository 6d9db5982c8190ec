"""The head-major paged KV cache that the torch and CPU backends share, as free functions
(neither backend inherits the other).

Each block is [num_kv_heads, block_size, head_dim], so a gathered block is already laid
out for batched matmuls and the C++ kernels read one head's rows contiguously. A token's
slot s lives in block s // block_size at offset s % block_size.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch

from engine.attention.backend import KVCache


def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
    return (num_blocks, num_kv_heads, block_size, head_dim)


@dataclass
class Slots:
    """Where a step's new tokens go, split once per step rather than once per layer."""

    mapping: torch.Tensor  # [num_tokens] int64: flat slot of each new token
    blocks: torch.Tensor  # [num_tokens] its block
    offsets: torch.Tensor  # [num_tokens] its offset in the block


def split_slots(slot_mapping: torch.Tensor, block_size: int) -> Slots:
    return Slots(slot_mapping, slot_mapping // block_size, slot_mapping % block_size)


def store_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: KVCache, slots: Slots) -> None:
    # key, value: [num_tokens, num_kv_heads, head_dim]; caches [num_blocks, num_kv_heads, block_size, head_dim]
    k_cache, v_cache = kv_cache
    # Two advanced indices around a slice: the token dimension comes first, matching key.
    k_cache[slots.blocks, :, slots.offsets] = key
    v_cache[slots.blocks, :, slots.offsets] = value


def rotary_store_kv(
    kernels: ModuleType,  # engine.cpu.extension's module (fused_ops.cpp)
    qkv: torch.Tensor,  # [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim]
    cos_sin: tuple[torch.Tensor, torch.Tensor],  # [num_tokens, 1, head_dim] each, in the model dtype
    kv_cache: KVCache,
    slots: Slots,
    num_heads: int,
    num_kv_heads: int,
) -> torch.Tensor:  # rotated q: [num_tokens, num_heads, head_dim]
    """Rotate q and k, write k and v into their slots (negative slots: nowhere), one C++ pass
    with the same bits as apply_rotary then store_kv. The rotated k replaces k in `qkv`."""
    cos, sin = cos_sin
    k_cache, v_cache = kv_cache
    return kernels.rotary_store_kv(
        qkv, cos.squeeze(1), sin.squeeze(1), slots.mapping, k_cache, v_cache, num_heads, num_kv_heads
    )


def gather(cache: torch.Tensor, block_ids: torch.Tensor, num_keys: int) -> torch.Tensor:
    """The first num_keys rows of the blocks `block_ids`, in order: [num_kv_heads, num_keys, head_dim]."""
    num_kv_heads, head_dim = cache.shape[1], cache.shape[3]
    blocks = cache[block_ids].transpose(0, 1)  # [num_kv_heads, num_blocks, block_size, head_dim]
    return blocks.reshape(num_kv_heads, -1, head_dim)[:, :num_keys]
