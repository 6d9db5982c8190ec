"""The adapted linear layers: the base layer's output plus, for each row, its adapter's
(x · Aₛᵀ) · Bₛᵀ · scaleₛ, where s is the row's pool slot. Rows are grouped by slot, one shrink
and one expand matmul per group (S-LoRA's and Punica's SGMV, in torch):

    rows:    0  1  2  3  4  5        slots: 1 -1  1  0  0 -1    (-1: the base model, nothing added)
    groups:  slot 1 -> rows [0, 2]   slot 0 -> rows [3, 4]
    y[rows] += ((x[rows] @ A[s].T) @ B[s]) * scale[s]              # [n, P*R] then [n, out]

(B kept transposed, [P*R, out], as the CPU decode stack's expand reads it.) A fused layer
(qkv_proj, gate_up_proj) keeps P rank blocks in A, one per projection (q, k, v; gate, up), and
B's output features of each projection use only that block's rows (zeros elsewhere), so
one shrink and one expand still cover all of them. The step's groups are set once per step by the
model runner (`LoRAStepState.prepare`), as the attention backend is prepared, and read by every layer.
The base layer may be any linear (fp32, bf16, the CPU wing's int8/int4/GGUF ones): it is called as is.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

NO_SLOT = -1  # a row of the base model: no adapter added
Groups = list[tuple[int, "torch.Tensor | None"]]  # (slot, the rows; None: every row)


@dataclass
class LoRAStepState:
    """One step's rows grouped by slot: over the step's tokens, and over the rows the last layer keeps
    (`output_rows`: the sampled then pooled rows, when the model runs its last layer on those alone)."""

    token_groups: Groups = field(default_factory=list)
    output_groups: Groups | None = None  # None: the last layer runs on every token too

    def prepare(self, token_groups: Groups, output_groups: Groups | None) -> None:
        self.token_groups = token_groups
        self.output_groups = output_groups


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
        groups = state.output_groups if self.is_output_layer and state.output_groups is not None else state.token_groups
        for slot, rows in groups:
            a, b, scale = self.a[slot], self.b[slot], self.scales[slot]
            if rows is None:
                y = y + (x @ a.t()) @ b * scale  # [n, P*R] -> [n, out]
            else:
                y = y.index_add(0, rows, (x[rows] @ a.t()) @ b * scale)  # [len(rows), out] into y's rows
        return y
