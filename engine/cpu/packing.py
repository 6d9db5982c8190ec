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
capped below (a step needs about five primitives, one per weight shape); a step
whose size is not cached builds its primitives again.

bf16 on a CPU with AVX512_BF16 but no AMX (this project's Zen 4) takes the slabs
of engine/cpu/csrc/small_batch_linear.cpp instead: oneDNN streamed a small
step's weights well below the machine's read rate, and the slabs match or beat it
at every step size (figures: docs/performance.md, "CPU matmuls"). With AMX, oneDNN's tiles win
big steps: slabs then take only steps of up to SMALL_BATCH_MAX_TOKENS tokens, as
a second copy of the weights, and not for models whose weights pass
SMALL_BATCH_MAX_WEIGHT_BYTES.

The slabs of the whole model then move into one tensor on transparent huge pages
(`gather_slabs_on_huge_pages`). A step streams every weight from memory once, a
4 KB page after another: on 4 KB pages each one missed the TLB (a two-level walk
under a hypervisor), and the hardware prefetcher stops at every page's end; huge pages avoid both
(figures: docs/performance.md, "CPU matmuls").
"""

from __future__ import annotations

import functools

import logging
import os
from dataclasses import dataclass
from types import ModuleType

import torch
from torch import nn

from engine.cpu.host import CpuFeatures
from engine.cpu.huge_pages import move_onto_huge_pages

logger = logging.getLogger(__name__)

# Read by oneDNN and ideep when they make their caches, i.e. at the first primitive.
PRIMITIVE_CACHE_ENV_VARS = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")
PRIMITIVE_CACHE_CAPACITY = 16
SMALL_BATCH_MAX_TOKENS = 8  # with AMX: weight-bound steps on slabs, bigger ones on oneDNN tiles
SMALL_BATCH_MAX_WEIGHT_BYTES = 4 << 30  # with AMX the slabs are a second copy of the weights


def bound_primitive_caches() -> None:
    """Cap oneDNN's and ideep's primitive caches unless the user already chose a size.

    Takes effect only before the process's first oneDNN primitive, which is
    why the execution plan calls it before the weights load."""
    for name in PRIMITIVE_CACHE_ENV_VARS:
        os.environ.setdefault(name, str(PRIMITIVE_CACHE_CAPACITY))


def can_prepack(device: torch.device, dtype: torch.dtype) -> bool:
    return (
        device.type == "cpu"
        and dtype in (torch.float32, torch.bfloat16)
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and (dtype != torch.bfloat16 or _bf16_reorder_works())
    )


@functools.cache
def _bf16_reorder_works() -> bool:
    """oneDNN's bf16 reorder needs AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT: an AVX2-only CPU
    refuses it, and runs bf16 linears unpacked. Asked of oneDNN itself, on a tiny weight."""
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), batch_size=1)
    except RuntimeError as e:
        logger.info("bf16 weights stay unpacked: %s", str(e).splitlines()[0])
        return False
    return True


@dataclass(frozen=True)
class SlabPlan:
    """Which steps run on bf16 slabs (engine/cpu/csrc/small_batch_linear.cpp)."""

    kernels: ModuleType
    max_tokens: int | None  # steps of up to this many tokens; None: every step, and no oneDNN copy


def plan_slabs(dtype: torch.dtype, num_weight_bytes: int, cpu: CpuFeatures) -> SlabPlan | None:
    """Slabs for every step on a CPU with AVX512_BF16 and no AMX (they match or beat oneDNN
    there at every size); on AMX, oneDNN's tiles win big steps, and slabs take only steps of
    up to SMALL_BATCH_MAX_TOKENS, as a second copy of the weights (if it is not too big)."""
    if dtype != torch.bfloat16:
        return None
    if cpu.has_amx_bf16 and num_weight_bytes > SMALL_BATCH_MAX_WEIGHT_BYTES:
        logger.info("few-token steps stay on oneDNN: %.1f GB of weights would be copied", num_weight_bytes / 1e9)
        return None
    from engine.cpu.extension import load_cpu_kernels_or_none

    kernels = load_cpu_kernels_or_none("bf16 matmuls stay on oneDNN")
    if kernels is None or not kernels.has_small_batch_linear():
        return None
    return SlabPlan(kernels, SMALL_BATCH_MAX_TOKENS if cpu.has_amx_bf16 else None)


def pack_slabs(weight: torch.Tensor) -> torch.Tensor:
    """[out_features, in_features] bf16 -> [out_features / 16, in_features / 2, 16] int32:
    word (s, p, j) holds the bf16 pair (2p, 2p + 1) of output feature 16 s + j."""
    out_features, in_features = weight.shape
    pairs = weight.detach().reshape(out_features // 16, 16, in_features // 2, 2).permute(0, 2, 1, 3).contiguous()
    return pairs.view(torch.int32).reshape(out_features // 16, in_features // 2, 16)


class PackedLinear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, batch_size_hint: int,
                 slabs: SlabPlan | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.bias = None if bias is None else bias.detach()
        fits = weight.dtype == torch.bfloat16 and self.out_features % 16 == 0 and self.in_features % 2 == 0
        self.slab_plan = slabs if fits else None
        # Logits: the slabs' fp32 sums, unrounded (in bf16, near-equal top logits tie: a bf16
        # step at 25 is 0.125, and the tie went to the lower token id).
        self.out_fp32 = False
        self.slabs: torch.Tensor | None = None  # [out_features / 16, in_features / 2, 16] int32
        self.packed_weight = None  # [out_features, in_features] in oneDNN's blocked layout; opaque to torch
        if self.slab_plan is not None:
            self.slabs = pack_slabs(weight)
            self._slab_bias = self.bias if self.bias is not None else torch.empty(0, dtype=torch.bfloat16)
        if self.slab_plan is None or self.slab_plan.max_tokens is not None:
            self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_size=batch_size_hint)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, in_features] -> [num_tokens, out_features]
        plan = self.slab_plan
        if plan is not None and (plan.max_tokens is None or x.shape[0] <= plan.max_tokens):
            return plan.kernels.small_batch_linear(x, self.slabs, self._slab_bias, self.out_fp32)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed_weight, self.bias, "none", [], "")


def gather_slabs_on_huge_pages(model: nn.Module) -> int:
    """Copy every PackedLinear's slabs in `model` into one tensor on transparent huge pages,
    where Linux gives them on request. Returns the bytes moved (0: nothing moved)."""
    linears = [m for m in model.modules() if isinstance(m, PackedLinear) and m.slabs is not None]
    num_bytes = move_onto_huge_pages(linears, lambda m: m.slabs, lambda m, slabs: setattr(m, "slabs", slabs))
    if num_bytes:
        logger.info("bf16 slabs on huge pages: %.1f MB", num_bytes / 1e6)
    return num_bytes


def prepack_linears(model: nn.Module, batch_size_hint: int, slabs: SlabPlan | None = None) -> int:
    """Swap every nn.Linear in `model` for a PackedLinear; returns how many were packed."""
    num_packed = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, name, PackedLinear(child.weight, child.bias, batch_size_hint, slabs))
                num_packed += 1
    logger.debug("prepacked %d linear layers", num_packed)  # engine.cpu.fast_paths logs the summary
    return num_packed
