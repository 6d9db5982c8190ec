"""engine.lora.lora_layers: a step's adapted rows, split into long runs (views of y) and gathered rows,
give the same sums as each row's adapter added alone."""

from __future__ import annotations

import torch
from torch import nn

from engine.lora.lora_layers import MIN_RUN_ROWS, NO_SLOT, LoRALinear, LoRAStepState, split_runs


def test_long_runs_are_kept_and_short_ones_gathered_by_slot():
    slots = [1] * MIN_RUN_ROWS + [NO_SLOT, 0, 1, 0] + [0] * MIN_RUN_ROWS + [NO_SLOT] * 3 + [1, 1]
    runs, groups = split_runs(slots, torch.device("cpu"))
    first_zero_run = MIN_RUN_ROWS + 3  # the 0 at MIN_RUN_ROWS + 3 starts the long run of 0s
    assert runs == [(1, 0, MIN_RUN_ROWS), (0, first_zero_run, first_zero_run + MIN_RUN_ROWS + 1)]
    tail = first_zero_run + MIN_RUN_ROWS + 1 + 3
    assert [(slot, rows.tolist()) for slot, rows in groups] == [
        (0, [MIN_RUN_ROWS + 1]), (1, [MIN_RUN_ROWS + 2, tail, tail + 1])]
    assert split_runs([], torch.device("cpu")) == ([], [])
    assert split_runs([NO_SLOT] * 40, torch.device("cpu")) == ([], [])


def test_the_layer_adds_each_rows_adapter_once():
    torch.manual_seed(0)
    num_slots, rank, in_features, out_features = 3, 4, 8, 6
    base = nn.Linear(in_features, out_features, bias=False)
    a = torch.randn(num_slots, rank, in_features)  # [slots, R, in]
    b = torch.randn(num_slots, rank, out_features)  # [slots, R, out]: B transposed
    scales = [0.5, 2.0, 0.25]
    state = LoRAStepState()
    layer = LoRALinear(base, a, b, scales, state, is_output_layer=False)
    slots = [2] * 20 + [NO_SLOT, 0, 2, 1] + [1] * 17 + [0, NO_SLOT]  # two runs, the rest gathered
    state.prepare(slots, None, torch.device("cpu"))
    x = torch.randn(len(slots), in_features)  # [n, in]
    want = base(x)
    for row, slot in enumerate(slots):
        if slot != NO_SLOT:
            want[row] += (x[row] @ a[slot].t()) @ b[slot] * scales[slot]
    assert torch.allclose(layer(x), want, atol=1e-5)
