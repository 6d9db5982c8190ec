"""Qwen2.5-VL's vision tower: a Conv3d patch embedding over (temporal patch 2, 14, 14), a ViT with 2D
rotary (each head's features split between the patch's row and column) and SwiGLU MLPs, attention
within 112-px windows in most blocks and over the whole image in `fullatt_block_indexes`, and the
patch merger (RMSNorm, each 2 x 2 patches concatenated, a two-layer GELU MLP to the text width).

Reference: transformers' modeling_qwen2_5_vl.py and vision_utils.py. The patches arrive in merge-block
order (ipc.vision.qwen2_vl.patchify); the window blocks reorder them window by window, and the merger's
output is put back in merge-block order, which is the image's <|image_pad|> tokens' order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.qwen_vision_config import QwenVisionConfig


class VisionRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class VisionAttention(nn.Module):
    def __init__(self, config: QwenVisionConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=True)
        self.proj = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, x: torch.Tensor, cu_seqlens: list[int], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        num_patches = x.shape[0]
        q, k, v = self.qkv(x).reshape(num_patches, 3, self.num_heads, -1).permute(1, 0, 2, 3).unbind(0)  # [N, nh, hd]
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, nh, N, hd]
        outs = [F.scaled_dot_product_attention(q[:, :, lo:hi], k[:, :, lo:hi], v[:, :, lo:hi])  # [1, nh, len, hd]
                for lo, hi in zip(cu_seqlens[:-1], cu_seqlens[1:])]
        out = torch.cat(outs, dim=2).squeeze(0).transpose(0, 1).reshape(num_patches, -1)  # [N, hidden]
        return self.proj(out)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [N, nh, hd]; cos, sin: [N, hd]. Computed in fp32, as transformers' apply_rotary_pos_emb_vision.
    x32 = x.float()
    half = x32.shape[-1] // 2
    rotated = torch.cat((-x32[..., half:], x32[..., :half]), dim=-1)
    return (x32 * cos.unsqueeze(-2) + rotated * sin.unsqueeze(-2)).to(x.dtype)


class VisionMLP(nn.Module):
    def __init__(self, config: QwenVisionConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=True)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=True)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class VisionBlock(nn.Module):
    def __init__(self, config: QwenVisionConfig) -> None:
        super().__init__()
        self.norm1 = VisionRMSNorm(config.hidden_size)
        self.norm2 = VisionRMSNorm(config.hidden_size)
        self.attn = VisionAttention(config)
        self.mlp = VisionMLP(config)

    def forward(self, x: torch.Tensor, cu_seqlens: list[int], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cu_seqlens, cos, sin)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    def __init__(self, config: QwenVisionConfig) -> None:
        super().__init__()
        self.merged_size = config.hidden_size * config.spatial_merge_size ** 2
        self.ln_q = VisionRMSNorm(config.hidden_size)
        self.mlp = nn.Sequential(nn.Linear(self.merged_size, self.merged_size), nn.GELU(),
                                 nn.Linear(self.merged_size, config.out_hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.merged_size))  # [N / merge², out_hidden]


class Qwen2_5VisionTransformer(nn.Module):
    def __init__(self, config: QwenVisionConfig) -> None:
        super().__init__()
        self.config = config
        self.patch_embed = nn.Module()
        kernel = (config.temporal_patch_size, config.patch_size, config.patch_size)
        self.patch_embed.proj = nn.Conv3d(config.num_channels, config.hidden_size, kernel, stride=kernel, bias=False)
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.num_layers))
        self.merger = PatchMerger(config)
        head_dim = config.hidden_size // config.num_heads
        spatial_dim = head_dim // 2  # half the features turn with the row, half with the column
        exponents = torch.arange(0, spatial_dim, 2, dtype=torch.float) / spatial_dim
        self.register_buffer("inv_freq", 1.0 / config.rope_theta ** exponents, persistent=False)  # [head_dim / 4]

    def forward(self, patches: torch.Tensor, grid_h: int, grid_w: int) -> torch.Tensor:
        """One image's patches [grid_h * grid_w, C * 2 * 14 * 14] in merge-block order -> its tokens'
        embeddings [grid_h * grid_w / merge², out_hidden], in the same order."""
        config = self.config
        unit = config.spatial_merge_size ** 2
        weight = self.patch_embed.proj.weight
        x = patches.to(weight.dtype).view(-1, config.num_channels, config.temporal_patch_size, config.patch_size,
                                          config.patch_size)
        x = self.patch_embed.proj(x).view(-1, config.hidden_size)  # [N, hidden]
        window_index, cu_window_seqlens = self.window_index(grid_h, grid_w)
        num_patches = x.shape[0]
        x = x.view(num_patches // unit, unit, -1)[window_index].reshape(num_patches, -1)  # window by window
        cos, sin = self.angles(grid_h, grid_w)  # [N, head_dim] each
        cos = cos.view(num_patches // unit, unit, -1)[window_index].reshape(num_patches, -1)
        sin = sin.view(num_patches // unit, unit, -1)[window_index].reshape(num_patches, -1)
        full = [0, num_patches]
        for i, block in enumerate(self.blocks):
            x = block(x, full if i in config.fullatt_block_indexes else cu_window_seqlens, cos, sin)
        return self.merger(x)[torch.argsort(window_index)]  # back in merge-block order

    def angles(self, grid_h: int, grid_w: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [grid_h * grid_w, head_dim] of each patch's (row, column), in merge-block order."""
        m = self.config.spatial_merge_size
        device = self.inv_freq.device
        rows, cols = torch.meshgrid(torch.arange(grid_h, device=device), torch.arange(grid_w, device=device),
                                    indexing="ij")
        block = (grid_h // m, m, grid_w // m, m)
        rows = rows.reshape(block).transpose(1, 2).flatten()
        cols = cols.reshape(block).transpose(1, 2).flatten()
        freqs = torch.stack([rows, cols], dim=-1)[..., None].float() * self.inv_freq.float()  # [N, 2, head_dim / 4]
        freqs = torch.cat([freqs[:, 0], freqs[:, 1]], dim=-1)  # [N, head_dim / 2]
        freqs = torch.cat([freqs, freqs], dim=-1)  # [N, head_dim]
        return freqs.cos(), freqs.sin()

    def window_index(self, grid_h: int, grid_w: int) -> tuple[torch.Tensor, list[int]]:
        """(the merge blocks' order window by window [N / merge²], the windows' patch boundaries):
        windows of window_size px tile the image from its top left; the last row and column of windows
        may be partial."""
        config = self.config
        m = config.spatial_merge_size
        side = config.window_size // m // config.patch_size  # a window's side in merge blocks
        llm_h, llm_w = grid_h // m, grid_w // m
        index = torch.arange(llm_h * llm_w).reshape(llm_h, llm_w)
        pad_h, pad_w = side - llm_h % side, side - llm_w % side
        num_h, num_w = (llm_h + pad_h) // side, (llm_w + pad_w) // side
        padded = F.pad(index, (0, pad_w, 0, pad_h), "constant", -100)
        padded = padded.reshape(num_h, side, num_w, side).permute(0, 2, 1, 3).reshape(num_h * num_w, side * side)
        sizes = (padded != -100).sum(-1)  # [num_windows] merge blocks in each
        order = padded.reshape(-1)
        cu = [0]
        for size in sizes.tolist():
            if size:  # an all-padding window adds no boundary (transformers' unique_consecutive)
                cu.append(cu[-1] + size * m * m)
        return order[order != -100].to(self.inv_freq.device), cu
