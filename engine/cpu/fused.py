"""Fused C++ element-wise ops for the eager CPU path (engine/cpu/csrc/fused_ops.cpp).

Between the matmuls, a decoder layer runs a dozen small torch ops (RMSNorm's five,
the residual adds, rotary's six, the KV store's index_put, SiLU and the multiply),
each a pass over memory plus Python dispatch. The kernels fuse them into four
(vLLM's fused_add_rms_norm and silu_and_mul, and rotary with the KV store, which the
attention backend calls as the KV cache's writer: engine/attention/head_major.py) and
give the same bits as the torch code in engine/models/layers.py, which stays as
the reference and as the path wherever these do not apply:

- torch.compile: inductor fuses the plain torch ops itself, and dynamo cannot
  trace a pybind function;
- CUDA, or a CPU without a compiler: the kernels are not there;
- the Triton backend: its KV cache is token-major, the kernel writes head-major.

`select_fused_ops` decides once per model runner; engine/cpu/fast_paths.py then
hands them to each block that can use them.

Bit-exactness needs two facts about this torch build, probed once at start-up
(`_probe_lanes`): the fp32 vector width of its sum (RMSNorm's mean) and of its
SiLU, which set the order of the sum and which elements take the vectorized exp.
"""

from __future__ import annotations

import logging
from types import ModuleType

import torch

from engine.models.layers import rms_norm, silu_and_mul

logger = logging.getLogger(__name__)

HEAD_MAJOR_BACKENDS = ("torch", "cpu")  # KV blocks as [num_blocks, num_kv_heads, block_size, head_dim]
LANE_CANDIDATES = (16, 8, 4, 1)  # AVX-512, AVX2, NEON, scalar


class CpuFusedOps:
    def __init__(self, kernels: ModuleType) -> None:
        self.kernels = kernels  # the attention backend's rotary + KV store runs on them too
        sum_lanes, silu_lanes = _probe_lanes(kernels)
        self.sum_lanes = sum_lanes or 8
        self.silu_lanes = silu_lanes or 16
        # No width reproduced torch's fp32 SiLU (an AVX2 host's torch takes another exp path):
        # fp32 rows keep torch's op, so the fused path never changes a bit of an fp32 answer.
        self.is_silu_exact = silu_lanes is not None

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # x: [num_tokens, hidden_size] -> a new [num_tokens, hidden_size]
        return self.kernels.rms_norm(x, weight, eps, self.sum_lanes)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """residual += x, then x = rmsnorm(residual), both in place; returns (x, residual)."""
        # x, residual: [num_tokens, hidden_size]
        self.kernels.add_rms_norm(x, residual, weight, eps, self.sum_lanes)
        return x, residual

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        # gate_up: [num_tokens, 2 * intermediate_size] -> [num_tokens, intermediate_size]
        if gate_up.dtype == torch.float32 and not self.is_silu_exact:
            return silu_and_mul(gate_up)
        return self.kernels.silu_and_mul(gate_up, self.silu_lanes)


def select_fused_ops(device: torch.device, backend_name: str, is_compiled: bool) -> CpuFusedOps | None:
    """The fused ops where the eager CPU path can use them, else None (the torch code runs)."""
    if device.type != "cpu" or is_compiled or backend_name not in HEAD_MAJOR_BACKENDS:
        return None
    from engine.cpu.extension import load_cpu_kernels_or_none

    kernels = load_cpu_kernels_or_none("fused CPU ops off, the torch ops run")  # the same work, slower
    if kernels is None:
        return None
    ops = CpuFusedOps(kernels)
    logger.info("fused CPU ops on (vector lanes: sum %d, silu %d)", ops.sum_lanes, ops.silu_lanes)
    return ops


def _probe_lanes(kernels: ModuleType) -> tuple[int, int]:
    """The vector widths at which the kernels reproduce this torch build's RMSNorm and SiLU bit for bit.

    ATen compiles its kernels for several instruction sets and may pick a narrower
    one than the CPU's (on an AVX-512 host its sum has been seen to run 8-wide), so
    the widths are measured rather than assumed. Rows of odd widths make every
    candidate differ from the others somewhere."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, 1000, generator=generator) * 3  # [64, hidden]: cascade levels, vectors and a scalar tail
    weight = torch.randn(1000, generator=generator)
    expected = rms_norm(x, weight, 1e-6)
    sum_lanes = next((n for n in LANE_CANDIDATES if torch.equal(kernels.rms_norm(x, weight, 1e-6, n), expected)), None)
    gate_up = torch.randn(256, 2 * 88, generator=generator) * 4  # [256, 2 * intermediate]: 88 = 64 + 16 + 8
    expected = silu_and_mul(gate_up)
    silu_lanes = next((n for n in LANE_CANDIDATES if torch.equal(kernels.silu_and_mul(gate_up, n), expected)), None)
    if sum_lanes is None or silu_lanes is None:
        logger.warning("fused CPU ops do not reproduce this torch build's fp32 rounding exactly (sum %s, silu %s; "
                       "fp32 SiLU then keeps torch's op); "
                       "results may differ in the last bit", sum_lanes, silu_lanes)
    return sum_lanes, silu_lanes
