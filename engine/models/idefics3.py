"""Idefics3 (SmolVLM): a SigLIP encoder (siglip.py), a pixel-shuffle connector with a linear
projection, and a Llama text model (SmolLM2), which is our plain decoder: its decode steps keep
every CPU fast path and the decode stack, since an image only changes a prompt's embeddings.

Reference: transformers' modeling_idefics3.py. The runner asks `embed_images` for an image's
token embeddings and hands them to the decoder's forward at the image's placeholder positions.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.models.config import ModelConfig
from engine.models.llama import LlamaForCausalLM
from engine.models.siglip import SiglipVisionTransformer
from engine.models.vision_weights import load_vision_language_weights
from engine.parallel.parallel_state import NO_TP, TensorParallelGroup

VISION_PREFIXES = ("model.vision_model.", "model.connector.")


class Idefics3Connector(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        vision = config.vision
        self.scale_factor = vision.scale_factor
        self.modality_projection = nn.Module()
        self.modality_projection.proj = nn.Linear(vision.hidden_size * vision.scale_factor ** 2, config.hidden_size,
                                                  bias=False)

    def pixel_shuffle(self, x: torch.Tensor) -> torch.Tensor:
        """[frames, seq, dim] -> [frames, seq / s², dim * s²]: each s x s block of patches becomes one token."""
        s = self.scale_factor
        frames, seq, dim = x.shape
        side = int(seq ** 0.5)
        x = x.view(frames, side, side // s, dim * s)
        x = x.permute(0, 2, 1, 3).reshape(frames, side // s, side // s, dim * s * s)
        return x.permute(0, 2, 1, 3).reshape(frames, seq // (s * s), dim * s * s)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.modality_projection.proj(self.pixel_shuffle(hidden))  # [frames, tokens_per_frame, text hidden]


class Idefics3ForConditionalGeneration(LlamaForCausalLM):
    is_multimodal = True

    def __init__(self, config: ModelConfig, tp: TensorParallelGroup = NO_TP) -> None:
        if tp is not NO_TP:  # a rank of a group: the runner's encoder path is rank 0's alone
            raise ValueError("vision-language models run without tensor or pipeline parallelism")
        super().__init__(config, tp)
        self.vision_model = SiglipVisionTransformer(config.vision)
        self.connector = Idefics3Connector(config)

    @property
    def image_token_id(self) -> int:
        return self.config.vision.image_token_id

    def embed_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """One image's frames [num_frames, C, H, W] -> its tokens' embeddings [num_frames * tokens_per_frame, hidden]"""
        pixel_values = pixel_values.to(self.vision_model.embeddings.patch_embedding.weight.dtype)
        features = self.connector(self.vision_model(pixel_values))  # [num_frames, tokens_per_frame, hidden]
        return features.reshape(-1, features.shape[-1])

    def decoder_parameters(self):
        return ((name, p) for name, p in self.named_parameters() if not name.startswith(("vision_model.", "connector.")))

    def load_weights(self, weights, into=None) -> set[str]:
        """The text model's tensors through the decoder's loader (model.text_model.X as model.X);
        the encoder's and connector's by their own names."""
        vision_params = {name: p for name, p in self.named_parameters()
                         if name.startswith(("vision_model.", "connector."))}
        return load_vision_language_weights(super().load_weights, weights, into, vision_params, VISION_PREFIXES,
                                            "model.text_model.")

