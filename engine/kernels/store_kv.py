"""Write one step's new K and V into the paged KV cache.

Token t's K/V rows go to flat cache slot slot_mapping[t] (block_id * block_size +
offset, see engine/attention/metadata.py). A negative slot means "padding, do not
write"; the kernel skips it explicitly rather than relying on the caller to trim.

Follows nano-vllm's store_kvcache kernel: one program per token, the whole
[num_kv_heads, head_dim] row moved as one contiguous vector.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def store_kv_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,  # [num_tokens, num_kv_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping_ptr,  # [num_tokens] int64
    key_stride_token,
    value_stride_token,
    ROW_SIZE: tl.constexpr,  # num_kv_heads * head_dim: one cache slot
    ROW_SIZE_PAD: tl.constexpr,  # next power of two, since tl.arange needs one
):
    token_idx = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token_idx).to(tl.int64)
    if slot < 0:  # padding token: nothing to store
        return
    offsets = tl.arange(0, ROW_SIZE_PAD)
    mask = offsets < ROW_SIZE
    key = tl.load(key_ptr + token_idx * key_stride_token + offsets, mask=mask)
    value = tl.load(value_ptr + token_idx * value_stride_token + offsets, mask=mask)
    # A slot is one contiguous [num_kv_heads, head_dim] row of the cache, so the
    # slot index times the row size is the element offset (held in int64: large
    # caches pass 2**31 elements).
    tl.store(k_cache_ptr + slot * ROW_SIZE + offsets, key, mask=mask)
    tl.store(v_cache_ptr + slot * ROW_SIZE + offsets, value, mask=mask)


def check_kv_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """Assert the paged layout every kernel here assumes."""
    assert k_cache.dim() == 4, "cache must be [num_blocks, block_size, num_kv_heads, head_dim]"
    assert k_cache.shape == v_cache.shape and k_cache.dtype == v_cache.dtype
    assert k_cache.device == v_cache.device
    # Kernels index slots as block * block_size + offset and rows as contiguous
    # [num_kv_heads, head_dim], which only holds for a contiguous cache.
    assert k_cache.is_contiguous() and v_cache.is_contiguous(), "KV cache must be contiguous"


def store_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64; < 0 means skip
) -> None:
    """Write key/value into the caches in place at their slots."""
    check_kv_cache(k_cache, v_cache)
    num_tokens, num_kv_heads, head_dim = key.shape
    assert value.shape == key.shape, f"{value.shape} != {key.shape}"
    assert k_cache.shape[2:] == (num_kv_heads, head_dim), f"cache {k_cache.shape} vs key {key.shape}"
    assert key.dtype == value.dtype == k_cache.dtype, "cast K/V to the cache dtype first"
    assert slot_mapping.shape == (num_tokens,), f"slot_mapping {slot_mapping.shape}"
    assert not slot_mapping.dtype.is_floating_point
    # Each token's row is read as one flat vector: heads and head_dim must be
    # packed, though tokens may be strided (e.g. K/V sliced out of a fused QKV).
    row_size = num_kv_heads * head_dim
    for t in (key, value):
        assert t.stride(2) == 1 and t.stride(1) == head_dim, f"K/V rows must be packed, strides {t.stride()}"
    if num_tokens == 0:
        return
    store_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), value.stride(0),
        ROW_SIZE=row_size,
        ROW_SIZE_PAD=triton.next_power_of_2(row_size),
    )
