"""Building blocks the decoder families share: RMSNorm, Gemma's (1 + w) RMSNorm, and the
gated MLP, SiLU (SwiGLU) or GELU-tanh (GeGLU) (rotary lives
in engine/models/rotary.py, attention in attention.py, the MoE block in moe.py).

The torch code here is the reference and the path everywhere the fused C++ kernels do
not apply. On the eager CPU path engine/cpu/fast_paths.py hands each block the
kernels (its `fused` attribute, engine/cpu/fused.py), which give the same bits; there
are none for the (1 + w) norm and GELU-tanh, which always run the torch code here."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.rotary import RotaryEmbedding, apply_rotary  # noqa: F401  (re-exported: the kernels' tests use them)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # x: [..., hidden_size]. Normalise in fp32 like the reference, then cast back before the weight.
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def offset_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # x: [..., hidden_size]. Gemma's order: normalise and scale by (1 + w) in fp32, then cast.
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return (normed * (1.0 + weight.float())).to(x.dtype)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)  # [num_tokens, intermediate_size] each
    return F.silu(gate) * up


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)  # [num_tokens, intermediate_size] each
    return F.gelu(gate, approximate="tanh") * up


ACTIVATIONS_AND_MUL = {"silu": silu_and_mul, "gelu_tanh": gelu_tanh_and_mul}


class RMSNorm(nn.Module):
    """RMSNorm in vLLM's shape: given the residual stream too, it first adds x into it
    (`residual + x`, the decoder's residual add) and returns (normed, residual), so the
    fused kernel does the add and the norm in one pass. Also the per-head q/k norm
    (Qwen3): x is then [num_tokens, num_heads, head_dim], normalised over head_dim."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.fused = None  # engine.cpu.fused.CpuFusedOps, set by engine.cpu.fast_paths

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            if self.fused is not None:
                rows = x.reshape(-1, x.shape[-1])  # the kernel takes [rows, hidden] (a copy if x is strided)
                return self.fused.rms_norm(rows, self.weight, self.eps).view(x.shape)
            return rms_norm(x, self.weight, self.eps)
        if self.fused is not None:
            return self.fused.add_rms_norm(x, residual, self.weight, self.eps)  # in place
        residual = residual + x
        return rms_norm(residual, self.weight, self.eps), residual


class OffsetRMSNorm(nn.Module):
    """Gemma's RMSNorm: the weight is stored as an offset from 1 (the checkpoint's zeros
    scale by 1), applied in fp32 before the cast back. Same interface as RMSNorm: given
    the residual stream, it adds x into it first and returns (normed, residual). No fused
    kernel computes it, so it never takes one."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return offset_rms_norm(x, self.weight, self.eps)
        residual = residual + x
        return offset_rms_norm(residual, self.weight, self.eps), residual


class SwiGLUMLP(nn.Module):
    """down(act(gate(x)) * up(x)): the dense MLP, and each expert of the MoE block. The gate's
    activation is SiLU (SwiGLU) or, for Gemma, GELU-tanh (GeGLU); the fused kernel does SiLU only."""

    def __init__(self, hidden_size: int, intermediate_size: int, down_proj: nn.Module | None = None,
                 activation: str = "silu") -> None:
        super().__init__()
        self.activation = activation  # a key of ACTIVATIONS_AND_MUL
        # gate and up in one matmul: one weight read instead of two.
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        # Tensor parallelism passes its row-parallel down_proj (engine.parallel.parallel_layers).
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False) if down_proj is None else down_proj
        self.fused = None  # engine.cpu.fused.CpuFusedOps, set by engine.cpu.fast_paths

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [num_tokens, 2 * intermediate_size]
        if self.fused is not None:  # handed out for SiLU only
            return self.down_proj(self.fused.silu_and_mul(gate_up))
        return self.down_proj(ACTIVATIONS_AND_MUL[self.activation](gate_up))
