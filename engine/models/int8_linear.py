"""`--quantization int8`: W8A8 linears on our vpdpbusd kernel (engine/kernels/cpu_int8/int8_linear.cpp).

Every weight is quantized once, at load time, from the checkpoint's bf16/fp32 values:
symmetric int8, one scale per output feature. Activations are quantized per token inside
the kernel. `Int8Linear` replaces each nn.Linear (and the matmul of each RowParallelLinear)
through engine/models/fast_paths.py, so every family gets it: attention, MLPs, MoE experts
and the LM head. A tied embedding shares the head's int8 panels (`Int8Embedding` reads its
rows back out of them), so the vocabulary is held once, in int8.

The plan is a pure function of the CPU's features (tested on faked ones): the kernel needs
AVX512_VNNI; without it, int8 is refused with a message saying so.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from types import ModuleType

import torch
from torch import nn

logger = logging.getLogger(__name__)

from ipc.engine_config import QUANTIZATIONS  # noqa: E402,F401  (declared with the engine flags)

PANEL = 32  # output features per panel (the kernel's kPanel)


@dataclass(frozen=True)
class Int8Plan:
    kernels: ModuleType


def check_int8_supported(device_type: str, has_avx512_vnni: bool) -> None:
    """Raise, saying why, where int8 cannot run."""
    if device_type != "cpu":
        raise ValueError("quantization='int8' runs on the CPU only (our vpdpbusd kernel)")
    if not has_avx512_vnni:
        raise ValueError("quantization='int8' needs a CPU with AVX512_VNNI (vpdpbusd); this CPU has none: "
                         "run without --quantization (bf16 or fp32)")


def plan_int8(device_type: str, has_avx512_vnni: bool) -> Int8Plan:
    check_int8_supported(device_type, has_avx512_vnni)
    from engine.kernels.int8_extension import load_int8_kernels

    kernels = load_int8_kernels()
    if not kernels.has_int8_linear():  # built without VNNI: the compiler's target disagrees with the probe
        raise ValueError("quantization='int8': the int8 kernel was built without AVX512_VNNI on this CPU")
    return Int8Plan(kernels)


@dataclass
class QuantizedWeight:
    """A weight in the kernel's layout, with what it needs to undo the quantization."""

    panels: torch.Tensor  # [padded_out / 32, num_quads, 32] int32: four int8 of one feature per word
    scales: torch.Tensor  # [padded_out] fp32
    compensation: torch.Tensor  # [padded_out] int32: 128 * sum_k q[n, k] (the u8 offset of activations)
    out_features: int
    in_features: int


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] float -> (q [out, in] int8, scales [out] fp32): symmetric, per output feature."""
    w = weight.detach().float()
    max_abs = w.abs().amax(dim=1)  # [out]
    scales = torch.where(max_abs > 0, max_abs / 127, torch.ones_like(max_abs))
    q = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scales


def pack_panels(q: torch.Tensor, scales: torch.Tensor) -> QuantizedWeight:
    """int8 [out, in] -> the kernel's panels: word (p, i, j) holds inputs 4i .. 4i+3 of feature
    32p + j; features and inputs padded with zeros."""
    out_features, in_features = q.shape
    padded_out = -(-out_features // PANEL) * PANEL
    num_quads = -(-in_features // 4)
    padded = torch.zeros(padded_out, num_quads * 4, dtype=torch.int8)
    padded[:out_features, :in_features] = q
    panels = padded.reshape(padded_out // PANEL, PANEL, num_quads, 4).permute(0, 2, 1, 3).contiguous()
    padded_scales = torch.ones(padded_out)
    padded_scales[:out_features] = scales
    compensation = 128 * padded.sum(dim=1, dtype=torch.int32)  # [padded_out]
    return QuantizedWeight(panels.view(torch.int32).reshape(padded_out // PANEL, num_quads, PANEL),
                           padded_scales, compensation, out_features, in_features)


def unpack_rows(weight: QuantizedWeight, rows: torch.Tensor) -> torch.Tensor:
    """The int8 values of features `rows` ([n] int64) -> [n, in_features] int8, read from the panels."""
    words = weight.panels[rows // PANEL, :, rows % PANEL]  # [n, num_quads] int32
    return words.contiguous().view(torch.int8)[:, : weight.in_features]


class Int8Linear(nn.Module):
    """y = x @ W^T (+ bias) with W int8 per feature and x quantized per token; y in x's dtype."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, plan: Int8Plan) -> None:
        super().__init__()
        self.kernels = plan.kernels
        self.out_features, self.in_features = weight.shape
        self.quantized = pack_panels(*quantize_weight(weight))
        # Buffers, so the model's memory is counted from its buffers like any other tensor.
        self.register_buffer("panels", self.quantized.panels, persistent=False)
        self.register_buffer("scales", self.quantized.scales, persistent=False)
        self.register_buffer("compensation", self.quantized.compensation, persistent=False)
        padded_bias = torch.empty(0)
        if bias is not None:
            padded_bias = torch.zeros(self.scales.numel())
            padded_bias[: self.out_features] = bias.detach().float()
        self.register_buffer("bias", padded_bias, persistent=False)
        self.out_fp32 = False  # logits: the fp32 result, unrounded

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in_features] -> [..., out_features]
        rows = x.reshape(-1, self.in_features)  # [num_tokens, in_features]
        out = self.kernels.int8_linear(rows, self.panels, self.compensation, self.scales, self.bias,
                                       self.out_features, self.out_fp32)  # [num_tokens, out_features]
        return out.view(*x.shape[:-1], self.out_features)


class Int8Embedding(nn.Module):
    """A tied embedding read from the LM head's int8 panels: row t = q[t] * scale[t]."""

    def __init__(self, head: Int8Linear, dtype: torch.dtype) -> None:
        super().__init__()
        self.head = [head]  # a list: the head is the model's module, not this one's child
        self.dtype = dtype

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        head = self.head[0]
        q = unpack_rows(head.quantized, input_ids)  # [num_tokens, hidden] int8
        return (q.float() * head.scales[input_ids, None]).to(self.dtype)  # [num_tokens, hidden]


def quantize_linears(model: nn.Module, plan: Int8Plan) -> int:
    """Swap every nn.Linear in `model` for an Int8Linear; returns how many."""
    num_quantized = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, name, Int8Linear(child.weight, child.bias, plan))
                num_quantized += 1
    return num_quantized
