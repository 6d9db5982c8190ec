"""CPU matmuls on oneDNN-prepacked weights.

Plain `F.linear` re-lays-out each weight for every call; oneDNN can do that
once, at load time, into the blocked layout its kernels read. On this
project's 2-core CPU that roughly doubles the speed of the model's matmuls
(vLLM's CPU backend does the same). The arithmetic stays fp32 (or bf16): only
the order of summation inside each dot product changes.

On by default on the CPU (`--no-cpu-prepack` turns it off). oneDNN creates a
primitive per distinct input shape, and each holds memory of its own; oneDNN
and ideep (PyTorch's wrapper) each keep up to 1024 of them by default, so with
the number of tokens per step varying freely a server's memory grew with the
variety of its traffic (a sweep over 147 batch sizes: +1.1 GB). Both caches are
capped below (a step needs about five primitives, one per weight shape), which
holds the same sweep to about +0.3 GB; a step whose size is not cached pays
about 0.5 ms per weight shape to build its primitives again.
"""

from __future__ import annotations

import logging
import os

import torch
from torch import nn

logger = logging.getLogger(__name__)

# Read by oneDNN and ideep when they make their caches, i.e. at the first primitive.
PRIMITIVE_CACHE_ENV_VARS = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")
PRIMITIVE_CACHE_CAPACITY = 16


def bound_primitive_caches() -> None:
    """Cap oneDNN's and ideep's primitive caches unless the user already chose a size.

    Takes effect only before the process's first oneDNN primitive, which is
    why the model runner calls it before loading weights."""
    for name in PRIMITIVE_CACHE_ENV_VARS:
        os.environ.setdefault(name, str(PRIMITIVE_CACHE_CAPACITY))


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
