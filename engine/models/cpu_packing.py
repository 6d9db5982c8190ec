"""CPU matmuls on oneDNN-prepacked weights.

Plain `F.linear` re-lays-out each weight for every call; oneDNN can do that
once, at load time, into the blocked layout its kernels read. On this
project's 2-core CPU that roughly doubles the speed of the model's matmuls
(vLLM's CPU backend does the same). The arithmetic stays fp32 (or bf16): only
the order of summation inside each dot product changes.

Opt-in (`EngineConfig.cpu_prepack`, `--cpu-prepack`): oneDNN creates and caches
a primitive per distinct input shape, and each holds memory of its own; with
the number of tokens per step varying freely, a long soak grew the core's RSS
by hundreds of MB (bounded only by ONEDNN_PRIMITIVE_CACHE_CAPACITY).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

logger = logging.getLogger(__name__)


def can_prepack(device: torch.device, dtype: torch.dtype) -> bool:
    return (
        device.type == "cpu"
        and dtype in (torch.float32, torch.bfloat16)
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


class PackedLinear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, batch_size_hint: int) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        # [out_features, in_features] in oneDNN's blocked layout; opaque to torch
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_size=batch_size_hint)
        self.bias = None if bias is None else bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, in_features] -> [num_tokens, out_features]
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed_weight, self.bias, "none", [], "")


def prepack_linears(model: nn.Module, batch_size_hint: int) -> int:
    """Swap every nn.Linear in `model` for a PackedLinear; returns how many were packed."""
    num_packed = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, name, PackedLinear(child.weight, child.bias, batch_size_hint))
                num_packed += 1
    logger.info("prepacked %d linear layers for oneDNN", num_packed)
    return num_packed
