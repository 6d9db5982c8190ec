"""`--quantization int8`: W8A8 linears on our vpdpbusd kernel (engine/cpu/csrc/quantized/int8_linear.cpp).

Every weight is quantized once, at load time, from the checkpoint's bf16/fp32 values:
symmetric int8 with one scale per output row and group of 64 inputs (the input features
padded with zeros to a multiple of 64). Activations are quantized inside the kernel, one
scale per token and group of 64. One scale per whole row and token drifts far from fp32
(an outlier sets the step for its whole row); per group, greedy answers stay about as close
to fp32 as with llama.cpp's Q8_0 (scripts/bench/probes/quant_drift.py measures both). The
activations between matmuls stay in fp32 by default (engine/worker/dtype_policy.py says why).
A GGUF's Q8_0 blocks (engine/loader/gguf_blocks.py) are packed as they are, in groups of 32: the
same kernel, which reads the group from the scales' shape.

`Int8Linear` replaces each nn.Linear (and the matmul of each RowParallelLinear) through
engine/cpu/fast_paths.py, so every family gets it: attention, MLPs, MoE experts and the
LM head. A tied embedding shares the head's int8 panels (`QuantizedEmbedding` reads its rows
back out of them), so the vocabulary is held once, in int8.

The plan (quantized_plan.py) checks the CPU and the kernel; fast_paths.py swaps the layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING

import torch
from torch import nn

from engine.cpu.quantized_plan import INT8_GROUP, PANEL, QuantizedPlan
from engine.cpu.huge_pages import move_onto_huge_pages

if TYPE_CHECKING:
    from engine.loader.gguf_blocks import GgufBlocks

GROUP = INT8_GROUP  # inputs per scale
GGUF_GROUP = 32  # a GGUF Q8_0 block's inputs per scale (the kernel's kGgufGroup)


@dataclass
class QuantizedWeight:
    """A weight in the kernel's layout, with what it needs to undo the quantization."""

    panels: torch.Tensor  # [padded_out / 32, num_groups * group / 4, 32] int32: four bytes q + 128 of one row per word
    scales: torch.Tensor  # [padded_out / 32, num_groups, 32] fp32: a panel's scales, group by group
    out_features: int
    in_features: int

    @property
    def group_size(self) -> int:
        return self.panels.shape[1] * 4 // self.scales.shape[1]


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] float -> (q [out, num_groups * 64] int8, zeros past `in`; scales [out, num_groups]
    fp32): symmetric, per row and group of 64 inputs."""
    out_features, in_features = weight.shape
    num_groups = -(-in_features // GROUP)
    w = torch.zeros(out_features, num_groups * GROUP)
    w[:, :in_features] = weight.detach().float()
    groups = w.view(out_features, num_groups, GROUP)  # [out, num_groups, 64]
    max_abs = groups.abs().amax(dim=2)  # [out, num_groups]
    scales = torch.where(max_abs > 0, max_abs / 127, torch.ones_like(max_abs))
    q = torch.round(groups / scales[:, :, None]).clamp_(-127, 127).to(torch.int8)
    return q.view(out_features, num_groups * GROUP), scales


def pack_panels(q: torch.Tensor, scales: torch.Tensor, in_features: int) -> QuantizedWeight:
    """(q [out, num_groups * group] int8, scales [out, num_groups]; group 64, or a GGUF Q8_0's 32)
    -> the kernel's panels: word (p, i, j) holds the bytes q + 128 of inputs 4i .. 4i+3 of row
    32p + j; rows padded with zeros (scale 1)."""
    out_features, padded_in = q.shape
    num_groups = scales.shape[1]
    if padded_in % num_groups or padded_in // num_groups not in (GROUP, GGUF_GROUP):
        raise ValueError(f"{padded_in} inputs in {num_groups} groups: groups must be {GROUP} or {GGUF_GROUP} inputs")
    padded_out = -(-out_features // PANEL) * PANEL
    num_panels = padded_out // PANEL
    unsigned = torch.full((padded_out, padded_in), 128, dtype=torch.uint8)
    unsigned[:out_features] = (q.to(torch.int16) + 128).to(torch.uint8)
    panels = unsigned.view(num_panels, PANEL, padded_in // 4, 4).permute(0, 2, 1, 3).contiguous()
    padded_scales = torch.ones(padded_out, num_groups)
    padded_scales[:out_features] = scales
    panel_scales = padded_scales.view(num_panels, PANEL, num_groups).transpose(1, 2).contiguous()
    return QuantizedWeight(panels.view(torch.int32).view(num_panels, padded_in // 4, PANEL), panel_scales,
                           out_features, in_features)


def unpack_rows(weight: QuantizedWeight, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The quantized rows `rows` ([n] int64), read from the panels: (q [n, in_features] int8,
    scales [n, num_groups] fp32)."""
    words = weight.panels[rows // PANEL, :, rows % PANEL]  # [n, num_groups * group / 4] int32
    q = (words.contiguous().view(torch.uint8).to(torch.int16) - 128).to(torch.int8)  # [n, num_groups * group]
    scales = weight.scales[rows // PANEL, :, rows % PANEL]  # [n, num_groups]
    return q[:, : weight.in_features], scales


def dequantize_rows(weight: QuantizedWeight, rows: torch.Tensor) -> torch.Tensor:
    """[n] int64 -> [n, in_features] fp32: q * its group's scale."""
    q, scales = unpack_rows(weight, rows)
    per_input = scales.repeat_interleave(weight.group_size, dim=1)[:, : weight.in_features]  # [n, in_features]
    return q.float() * per_input


class QuantizedLinear(nn.Module):
    """What Int8Linear and Int4Linear (int4_linear.py) share: the weight's panels and scales as
    buffers (so the model's memory is counted from its buffers like any other tensor), the bias
    padded to the panels' rows in fp32, and the forward through the scheme's kernel, which is
    also the torch op OP_NAME (engine/cpu/decode_stack.py calls that)."""

    OP_NAME = ""

    def __init__(self, matmul, read_rows, panels: torch.Tensor, scales: torch.Tensor, out_features: int,
                 in_features: int, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.matmul = matmul  # (x, panels, scales, bias, out_features, out_fp32) -> [num_tokens, out_features]
        self.read_rows = read_rows  # (panels, scales, rows, in_features, out_features) -> [n, in_features] fp32
        self.out_features, self.in_features = out_features, in_features
        self.register_buffer("panels", panels, persistent=False)
        self.register_buffer("scales", scales, persistent=False)
        padded_bias = torch.empty(0)
        if bias is not None:
            padded_bias = torch.zeros(panels.shape[0] * PANEL)
            padded_bias[:out_features] = bias.detach().float()
        self.register_buffer("bias", padded_bias, persistent=False)
        self.out_fp32 = False  # logits: the fp32 result, unrounded
        self.from_gguf = False  # the subclass says: its blocks are a GGUF's, as they were

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in_features] -> [..., out_features]
        rows = x.reshape(-1, self.in_features)  # [num_tokens, in_features]
        out = self.matmul(rows, self.panels, self.scales, self.bias, self.out_features,
                          self.out_fp32)  # [num_tokens, out_features]
        return out.view(*x.shape[:-1], self.out_features)

    def dequantize_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """[n] int64 -> [n, in_features] fp32: the weight's rows as the matmul sees them (the
        scheme's `dequantize_rows` reference's values, in one kernel call: a tied embedding's
        lookup, once a step)."""
        return self.read_rows(self.panels, self.scales, rows, self.in_features, self.out_features)


class Int8Linear(QuantizedLinear):
    """y = x @ W^T (+ bias), W and x int8 with a scale per group of 64 inputs (32: a GGUF's
    Q8_0 blocks); y in x's dtype."""

    OP_NAME = "tokenloom_int8::linear"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, plan: QuantizedPlan,
                 blocks: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """`blocks`: (q, d) already in Q8_0 (a GGUF's), packed as they are; else `weight` is quantized."""
        if blocks is not None:
            q, d = blocks
            scales = d.float()  # fp16 -> fp32: exact
        else:
            q, scales = quantize_weight(weight)
        quantized = pack_panels(q, scales, weight.shape[1])
        super().__init__(plan.kernels.int8_linear, plan.kernels.int8_rows, quantized.panels, quantized.scales,
                         *weight.shape, bias)
        self.quantized = quantized
        self.from_gguf = blocks is not None


class QuantizedEmbedding(nn.Module):
    """A tied embedding read from the LM head's quantized panels (Int8Linear's or Int4Linear's),
    so the vocabulary is held once."""

    def __init__(self, head: QuantizedLinear, dtype: torch.dtype) -> None:
        super().__init__()
        self.head = [head]  # a list: the head is the model's module, not this one's child
        self.dtype = dtype

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = self.head[0].dequantize_rows(input_ids.reshape(-1))  # [num_tokens, hidden]
        return rows.to(self.dtype).view(*input_ids.shape, -1)


def gather_panels_on_huge_pages(model: nn.Module) -> int:
    """Every quantized linear's panels in `model` (Int8Linear's, Int4Linear's) copied into one
    tensor on huge pages, where Linux gives them (engine.cpu.huge_pages); returns the bytes moved
    (0: nothing moved)."""
    linears = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    return move_onto_huge_pages(linears, lambda m: m.panels, _put_panels)


def _put_panels(module: QuantizedLinear, panels: torch.Tensor) -> None:
    module.panels = module.quantized.panels = panels  # the buffer and the reference layout: one tensor
