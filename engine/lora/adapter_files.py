"""A checked adapter's tensors (ipc.lora_adapter.check_adapter's spec) loaded from its safetensors,
grouped by the layer of ours they adapt: what the CPU cache keeps and a pool slot is filled from."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ipc.lora_adapter import PART_INDEX, AdapterSpec, ModelShape, check_adapter


@dataclass
class AdapterPart:
    """One PEFT module's A and B: rows `out_start..out_end` of our module's output get x·Aᵀ·Bᵀ·scale."""

    part_index: int  # its rank block in the pool's fused layout (q 0, k 1, v 2; gate 0, up 1; else 0)
    out_start: int
    out_end: int
    a: torch.Tensor  # [rank, in]
    b_t: torch.Tensor  # [rank, out_end - out_start]: B transposed as the pool keeps it, made on the read


@dataclass
class LoRAWeights:
    """An adapter in memory: its parts for each (layer index, our module name)."""

    path: str
    rank: int
    scale: float
    layers: dict[tuple[int, str], list[AdapterPart]]

    @property
    def num_bytes(self) -> int:
        return sum(p.a.numel() * p.a.element_size() + p.b_t.numel() * p.b_t.element_size()
                   for parts in self.layers.values() for p in parts)


def load_adapter(path: str, model: ModelShape, max_lora_rank: int, dtype: torch.dtype) -> LoRAWeights:
    """Check the adapter at `path` against `model` (ValueError naming the field), then read its tensors in `dtype`."""
    return read_adapter(check_adapter(path, model, max_lora_rank), model, dtype)


def read_adapter(spec: AdapterSpec, model: ModelShape, dtype: torch.dtype) -> LoRAWeights:
    """The checked adapter's tensors in `dtype`, B transposed (ValueError naming the file when they are bad).
    The core runs it on its reader thread (engine/lora/adapter_reader.py), off the busy loop."""
    from safetensors import SafetensorError, safe_open

    matrices: dict[tuple[int, str, str | None], dict[str, torch.Tensor]] = {}
    try:
        with safe_open(spec.weights_path, framework="pt", device="cpu") as f:
            for t in spec.tensors:
                matrices.setdefault((t.layer_index, t.module, t.part), {})[t.matrix] = f.get_tensor(t.key).to(dtype)
    except (SafetensorError, OSError, RuntimeError) as e:
        raise ValueError(f"adapter_model.safetensors is corrupt: {e}") from None
    layers: dict[tuple[int, str], list[AdapterPart]] = {}
    for (layer_index, module, part), ab in sorted(matrices.items(), key=lambda kv: (kv[0][0], kv[0][1], PART_INDEX[kv[0][2]])):
        if not (torch.isfinite(ab["A"]).all() and torch.isfinite(ab["B"]).all()):
            raise ValueError(f"adapter_model.safetensors: layer {layer_index}'s {part or module} holds inf or NaN")
        start, end = model.out_slice(module, part)
        layers.setdefault((layer_index, module), []).append(AdapterPart(PART_INDEX[part], start, end, ab["A"],
                                                                             ab["B"].t().contiguous()))
    return LoRAWeights(spec.path, spec.rank, spec.scale, layers)
