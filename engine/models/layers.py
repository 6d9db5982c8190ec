"""Building blocks of Llama-family decoders: RMSNorm, rotary embedding, SwiGLU MLP.

The torch code here is the reference; on the eager CPU path the modules call the
fused C++ kernels instead (engine/models/fused.py), which give the same bits."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # x: [num_tokens, hidden_size]. Normalise in fp32 like the reference, then cast back before the weight.
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)  # [num_tokens, intermediate_size] each
    return F.silu(gate) * up


class RMSNorm(nn.Module):
    """RMSNorm in vLLM's shape: given the residual stream too, it first adds x into it
    (`residual + x`, the decoder's residual add) and returns (normed, residual), so the
    fused kernel does the add and the norm in one pass."""

    fused = None  # engine.models.fused.CpuFusedOps, when the eager CPU path uses the C++ kernels

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            if self.fused is not None:
                return self.fused.rms_norm(x, self.weight, self.eps)
            return rms_norm(x, self.weight, self.eps)
        if self.fused is not None:
            return self.fused.add_rms_norm(x, residual, self.weight, self.eps)  # in place
        residual = residual + x
        return rms_norm(residual, self.weight, self.eps), residual


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1's frequency-dependent scaling: long wavelengths stretched, short ones kept."""
    factor = scaling["factor"]
    low_freq_factor = scaling.get("low_freq_factor", 1.0)
    high_freq_factor = scaling.get("high_freq_factor", 4.0)
    old_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_len / low_freq_factor
    high_freq_wavelen = old_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding (rotate halves), cos/sin cached for every position."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type"))
        if rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        elif rope_type == "linear":
            inv_freq = inv_freq / scaling["factor"]
        elif rope_type is not None:
            raise NotImplementedError(f"rope scaling {rope_type!r} is not supported")
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)  # [max_positions, head_dim/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [max_positions, head_dim]
        self.register_buffer("cos_cache", emb.cos(), persistent=False)
        self.register_buffer("sin_cache", emb.sin(), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's angles, looked up once and shared by every layer."""
        cos = self.cos_cache[positions].unsqueeze(1).to(dtype)  # [num_tokens, 1, head_dim]
        sin = self.sin_cache[positions].unsqueeze(1).to(dtype)
        return cos, sin


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    # q: [num_tokens, num_heads, head_dim], k: [num_tokens, num_kv_heads, head_dim]; cos, sin: [num_tokens, 1, head_dim]
    cos, sin = cos_sin
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


class SwiGLUMLP(nn.Module):
    fused = None  # engine.models.fused.CpuFusedOps, when the eager CPU path uses the C++ kernels

    def __init__(self, hidden_size: int, intermediate_size: int, down_proj: nn.Module | None = None) -> None:
        super().__init__()
        # gate and up in one matmul: one weight read instead of two.
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        # Tensor parallelism passes its row-parallel down_proj (engine.distributed.parallel_layers).
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False) if down_proj is None else down_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [num_tokens, 2 * intermediate_size]
        if self.fused is not None:
            return self.down_proj(self.fused.silu_and_mul(gate_up))
        return self.down_proj(silu_and_mul(gate_up))
