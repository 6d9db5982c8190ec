"""LoRA under tensor parallelism (vLLM's scheme): each rank holds its shard of every adapter, cut
the way its base layer is, so the adapters need no collective of their own.

    column-parallel (qkv_proj, gate_up_proj):  x whole on every rank
        A whole [r, in]; B: this rank's rows of each part (q, k, v; gate, up), as the base weight's
        y_i = W_i x + B_i (A x) s                         this rank's outputs, complete
    row-parallel (o_proj, down_proj):          x_i, this rank's slice of the input features
        A: this rank's columns [r, in / N]; B whole [out, r]
        y = Σ_i (W_i x_i + B (A_i x_i) s)                 added to the partial sum BEFORE the
                                                          layer's all-reduce: Σ_i B A_i x_i = B A x

The scale s is applied once on each rank, inside the sum. Every rank reads the adapter from its
folder and keeps only its shard (`AdapterSharding.shard`); rank 0 decides which adapter goes in
which pool slot, and each step's `StepInputs.lora_adapters` names the step's (slot, adapter) pairs,
so a worker fills a slot the first time it sees a new adapter there (`use_step_adapters`).
"""

from __future__ import annotations

import dataclasses

import msgspec
import torch
import torch.nn.functional as F
from torch import nn

from engine.lora.adapter_files import AdapterPart, LoRAWeights
from engine.lora.lora_layers import LoRALinear, LoRAStepState
from engine.parallel.parallel_layers import RowParallelLinear, num_local_kv_heads, shard_rows
from engine.parallel.parallel_state import TensorParallelGroup
from ipc.lora_adapter import ModelShape
from ipc.messages import LoRARequest

ROW_PARALLEL = ("o_proj", "down_proj")
COLUMN_PARTS = {"qkv_proj": ("q", "k", "v"), "gate_up_proj": ("gate", "up")}


class LoRASlot(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """An adapter of a step and the pool slot rank 0 put it in (sent to the workers in StepInputs)."""

    slot: int
    lora_name: str
    lora_int_id: int
    lora_path: str


class AdapterSharding:
    """This rank's cut of adapters made for the whole model (`shape`, checked against it first)."""

    def __init__(self, shape: ModelShape, model_config, tp: TensorParallelGroup) -> None:
        self.shape = shape
        self.model_config = model_config  # engine.models.config.ModelConfig: the KV heads' layout
        self.tp = tp
        kv_heads = num_local_kv_heads(model_config.num_kv_heads, tp.size)
        # The layers' local sizes: what the pool's A and B are allocated for.
        self.local_shape = dataclasses.replace(shape, q_size=shape.q_size // tp.size,
                                               kv_size=kv_heads * (shape.kv_size // model_config.num_kv_heads),
                                               intermediate_size=shape.intermediate_size // tp.size)

    def shard(self, weights: LoRAWeights) -> LoRAWeights:
        layers = {key: [self._shard_part(key[1], part) for part in parts] for key, parts in weights.layers.items()}
        return LoRAWeights(weights.path, weights.rank, weights.scale, layers)

    def _shard_part(self, module: str, part: AdapterPart) -> AdapterPart:
        tp = self.tp
        if module in ROW_PARALLEL:  # the input is sharded: A's columns, B whole
            width = part.a.shape[1] // tp.size
            a = part.a[:, tp.rank * width : (tp.rank + 1) * width].contiguous()  # [rank, in / N]
            return AdapterPart(part.part_index, part.out_start, part.out_end, a, part.b_t)
        # Column-parallel: B's rows of each projection part it covers (one, or all of a fused
        # PEFT module's, Phi-3's), cut as the base weight's rows are and laid out as our local layer's.
        pieces, names = [], []
        for name in COLUMN_PARTS[module]:
            start, end = self.shape.out_slice(module, name)
            if part.out_start <= start and end <= part.out_end:
                b = part.b_t.t()  # [out, rank]: the base weight's row layout, as shard_rows cuts it
                pieces.append(shard_rows(name, b, start - part.out_start, end - start, self.model_config, tp))
                names.append(name)
        local_start = self.local_shape.out_slice(module, names[0])[0]
        local_end = self.local_shape.out_slice(module, names[-1])[1]
        b_t = torch.cat(pieces).t().contiguous()  # [rank, local_end - local_start]
        return AdapterPart(part.part_index, local_start, local_end, part.a, b_t)


class RowParallelMatmul(nn.Module):
    """A row-parallel layer's local matmul alone (its packed one, or the plain weight), no all-reduce:
    the base a LoRALinear adds to before the layer reduces."""

    def __init__(self, layer: RowParallelLinear) -> None:
        super().__init__()
        self.packed = layer.packed
        self.weight = layer.weight  # [out_features, in_features / N], shared with the layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.packed(x) if self.packed is not None else F.linear(x, self.weight)  # [n, out] partial


def attach_lora(parent: nn.Module, name: str, a: torch.Tensor, b: torch.Tensor, scales: list[float],
                state: LoRAStepState, is_output_layer: bool) -> LoRALinear:
    """Wrap `parent.<name>` in a LoRALinear; a row-parallel layer keeps its all-reduce and gets the
    LoRALinear as its matmul, so the adapter's partial product joins the sum."""
    base = getattr(parent, name)
    if isinstance(base, RowParallelLinear):
        wrapped = LoRALinear(RowParallelMatmul(base), a, b, scales, state, is_output_layer)
        base.packed = wrapped
    else:
        wrapped = LoRALinear(base, a, b, scales, state, is_output_layer)
        setattr(parent, name, wrapped)
    return wrapped


def step_adapters(pool, lora_requests: list[LoRARequest | None]) -> list[LoRASlot]:
    """The step's adapters and their slots in rank 0's pool (after `pool.step_slots`)."""
    seen: dict[int, LoRASlot] = {}
    for r in lora_requests:
        if r is not None and r.lora_int_id not in seen:
            seen[r.lora_int_id] = LoRASlot(pool.slot_ids.index(r.lora_int_id), r.lora_name, r.lora_int_id, r.lora_path)
    return list(seen.values())


def use_step_adapters(pool, adapters: list[LoRASlot]) -> None:
    """A worker: fill each slot whose adapter is new to it (rank 0's own slots already hold theirs)."""
    for entry in adapters:
        if pool.slot_ids[entry.slot] != entry.lora_int_id:
            request = LoRARequest(entry.lora_name, entry.lora_int_id, entry.lora_path)
            pool.fill_slot(entry.slot, request)
