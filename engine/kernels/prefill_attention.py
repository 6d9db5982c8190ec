"""Paged prefill/extend attention over a flat batch of query chunks.

Sequence i contributes query tokens [query_start_loc[i], query_start_loc[i+1]);
they are the last query_len of its seq_lens[i] context tokens, so query row j sits
at position seq_lens[i] - query_len + j and attends causally to 0..that position.
The cached prefix and the new tokens are both read from the paged cache through
the block table (store_kv has already written the new ones), so a first prefill,
a later chunk of a chunked prefill and a decode (query_len 1) are the same case.

One program per (sequence, query head, tile of BLOCK_M query rows), walking the
context one cache block at a time with an online softmax (FlashAttention, Dao et
al. 2022). Scores are kept in log2 units so the kernel can use exp2.

A sliding-window layer passes its window (0: none): query row j then sees keys
position - window < k <= position, and a tile starts at its first row's window.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from engine.kernels.paged_kv import check_paged_inputs, dot_precision, load_kv_block

# Tiles of 16..64 query rows: large enough to feed tensor cores, small enough
# that a batch of short chunks (or decodes mixed in) does not waste most rows.
_MIN_BLOCK_M = 16
_MAX_BLOCK_M = 64


@triton.jit
def paged_prefill_kernel(
    query_ptr,  # [num_tokens, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables_ptr,  # [num_seqs, max_num_blocks] int32
    seq_lens_ptr,  # [num_seqs] int32
    query_start_loc_ptr,  # [num_seqs + 1] int32
    out_ptr,  # [num_tokens, num_heads, head_dim]
    scale_log2,
    window,  # a sliding window's size; 0: the whole context
    query_stride_token, query_stride_head,
    out_stride_token, out_stride_head,
    block_tables_stride,
    cache_stride_block, cache_stride_token, cache_stride_head,
    QUERIES_PER_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq_idx = tl.program_id(0)
    head = tl.program_id(1)
    tile_start = tl.program_id(2) * BLOCK_M

    query_start = tl.load(query_start_loc_ptr + seq_idx)
    query_len = tl.load(query_start_loc_ptr + seq_idx + 1) - query_start
    # The grid is sized for the longest chunk; shorter ones skip surplus tiles.
    if tile_start >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq_idx)
    num_cached = seq_len - query_len  # position of this chunk's first token

    rows = tile_start + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    row_mask = rows < query_len
    positions = num_cached + rows  # [BLOCK_M]
    kv_head = head // QUERIES_PER_KV
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_mask = dims < HEAD_DIM
    q = tl.load(
        query_ptr + (query_start + rows)[:, None] * query_stride_token + head * query_stride_head + dims[None, :],
        mask=row_mask[:, None] & dim_mask[None, :], other=0.0,
    )  # [BLOCK_M, HEAD_DIM_PAD]

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    # Causality bounds the walk: the tile's last valid row sees up to this position,
    # which is < seq_len, so the block table is never read past its valid prefix.
    last_position = num_cached + tl.minimum(tile_start + BLOCK_M, query_len) - 1
    # A window bounds it below: no row of the tile sees keys before its first row's window.
    first_block = tl.where(window > 0, tl.maximum(num_cached + tile_start - window + 1, 0) // BLOCK_SIZE, 0)
    for block_idx in range(first_block, last_position // BLOCK_SIZE + 1):
        # first_pos 0: each row's window is applied to its scores below.
        k, v, kv_positions, _ = load_kv_block(
            k_cache_ptr, v_cache_ptr, block_tables_ptr, block_tables_stride,
            cache_stride_block, cache_stride_token, cache_stride_head,
            seq_idx, block_idx, kv_head, 0, seq_len, dims, dim_mask, BLOCK_SIZE,
        )  # [BLOCK_SIZE, HEAD_DIM_PAD] each

        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_M, BLOCK_SIZE]
        # Valid rows have positions < seq_len, so the causal test also drops
        # slots past the context.
        visible = kv_positions[None, :] <= positions[:, None]  # [BLOCK_M, BLOCK_SIZE]
        visible &= (window <= 0) | (kv_positions[None, :] > positions[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row may see nothing yet (its window starts past this block): subtracting 0
        # instead of -inf keeps alpha and p at 0 rather than NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)  # rescales what was summed under the old max
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    # Padding rows past the chunk may see no key under a window (l_i = 0); they are not stored.
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + (query_start + rows)[:, None] * out_stride_token + head * out_stride_head + dims[None, :],
        out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & dim_mask[None, :],
    )


def paged_prefill_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_num_blocks] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32; seq_lens[i] >= query_len_i
    max_query_len: int,
    scale: float,
    window: int = 0,  # a sliding window's size; 0: the whole context
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    num_tokens, num_heads, head_dim = query.shape
    num_seqs = seq_lens.shape[0]
    block_size, num_kv_heads = check_paged_inputs(query, k_cache, v_cache, block_tables, num_seqs)
    assert query_start_loc.shape == (num_seqs + 1,)
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_tokens == 0:
        return out
    block_m = min(_MAX_BLOCK_M, max(_MIN_BLOCK_M, triton.next_power_of_2(max_query_len)))
    grid = (num_seqs, num_heads, triton.cdiv(max_query_len, block_m))
    paged_prefill_kernel[grid](
        query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out,
        scale * math.log2(math.e), max(window, 0),
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        block_tables.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        QUERIES_PER_KV=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=max(16, triton.next_power_of_2(head_dim)),  # tl.dot needs K >= 16
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        DOT_PRECISION=dot_precision(query.dtype),
    )
    return out
