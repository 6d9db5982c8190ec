"""What the paged decode and prefill attention kernels share: their input checks, the dot
precision, and the load of one cache block of K and V through a sequence's block table.

The cache is [num_blocks, block_size, num_kv_heads, head_dim] for K and for V alike
(store_kv.check_kv_cache); a sequence's block table row lists its blocks in order, so
its position p sits in block block_table[p // block_size], slot p % block_size.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.store_kv import check_kv_cache


def check_paged_inputs(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       block_tables: torch.Tensor, num_seqs: int) -> tuple[int, int]:
    """Asserts what both kernels assume of their tensors; returns the cache's block size and KV heads."""
    check_kv_cache(k_cache, v_cache)
    num_heads, head_dim = query.shape[1:]
    _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    assert cache_head_dim == head_dim and query.dtype == k_cache.dtype
    assert num_heads % num_kv_heads == 0, f"{num_heads} query heads over {num_kv_heads} KV heads"
    assert query.stride(2) == 1, "head_dim must be contiguous"
    assert block_tables.dim() == 2 and block_tables.shape[0] == num_seqs and block_tables.stride(1) == 1
    # tl.arange needs a power of two and tl.dot (p @ v) a K of at least 16.
    assert block_size >= 16 and block_size & (block_size - 1) == 0, f"unsupported block_size {block_size}"
    return block_size, num_kv_heads


def dot_precision(dtype: torch.dtype) -> str | None:
    # fp32 inputs would otherwise go through TF32 on tensor cores (~1e-3 error);
    # None keeps Triton's default, which 16-bit inputs ignore anyway.
    return "ieee" if dtype == torch.float32 else None


@triton.jit
def load_kv_block(
    k_cache_ptr, v_cache_ptr, block_tables_ptr, block_tables_stride,
    cache_stride_block, cache_stride_token, cache_stride_head,
    seq_idx, block_idx, kv_head,
    first_pos,  # positions before it load as 0 (a window's start; 0: none)
    seq_len,  # positions from it on load as 0
    dims, dim_mask,  # [HEAD_DIM_PAD]
    BLOCK_SIZE: tl.constexpr,
):
    """One block of the sequence's K and V ([BLOCK_SIZE, HEAD_DIM_PAD] each), its positions and their mask."""
    offsets = tl.arange(0, BLOCK_SIZE)
    block_id = tl.load(block_tables_ptr + seq_idx * block_tables_stride + block_idx).to(tl.int64)
    kv_positions = block_idx * BLOCK_SIZE + offsets  # [BLOCK_SIZE]
    token_mask = (kv_positions < seq_len) & (kv_positions >= first_pos)
    kv_offsets = (block_id * cache_stride_block + offsets[:, None] * cache_stride_token
                  + kv_head * cache_stride_head + dims[None, :])  # [BLOCK_SIZE, HEAD_DIM_PAD]
    # Slots past seq_len in the last block hold stale data (maybe NaN):
    # masking the loads, not just the scores, keeps it out of p @ v.
    kv_mask = token_mask[:, None] & dim_mask[None, :]
    k = tl.load(k_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
    v = tl.load(v_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
    return k, v, kv_positions, token_mask
