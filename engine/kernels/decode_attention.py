"""Paged decode attention: one query token per sequence over its paged context.

One program per (sequence, KV head): it loads all the query heads that share that
KV head (grouped-query attention), so each K/V block is read from memory once per
group rather than once per query head, then walks the sequence's block table one
cache block at a time with an online softmax (FlashAttention, Dao et al. 2022).

With few sequences and long contexts that leaves most of the GPU idle, so the
split-K variant (flash-decoding, Dao et al. 2023) also splits each context into
chunks of blocks, one program each: every program writes its partial (max, sum,
unnormalized acc) and a second kernel rescales and combines them.

A sliding-window layer passes its window (0: none): each sequence then sees only its
last `window` positions, and its programs walk only the blocks that hold them.

Scores are kept in log2 units (scale * log2(e) folded into the scale) so the
kernels use exp2; the partial maxima are in the same units.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from engine.kernels.paged_kv import check_paged_inputs, dot_precision, load_kv_block

# Split only when one wave of (sequence, KV head) programs would leave SMs idle;
# 128 is about one program per SM on current datacenter GPUs.
_TARGET_NUM_PROGRAMS = 128
# Below this many tokens per chunk the reduce pass costs more than it saves.
_MIN_TOKENS_PER_SPLIT = 256
_MAX_NUM_SPLITS = 32
# tl.dot needs at least 16 rows, so a GQA group is padded up to this.
_MIN_GROUP_PAD = 16


@triton.jit
def paged_decode_kernel(
    query_ptr,  # [num_seqs, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables_ptr,  # [num_seqs, max_num_blocks] int32
    seq_lens_ptr,  # [num_seqs] int32
    out_ptr,  # [num_seqs, num_heads, head_dim]; written only when not IS_SPLIT
    part_acc_ptr,  # [num_seqs, num_heads, num_splits, HEAD_DIM_PAD] fp32; only IS_SPLIT
    part_max_ptr,  # [num_seqs, num_heads, num_splits] fp32 (log2 units); only IS_SPLIT
    part_sum_ptr,  # [num_seqs, num_heads, num_splits] fp32; only IS_SPLIT
    scale_log2,
    window,  # a sliding window's size; 0: the whole context
    num_heads,
    num_splits,
    num_blocks_per_split,
    query_stride_seq, query_stride_head,
    out_stride_seq, out_stride_head,
    block_tables_stride,
    cache_stride_block, cache_stride_token, cache_stride_head,
    QUERIES_PER_KV: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    IS_SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq_idx = tl.program_id(0)
    kv_head = tl.program_id(1)
    split_idx = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + seq_idx)
    first_pos = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)  # the window's first position
    start_block = first_pos // BLOCK_SIZE + split_idx * num_blocks_per_split
    end_block = tl.minimum(start_block + num_blocks_per_split, tl.cdiv(seq_len, BLOCK_SIZE))

    group = tl.arange(0, GROUP_PAD)
    heads = kv_head * QUERIES_PER_KV + group  # [GROUP_PAD]
    group_mask = group < QUERIES_PER_KV
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_mask = dims < HEAD_DIM
    q = tl.load(
        query_ptr + seq_idx * query_stride_seq + heads[:, None] * query_stride_head + dims[None, :],
        mask=group_mask[:, None] & dim_mask[None, :], other=0.0,
    )  # [GROUP_PAD, HEAD_DIM_PAD]

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    # Only blocks holding at least one context token are visited, so the block
    # table is never read past its valid prefix and m_i is finite after one step.
    for block_idx in range(start_block, end_block):
        k, v, _, token_mask = load_kv_block(
            k_cache_ptr, v_cache_ptr, block_tables_ptr, block_tables_stride,
            cache_stride_block, cache_stride_token, cache_stride_head,
            seq_idx, block_idx, kv_head, first_pos, seq_len, dims, dim_mask, BLOCK_SIZE,
        )  # [BLOCK_SIZE, HEAD_DIM_PAD] each
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [GROUP_PAD, BLOCK_SIZE]
        s = tl.where(token_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)  # rescales what was summed under the old max
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    if IS_SPLIT:
        # An empty chunk (context shorter than this split) writes max=-inf,
        # sum=0, acc=0, which the reduce kernel weighs as zero.
        part = (seq_idx * num_heads + heads) * num_splits + split_idx  # [GROUP_PAD]
        tl.store(part_max_ptr + part, m_i, mask=group_mask)
        tl.store(part_sum_ptr + part, l_i, mask=group_mask)
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM_PAD + dims[None, :], acc, mask=group_mask[:, None])
    else:
        out = acc / l_i[:, None]
        tl.store(
            out_ptr + seq_idx * out_stride_seq + heads[:, None] * out_stride_head + dims[None, :],
            out.to(out_ptr.dtype.element_ty), mask=group_mask[:, None] & dim_mask[None, :],
        )


@triton.jit
def split_reduce_kernel(
    part_acc_ptr,  # [num_seqs, num_heads, num_splits, HEAD_DIM_PAD] fp32
    part_max_ptr,  # [num_seqs, num_heads, num_splits] fp32 (log2 units)
    part_sum_ptr,  # [num_seqs, num_heads, num_splits] fp32
    out_ptr,  # [num_seqs, num_heads, head_dim]
    num_heads,
    num_splits,
    out_stride_seq, out_stride_head,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    NUM_SPLITS_PAD: tl.constexpr,
):
    seq_idx = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, NUM_SPLITS_PAD)
    split_mask = splits < num_splits
    dims = tl.arange(0, HEAD_DIM_PAD)
    part = (seq_idx * num_heads + head) * num_splits + splits  # [NUM_SPLITS_PAD]
    m = tl.load(part_max_ptr + part, mask=split_mask, other=float("-inf"))
    l = tl.load(part_sum_ptr + part, mask=split_mask, other=0.0)
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM_PAD + dims[None, :],
                  mask=split_mask[:, None], other=0.0)  # [NUM_SPLITS_PAD, HEAD_DIM_PAD]
    # Split 0 always holds a token (the window's first), so m_max is finite and empty splits weigh 0.
    m_max = tl.max(m, 0)
    weight = tl.exp2(m - m_max)  # [NUM_SPLITS_PAD]
    out = tl.sum(acc * weight[:, None], 0) / tl.sum(l * weight, 0)  # [HEAD_DIM_PAD]
    tl.store(out_ptr + seq_idx * out_stride_seq + head * out_stride_head + dims,
             out.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int) -> int:
    """How many context chunks per sequence: 1 unless the batch underfills the GPU."""
    num_programs = num_seqs * num_kv_heads
    num_splits = min(
        triton.cdiv(_TARGET_NUM_PROGRAMS, num_programs),
        max_seq_len // _MIN_TOKENS_PER_SPLIT,
        _MAX_NUM_SPLITS,
    )
    # A power of two keeps the number of distinct compiled reduce kernels small.
    return 1 if num_splits <= 1 else 1 << (num_splits.bit_length() - 1)


def paged_decode_attention(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_num_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, each >= 1
    max_seq_len: int,
    scale: float,
    num_splits: int | None = None,  # None: choose_num_splits; 1 forces the single pass
    window: int = 0,  # a sliding window's size; 0: the whole context
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = check_paged_inputs(query, k_cache, v_cache, block_tables, num_seqs)
    assert seq_lens.shape == (num_seqs,)
    queries_per_kv = num_heads // num_kv_heads
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))  # tl.dot needs K >= 16
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_seqs == 0:
        return out
    num_blocks = triton.cdiv(max_seq_len, block_size)  # the most blocks one sequence's decode reads
    if window > 0:  # the window's blocks: it may start mid-block
        num_blocks = min(num_blocks, triton.cdiv(window, block_size) + 1)
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, num_kv_heads, min(max_seq_len, num_blocks * block_size))
    num_blocks_per_split = triton.cdiv(num_blocks, num_splits)
    is_split = num_splits > 1
    if is_split:
        part_acc = torch.empty(num_seqs, num_heads, num_splits, head_dim_pad, dtype=torch.float32, device=query.device)
        part_max = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=query.device)
        part_sum = torch.empty_like(part_max)
    else:  # never touched: IS_SPLIT compiles the partial stores away
        part_acc = part_max = part_sum = out

    paged_decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        query, k_cache, v_cache, block_tables, seq_lens, out, part_acc, part_max, part_sum,
        scale * math.log2(math.e), max(window, 0), num_heads, num_splits, num_blocks_per_split,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        block_tables.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        QUERIES_PER_KV=queries_per_kv,
        GROUP_PAD=max(_MIN_GROUP_PAD, triton.next_power_of_2(queries_per_kv)),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=block_size,
        IS_SPLIT=is_split,
        DOT_PRECISION=dot_precision(query.dtype),
    )
    if is_split:
        split_reduce_kernel[(num_seqs, num_heads)](
            part_acc, part_max, part_sum, out, num_heads, num_splits,
            out.stride(0), out.stride(1),
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=head_dim_pad,
            NUM_SPLITS_PAD=triton.next_power_of_2(num_splits),
        )
    return out
