"""Qwen2.5-VL: the vision tower (qwen2_5_vision.py) and a Qwen2 text model whose rotary takes
3-component positions (M-RoPE): (temporal, height, width), each turning its `mrope_section` share of
the head's frequencies.

    prompt:     text text <|vision_start|> [image 2 x 3 merge blocks] <|vision_end|> text
    t:          0    1    2                 3  3  3  3  3  3           6             7
    h:          0    1    2                 3  3  3  4  4  4           6             7
    w:          0    1    2                 3  4  5  3  4  5           6             7

An image's tokens take start + (0, row, column); the text after it continues from their max + 1. Text
tokens have all three components equal, where M-RoPE is ordinary 1D rope: so the runner passes a text
token (and every decode token) one position, seq position + the request's rope delta so far, and the
decoder keeps every fast path; only a step with image tokens passes [3, num_tokens] positions, and it
runs eager already (engine.worker.mrope_positions).

Reference: transformers' modeling_qwen2_5_vl.py (get_rope_index, Qwen2_5_VLRotaryEmbedding).
"""

from __future__ import annotations

import numpy as np
import torch

from engine.models.config import ModelConfig
from engine.models.llama import Qwen2ForCausalLM
from engine.models.qwen2_5_vision import Qwen2_5VisionTransformer
from engine.models.rotary import RotaryEmbedding
from engine.models.vision_weights import load_vision_language_weights
from engine.parallel.parallel_state import NO_TP, TensorParallelGroup
from ipc.vision.qwen2_vl import patchify

VISION_PREFIXES = ("model.visual.", "visual.")


class MRotaryEmbedding(RotaryEmbedding):
    """The text model's rotary: [num_tokens] positions as plain rope, [3, num_tokens] as M-RoPE."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config.rotary_dim, config.max_position_embeddings, config.rope_theta, None)
        section = config.vision.mrope_section
        # Which component turns each of the rotary_dim angles: the sections over the first half, again.
        half = torch.cat([torch.full((n,), i, dtype=torch.int64) for i, n in enumerate(section)])
        self.register_buffer("component", torch.cat([half, half]), persistent=False)  # [rotary_dim]

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.dim() == 1:
            return super().cos_sin(positions, dtype)
        index = self.component.view(1, 1, -1).expand(1, positions.shape[1], -1)  # [1, num_tokens, rotary_dim]
        cos = self.cos_cache[positions].gather(0, index).squeeze(0)  # [3, n, rd] -> [num_tokens, rotary_dim]
        sin = self.sin_cache[positions].gather(0, index).squeeze(0)
        return cos.unsqueeze(1).to(dtype), sin.unsqueeze(1).to(dtype)  # [num_tokens, 1, rotary_dim]


class Qwen2_5_VLForConditionalGeneration(Qwen2ForCausalLM):
    is_multimodal = True
    uses_mrope = True

    def __init__(self, config: ModelConfig, tp: TensorParallelGroup = NO_TP) -> None:
        if tp is not NO_TP:  # a rank of a group: the runner's encoder path is rank 0's alone
            raise ValueError("vision-language models run without tensor or pipeline parallelism")
        super().__init__(config, tp)
        self.rotary = MRotaryEmbedding(config)
        self.visual = Qwen2_5VisionTransformer(config.vision)

    @property
    def image_token_id(self) -> int:
        return self.config.vision.image_token_id

    def build_rotary(self, device: torch.device) -> None:
        with torch.device(device):
            self.rotary = MRotaryEmbedding(self.config)
        self.visual.inv_freq = vision_inv_freq(self.config).to(device)  # fp32, whatever the weights' dtype

    def embed_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """One image, normalised [1, C, H, W] -> its tokens' embeddings [H * W / 28², hidden]."""
        vision = self.config.vision
        _, _, height, width = pixel_values.shape
        patches = patchify(pixel_values[0].cpu().numpy(), vision.patch_size, vision.spatial_merge_size,
                           vision.temporal_patch_size)  # [grid_h * grid_w, C * 2 * 14 * 14]
        patches = torch.from_numpy(np.ascontiguousarray(patches)).to(pixel_values.device)
        return self.visual(patches, height // vision.patch_size, width // vision.patch_size)

    def decoder_parameters(self):
        return ((name, p) for name, p in self.named_parameters() if not name.startswith("visual."))

    def load_weights(self, weights, into=None) -> set[str]:
        """The text model's tensors through the decoder's loader (model.language_model.X, as transformers 5
        writes them, or the published checkpoints' model.X); the tower's by their own names."""
        vision_params = {name: p for name, p in self.named_parameters() if name.startswith("visual.")}
        return load_vision_language_weights(super().load_weights, weights, into, vision_params, VISION_PREFIXES,
                                            "model.language_model.")


def vision_inv_freq(config: ModelConfig) -> torch.Tensor:
    vision = config.vision
    spatial_dim = vision.hidden_size // vision.num_heads // 2
    return 1.0 / vision.rope_theta ** (torch.arange(0, spatial_dim, 2, dtype=torch.float) / spatial_dim)


def mrope_positions(token_ids: list[int], images: list, vision) -> tuple[np.ndarray, int]:
    """(each prompt token's M-RoPE position [3, len(token_ids)], the rope delta of the tokens after the
    prompt: a token at sequence position p is at p + delta in all three components).
    `images`: ipc.messages.ImageInput, shape [1, C, H, W], each range its image tokens alone."""
    positions = np.empty((3, len(token_ids)), dtype=np.int64)
    unit = vision.patch_size * vision.spatial_merge_size
    delta, index = 0, 0
    for image in images:
        positions[:, index:image.offset] = np.arange(index, image.offset) + delta  # text: all three alike
        start = image.offset + delta
        rows, cols = image.shape[2] // unit, image.shape[3] // unit
        grid = positions[:, image.offset:image.offset + rows * cols]
        grid[0] = start
        grid[1] = start + np.repeat(np.arange(rows), cols)
        grid[2] = start + np.tile(np.arange(cols), rows)
        index = image.offset + image.length
        delta = start + max(rows, cols) - index  # the next text token sits at max + 1
    positions[:, index:] = np.arange(index, len(token_ids)) + delta
    return positions, int(positions.max()) + 1 - len(token_ids)
