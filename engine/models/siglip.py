"""SigLIP's vision transformer as Idefics3 (SmolVLM) uses it: patches of a frame through
bidirectional pre-norm layers (LayerNorm, attention with biases, LayerNorm, GELU-tanh MLP).

Reference: transformers' modeling_idefics3.py (Idefics3VisionTransformer), whose position
embeddings follow NaViT: a frame of any size maps its patch grid onto the trained
num_patches_per_side² positions by bucketing fractional coordinates. Frames arrive whole (the
image processor resizes every crop to the encoder's size), so no patch is padding here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.vision_config import VisionConfig


class VisionEmbeddings(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.patch_size = config.patch_size
        self.num_patches_per_side = config.num_patches_per_side
        self.patch_embedding = nn.Conv2d(config.num_channels, config.hidden_size, config.patch_size,
                                         stride=config.patch_size, padding="valid")
        self.position_embedding = nn.Embedding(self.num_patches_per_side ** 2, config.hidden_size)

    def position_ids(self, num_h: int, num_w: int, device: torch.device) -> torch.Tensor:
        """[num_h * num_w] trained positions for a num_h x num_w patch grid (NaViT's bucketing)."""
        side = self.num_patches_per_side
        boundaries = torch.arange(1 / side, 1.0, 1 / side, device=device)
        rows = torch.clamp(torch.arange(num_h, device=device, dtype=torch.float32) * (1.0 / num_h), max=1.0 - 1e-6)
        cols = torch.clamp(torch.arange(num_w, device=device, dtype=torch.float32) * (1.0 / num_w), max=1.0 - 1e-6)
        rows = torch.bucketize(rows, boundaries, right=True)  # [num_h]
        cols = torch.bucketize(cols, boundaries, right=True)  # [num_w]
        return (rows[:, None] * side + cols[None, :]).reshape(-1)  # [num_h * num_w]

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[num_frames, C, H, W] -> [num_frames, num_patches, hidden]"""
        patches = self.patch_embedding(pixel_values)  # [num_frames, hidden, H / p, W / p]
        num_h, num_w = patches.shape[-2:]
        embeddings = patches.flatten(2).transpose(1, 2)  # [num_frames, num_patches, hidden]
        return embeddings + self.position_embedding(self.position_ids(num_h, num_w, pixel_values.device))


class VisionAttention(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.head_dim = config.hidden_size // config.num_heads
        self.q_proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.k_proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.v_proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.out_proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.qkv_proj: nn.Linear | None = None  # fuse_qkv's one matmul in place of the three

    def fuse_qkv(self) -> None:
        """One [3 * hidden, hidden] matmul for q, k and v (the same values; one pass over the
        activations, which a quantized matmul also quantizes once instead of three times)."""
        projs = (self.q_proj, self.k_proj, self.v_proj)
        fused = nn.Linear(self.q_proj.in_features, 3 * self.q_proj.out_features)
        with torch.no_grad():
            fused.weight.copy_(torch.cat([p.weight for p in projs]))  # [3 * hidden, hidden]
            fused.bias.copy_(torch.cat([p.bias for p in projs]))
        self.qkv_proj = fused.to(self.q_proj.weight.dtype)
        del self.q_proj, self.k_proj, self.v_proj

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        num_frames, num_patches, _ = hidden.shape
        shape = (num_frames, num_patches, self.num_heads, self.head_dim)
        if self.qkv_proj is not None:
            qkv = self.qkv_proj(hidden).view(num_frames, num_patches, 3, self.num_heads, self.head_dim)
            q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each [num_frames, heads, num_patches, head_dim]
        else:
            q, k, v = (proj(hidden).view(shape).transpose(1, 2) for proj in (self.q_proj, self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(q, k, v)  # [num_frames, heads, num_patches, head_dim], every patch sees all
        return self.out_proj(out.transpose(1, 2).reshape(num_frames, num_patches, -1))


class VisionMLP(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # In place: fc1's [num_frames, num_patches, intermediate] output is the largest activation.
        return self.fc2(torch.ops.aten.gelu_(self.fc1(hidden), approximate="tanh"))


class VisionLayer(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.self_attn = VisionAttention(config)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = VisionMLP(config)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.layer_norm1(hidden))
        return hidden + self.mlp(self.layer_norm2(hidden))


class VisionEncoder(nn.Module):
    """Named as the checkpoint's `encoder.layers.N`."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(VisionLayer(config) for _ in range(config.num_layers))


class SiglipVisionTransformer(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.embeddings = VisionEmbeddings(config)
        self.encoder = VisionEncoder(config)
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[num_frames, C, H, W] -> [num_frames, num_patches, hidden]"""
        hidden = self.embeddings(pixel_values)
        for layer in self.encoder.layers:
            hidden = layer(hidden)
        return self.post_layernorm(hidden)
