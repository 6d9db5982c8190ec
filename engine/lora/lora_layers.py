"""The adapted linear layers: the base layer's output plus, for each row, its adapter's
(x · Aₛᵀ) · Bₛᵀ · scaleₛ, where s is the row's pool slot. Rows are grouped by slot, one shrink
and one expand matmul per group (S-LoRA's and Punica's SGMV, in torch):

    rows:    0  1  2  3  4  5        slots: 1 -1  1  0  0 -1    (-1: the base model, nothing added)
    groups:  slot 1 -> rows [0, 2]   slot 0 -> rows [3, 4]
    y[rows] += ((x[rows] @ A[s].T) @ B[s]) * scale[s]              # [n, P*R] then [n, out]

In the eager layers a run of 16 or more rows of one slot (a prefill chunk) is added through a view
of those rows of y instead (`split_runs`), and only the rest are gathered and scattered.
(B kept transposed, [P*R, out], as the CPU decode stack's expand reads it.) A fused layer
(qkv_proj, gate_up_proj) keeps P rank blocks in A, one per projection (q, k, v; gate, up), and
B's output features of each projection use only that block's rows (zeros elsewhere), so
one shrink and one expand still cover all of them. The step's groups are set once per step by the
model runner (`LoRAStepState.prepare`), as the attention backend is prepared, and read by every layer.
The base layer may be any linear (fp32, bf16, the CPU wing's int8/int4/GGUF ones): it is called as is.
On the GPU the same sums run as two Triton launches per layer over every slot's rows at once
(engine.kernels.lora_sgmv), from a segment plan made once per step instead of the groups.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

NO_SLOT = -1  # a row of the base model: no adapter added
MIN_RUN_ROWS = 16  # a run of one slot's rows this long adds through a view of y; shorter ones are gathered
Groups = list[tuple[int, "torch.Tensor | None"]]  # (slot, the rows; None: every row)
Runs = list[tuple[int, int, int]]  # (slot, first row, end row): contiguous rows of one slot


@dataclass
class LoRAStepState:
    """One step's rows by slot: the decode stack's groups over the step's tokens, and the eager layers'
    runs over the tokens and over the rows the last layer keeps (the sampled then pooled rows, when
    the model runs its last layer on those alone). With `uses_kernels` (the GPU), Triton segment
    plans of the same rows instead."""

    scales: torch.Tensor | None = None  # [max_loras] fp32 on the device, for the kernels (the pool fills it)
    uses_kernels: bool = False
    token_groups: Groups = field(default_factory=list)  # the CPU decode stack's (engine/cpu/decode_stack.py)
    # The eager layers' split: long runs (a prefill chunk) through views, the rest gathered by slot.
    token_runs: tuple[Runs, Groups] = ([], [])
    output_runs: tuple[Runs, Groups] | None = None  # None: the last layer runs on every token too
    token_plan: Any = None  # engine.kernels.lora_sgmv.SegmentPlan; None: no row has an adapter
    output_plan: Any = None
    selects_output: bool = False  # whether the last layer runs on the output rows alone

    def prepare(self, token_slots: list[int], output_slots: list[int] | None, device: torch.device) -> None:
        """Each token's slot (NO_SLOT: the base; [] for a step of the base alone), and each output row's."""
        self.selects_output = output_slots is not None
        if self.uses_kernels:
            # Imported here: triton is the `gpu` extra, and a CPU server never runs these kernels.
            from engine.kernels.lora_sgmv import make_segment_plan

            self.token_plan = make_segment_plan(token_slots, device)
            self.output_plan = make_segment_plan(output_slots, device) if self.selects_output else None
        else:
            self.token_groups = group_rows(token_slots, device) if token_slots else []
            self.token_runs = split_runs(token_slots, device)
            self.output_runs = split_runs(output_slots, device) if self.selects_output else None


def group_rows(slots: list[int], device: torch.device) -> Groups:
    """[num_rows] slots -> the groups of rows of each adapter slot (the base's rows in none)."""
    distinct = set(slots)
    if len(distinct) == 1:
        (slot,) = distinct
        return [] if slot == NO_SLOT else [(slot, None)]
    rows: dict[int, list[int]] = {}
    for row, slot in enumerate(slots):
        if slot != NO_SLOT:
            rows.setdefault(slot, []).append(row)
    return [(slot, torch.tensor(r, dtype=torch.int64, device=device)) for slot, r in sorted(rows.items())]


def split_runs(slots: list[int], device: torch.device) -> tuple[Runs, Groups]:
    """The runs of MIN_RUN_ROWS or more rows of one slot (a prefill chunk), and the other adapted rows
    grouped by slot (decodes, short chunks): a run needs no gather of x and no scatter into y."""
    runs: Runs = []
    rest: dict[int, list[int]] = {}
    start = 0
    for end in range(1, len(slots) + 1):
        if end < len(slots) and slots[end] == slots[start]:
            continue
        slot = slots[start]
        if slot != NO_SLOT:
            if end - start >= MIN_RUN_ROWS:
                runs.append((slot, start, end))
            else:
                rest.setdefault(slot, []).extend(range(start, end))
        start = end
    return runs, [(slot, torch.tensor(r, dtype=torch.int64, device=device)) for slot, r in sorted(rest.items())]


class LoRALinear(nn.Module):
    """`base` plus each row's adapter, from this layer's pool tensors (engine.lora.adapter_pool)."""

    def __init__(self, base: nn.Module, a: torch.Tensor, b: torch.Tensor, scales: list[float],
                 state: LoRAStepState, is_output_layer: bool) -> None:
        super().__init__()
        self.base = base
        self.a = a  # [max_loras, P * max_rank, in]
        self.b = b  # [max_loras, P * max_rank, out]
        self.scales = scales  # [max_loras]: the pool's list, updated as slots are filled
        self.state = state
        # The last decoder layer's o_proj, gate_up_proj and down_proj run on the output rows alone.
        self.is_output_layer = is_output_layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)  # [n, out]
        state = self.state
        if state.uses_kernels:
            from engine.kernels.lora_sgmv import add_lora  # the gpu extra's (see LoRAStepState.prepare)

            plan = state.output_plan if self.is_output_layer and state.selects_output else state.token_plan
            # B is [slots, P*R, out] in memory; the kernel takes it as [slots, out, P*R] at any strides.
            return add_lora(y, x, self.a, self.b.transpose(1, 2), state.scales, plan)
        runs, groups = state.output_runs if self.is_output_layer and state.output_runs is not None else state.token_runs
        # In place, y being the base layer's fresh output, and scaled inside the expand's matmul (alpha):
        # no copy of y per group, no [n, out] temporary; a long run (a prefill chunk) is a view of y's
        # rows, with no gather of x or scatter into y. The sums are the same.
        for slot, start, end in runs:
            shrunk = x[start:end] @ self.a[slot].t()  # [end - start, P*R]
            y[start:end].addmm_(shrunk, self.b[slot], alpha=self.scales[slot])  # += [end - start, out]
        for slot, rows in groups:
            expanded = (x[rows] @ self.a[slot].t()) @ self.b[slot]  # [len(rows), out]
            y.index_add_(0, rows, expanded, alpha=self.scales[slot])
        return y
