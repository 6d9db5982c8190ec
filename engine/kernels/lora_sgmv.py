"""LoRA's shrink and expand on the GPU: Punica's and S-LoRA's segmented gather matmul (SGMV).

A step's rows are sorted by adapter slot into segments, once per step (`make_segment_plan`);
every adapted layer then runs two launches over all segments at once:

    shrink:  t[rows] = x[rows] @ A[s].T                 # [n, P*R]: one program per (segment, row block)
    expand:  y[rows] += (t[rows] @ B[s].T) * scale[s]   # [n, out]: one per (segment, row block, column block)

Rows of the base model (slot -1) are in no segment and are left as they are. Each row lies in one
segment, so no two programs write the same row. Products are taken in fp32 whatever the inputs'
dtype (the adapter is small next to the base layer, and Triton's interpreter multiplies bf16 bit
patterns as integers), then y is written back in its own dtype. engine.lora.lora_layers runs the
same arithmetic in torch on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

NO_SLOT = -1  # a row of the base model (engine.lora.lora_layers.NO_SLOT)


@dataclass
class SegmentPlan:
    """One step's rows sorted by adapter slot, on the device, and the grid's row extent on the host."""

    sorted_rows: torch.Tensor  # [num_adapted_rows] int32: slot_ids[0]'s rows, then slot_ids[1]'s, ...
    starts: torch.Tensor  # [num_segments + 1] int32: segment g is sorted_rows[starts[g]:starts[g+1]]
    slot_ids: torch.Tensor  # [num_segments] int32: the pool slot of each segment
    max_rows: int  # the longest segment's row count, so the grid covers it


def make_segment_plan(slots: list[int], device: torch.device | str) -> SegmentPlan | None:
    """[num_rows] pool slots (NO_SLOT: the base) -> the plan; None when no row has an adapter."""
    rows_by_slot: dict[int, list[int]] = {}
    for row, slot in enumerate(slots):
        if slot != NO_SLOT:
            rows_by_slot.setdefault(slot, []).append(row)
    if not rows_by_slot:
        return None
    slot_ids = sorted(rows_by_slot)
    sorted_rows, starts = [], [0]
    for slot in slot_ids:
        sorted_rows += rows_by_slot[slot]
        starts.append(len(sorted_rows))
    max_rows = max(len(rows) for rows in rows_by_slot.values())

    def as_tensor(values):
        return torch.tensor(values, dtype=torch.int32, device=device)

    return SegmentPlan(as_tensor(sorted_rows), as_tensor(starts), as_tensor(slot_ids), max_rows)


@triton.jit
def lora_shrink_kernel(
    x_ptr,  # [num_rows, K]
    a_ptr,  # [num_slots, R, K]
    t_ptr,  # [num_rows, R] fp32
    rows_ptr, starts_ptr, slots_ptr,  # the SegmentPlan
    K, R,
    stride_x_row, stride_a_slot, stride_a_rank, stride_t_row,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):
    segment = tl.program_id(0)
    start = tl.load(starts_ptr + segment)
    end = tl.load(starts_ptr + segment + 1)
    first = start + tl.program_id(1) * BLOCK_M
    if first >= end:  # the grid covers the longest segment; shorter ones end early
        return
    offs_m = first + tl.arange(0, BLOCK_M)
    mask_m = offs_m < end
    rows = tl.load(rows_ptr + offs_m, mask=mask_m, other=0).to(tl.int64)
    slot = tl.load(slots_ptr + segment).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < R
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(x_ptr + rows[:, None] * stride_x_row + offs_k[None, :],
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        a = tl.load(a_ptr + slot * stride_a_slot + offs_r[None, :] * stride_a_rank + offs_k[:, None],
                    mask=mask_k[:, None] & mask_r[None, :], other=0.0)  # [BLOCK_K, BLOCK_R]: A[s].T's tile
        acc += tl.dot(x.to(tl.float32), a.to(tl.float32))
    tl.store(t_ptr + rows[:, None] * stride_t_row + offs_r[None, :], acc, mask=mask_m[:, None] & mask_r[None, :])


@triton.jit
def lora_expand_kernel(
    t_ptr,  # [num_rows, R] fp32
    b_ptr,  # [num_slots, N, R]
    scales_ptr,  # [num_slots] fp32
    y_ptr,  # [num_rows, N], updated in place
    rows_ptr, starts_ptr, slots_ptr,  # the SegmentPlan
    N, R,
    stride_t_row, stride_b_slot, stride_b_out, stride_b_rank, stride_y_row,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):
    segment = tl.program_id(0)
    start = tl.load(starts_ptr + segment)
    end = tl.load(starts_ptr + segment + 1)
    first = start + tl.program_id(1) * BLOCK_M
    if first >= end:
        return
    offs_m = first + tl.arange(0, BLOCK_M)
    mask_m = offs_m < end
    rows = tl.load(rows_ptr + offs_m, mask=mask_m, other=0).to(tl.int64)
    slot = tl.load(slots_ptr + segment).to(tl.int64)
    offs_n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        mask_r = offs_r < R
        t = tl.load(t_ptr + rows[:, None] * stride_t_row + offs_r[None, :],
                    mask=mask_m[:, None] & mask_r[None, :], other=0.0)  # [BLOCK_M, BLOCK_R]
        b = tl.load(b_ptr + slot * stride_b_slot + offs_n[None, :] * stride_b_out + offs_r[:, None] * stride_b_rank,
                    mask=mask_r[:, None] & mask_n[None, :], other=0.0)  # [BLOCK_R, BLOCK_N]: B[s].T's tile
        acc += tl.dot(t, b.to(tl.float32))
    scale = tl.load(scales_ptr + slot)
    y_ptrs = y_ptr + rows[:, None] * stride_y_row + offs_n[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    y = tl.load(y_ptrs, mask=mask, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + acc * scale).to(y_ptr.dtype.element_ty), mask=mask)


def _block(size: int, cap: int) -> int:
    return min(cap, max(16, triton.next_power_of_2(size)))  # tl.dot wants each side >= 16


def lora_shrink(x: torch.Tensor, a: torch.Tensor, plan: SegmentPlan) -> torch.Tensor:
    """x [n, K], a [slots, R, K] -> t [n, R] fp32, x[rows] @ A[s].T on each segment's rows (others 0)."""
    num_rows, k = x.shape
    rank = a.shape[1]
    assert x.stride(1) == 1 and a.stride(2) == 1 and a.shape[2] == k
    t = torch.zeros(num_rows, rank, dtype=torch.float32, device=x.device)  # [n, R]
    block_m, block_r = 16, _block(rank, 256)
    grid = (plan.slot_ids.numel(), triton.cdiv(plan.max_rows, block_m))
    lora_shrink_kernel[grid](
        x, a, t, plan.sorted_rows, plan.starts, plan.slot_ids, k, rank,
        x.stride(0), a.stride(0), a.stride(1), t.stride(0),
        BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=64,
    )
    return t


def lora_expand(t: torch.Tensor, b: torch.Tensor, scales: torch.Tensor, plan: SegmentPlan,
                y: torch.Tensor) -> torch.Tensor:
    """y[rows] += (t[rows] @ B[s].T) * scales[s] on each segment's rows, in place; returns y. `b` is
    [slots, N, R] as indexed; any strides (the CPU pool keeps it transposed, [slots, R, N] in memory)."""
    num_out, rank = b.shape[1], b.shape[2]
    assert t.dtype == torch.float32 and scales.dtype == torch.float32
    assert y.stride(1) == 1 and y.shape[1] == num_out
    block_m, block_n = 16, 64
    grid = (plan.slot_ids.numel(), triton.cdiv(plan.max_rows, block_m), triton.cdiv(num_out, block_n))
    lora_expand_kernel[grid](
        t, b, scales, y, plan.sorted_rows, plan.starts, plan.slot_ids, num_out, rank,
        t.stride(0), b.stride(0), b.stride(1), b.stride(2), y.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=_block(rank, 64),
    )
    return y


def add_lora(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scales: torch.Tensor,
             plan: SegmentPlan | None) -> torch.Tensor:
    """y += each adapted row's (x · Aₛᵀ) · Bₛᵀ · scaleₛ (in place; y is the base layer's output)."""
    if plan is None:
        return y
    return lora_expand(lora_shrink(x, a, plan), b, scales, plan, y)
