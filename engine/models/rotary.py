"""Rotary position embedding (neox style: rotate halves), full or partial, with the
scalings the served families use: linear, llama3 (Llama 3.1) and longrope (Phi-3/4).

References: RoFormer (Su et al.); transformers' modeling_rope_utils.py, whose
inverse frequencies these reproduce.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from engine.models.config import ModelConfig

SCALINGS = ("linear", "llama3", "longrope")


def make_rotary(config: ModelConfig, device: torch.device | str | None = None,
                local: bool = False) -> "RotaryEmbedding":
    """The model's rotary tables, in fp32 (positions up to 100k+ lose precision in bf16), on
    `device` (None: the current default device). `local`: the sliding-window layers' own
    (config.local_rope_theta, Gemma 3)."""
    theta, scaling = (config.local_rope_theta, config.local_rope_scaling) if local else (
        config.rope_theta, config.rope_scaling)
    args = (config.rotary_dim, config.max_position_embeddings, theta, scaling,
            config.original_max_position_embeddings)
    if device is None:
        return RotaryEmbedding(*args)
    with torch.device(device):
        return RotaryEmbedding(*args)


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
    """cos/sin cached for every position, `rotary_dim` wide (the head's first rotary_dim
    features rotate; partial rotary passes the rest through)."""

    def __init__(self, rotary_dim: int, max_positions: int, theta: float, scaling: dict | None,
                 original_max_positions: int | None = None) -> None:
        super().__init__()
        self.rotary_dim = rotary_dim
        exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim  # [rotary_dim / 2]
        inv_freq = 1.0 / (theta**exponents)
        positions = torch.arange(max_positions, dtype=torch.float32)  # [max_positions]
        rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type"))
        if rope_type == "su":  # early Phi-3 configs' name for longrope
            rope_type = "longrope"
        attention_factor = 1.0
        if rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        elif rope_type == "linear":
            inv_freq = inv_freq / scaling["factor"]
        elif rope_type == "longrope":
            freqs, attention_factor = _longrope_freqs(positions, exponents, theta, scaling, max_positions,
                                                      original_max_positions)
        elif rope_type is not None:
            raise NotImplementedError(f"rope scaling {rope_type!r} is not supported (supported: {', '.join(SCALINGS)})")
        if rope_type != "longrope":
            freqs = torch.outer(positions, inv_freq)  # [max_positions, rotary_dim / 2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [max_positions, rotary_dim]
        self.register_buffer("cos_cache", emb.cos() * attention_factor, persistent=False)
        self.register_buffer("sin_cache", emb.sin() * attention_factor, persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's angles, looked up once and shared by every layer."""
        cos = self.cos_cache[positions].unsqueeze(1).to(dtype)  # [num_tokens, 1, rotary_dim]
        sin = self.sin_cache[positions].unsqueeze(1).to(dtype)
        return cos, sin


def _longrope_freqs(positions, exponents, theta, scaling, max_positions, original_max_positions):
    """LongRoPE (Phi-3/4): per-frequency factors, `short_factor` within the pretraining context
    and `long_factor` past it, and cos/sin scaled by an attention factor.

    transformers picks one set for the whole sequence by its current length (and recomputes
    the whole cache with the long set once a sequence crosses the pretraining length); a paged
    cache keeps the keys it has, so here the set goes by position: identical for sequences
    within the pretraining context, as vLLM does past it."""
    original = scaling.get("original_max_position_embeddings") or original_max_positions
    if original is None:
        raise ValueError("longrope scaling needs original_max_position_embeddings")
    factor = scaling.get("factor") or max_positions / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    short = 1.0 / (torch.tensor(scaling["short_factor"], dtype=torch.float32) * theta**exponents)
    long = 1.0 / (torch.tensor(scaling["long_factor"], dtype=torch.float32) * theta**exponents)
    is_long = (positions >= original).unsqueeze(1)  # [max_positions, 1]
    freqs = torch.where(is_long, torch.outer(positions, long), torch.outer(positions, short))
    return freqs, attention_factor


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    # q: [num_tokens, num_heads, head_dim], k: [num_tokens, num_kv_heads, head_dim]; cos, sin: [num_tokens, 1, rotary_dim]
    cos, sin = cos_sin
    rotary_dim = cos.shape[-1]
    if rotary_dim == q.shape[-1]:
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
    # Partial rotary: the first rotary_dim features rotate (halves of that slice), the rest pass through.
    q_rot, q_pass = q[..., :rotary_dim], q[..., rotary_dim:]
    k_rot, k_pass = k[..., :rotary_dim], k[..., rotary_dim:]
    q = torch.cat([q_rot * cos + _rotate_half(q_rot) * sin, q_pass], dim=-1)
    k = torch.cat([k_rot * cos + _rotate_half(k_rot) * sin, k_pass], dim=-1)
    return q, k


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)
