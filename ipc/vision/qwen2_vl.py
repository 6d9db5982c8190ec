"""Qwen2-VL's and Qwen2.5-VL's image preprocessing in numpy and PIL (dynamic resolution): resize to
multiples of patch_size x merge_size (28 px) within min_pixels..max_pixels (`smart_resize`), and the
patch layout the vision tower reads (`patchify`): each 2 x 2 block of 14-px patches consecutive, each
patch's pixels repeated over the temporal patch (an image is a one-frame video).

A port of transformers' Qwen2VLImageProcessorPil (image_processing_pil_qwen2_vl.py): transformers'
image processors import torch whenever it is installed, and the frontend must never.
tests/models/test_qwen2_5_vl.py checks the pixels against transformers' own, bit for bit. The resized
image travels as uint8 [1, 3, H, W]; the core normalises it (engine.worker.step_inputs.pixels_to_tensor)
and patchifies it here, a permutation, so normalising before or after gives the same bits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from PIL import Image

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)  # OPENAI_CLIP_MEAN / _STD, the processor's defaults
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
IMAGE_PAD = "<|image_pad|>"  # the chat template's image: <|vision_start|><|image_pad|><|vision_end|>


@dataclass(frozen=True)
class Qwen2VLPreprocessing:
    """preprocessor_config.json's choices (Qwen2.5-VL: 56² to 28² x 1280 pixels, 14-px patches)."""

    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    rescale_factor: float = 1 / 255
    image_mean: tuple[float, ...] = CLIP_MEAN
    image_std: tuple[float, ...] = CLIP_STD
    resample: int = Image.Resampling.BICUBIC

    @classmethod
    def from_dict(cls, cfg: dict) -> "Qwen2VLPreprocessing":
        d = cls()
        size = cfg.get("size") or {}
        return cls(
            min_pixels=cfg.get("min_pixels") or size.get("shortest_edge") or d.min_pixels,
            max_pixels=cfg.get("max_pixels") or size.get("longest_edge") or d.max_pixels,
            patch_size=cfg.get("patch_size", d.patch_size),
            temporal_patch_size=cfg.get("temporal_patch_size", d.temporal_patch_size),
            merge_size=cfg.get("merge_size", d.merge_size),
            rescale_factor=cfg.get("rescale_factor", d.rescale_factor),
            image_mean=tuple(cfg.get("image_mean", d.image_mean)),
            image_std=tuple(cfg.get("image_std", d.image_std)),
            resample=cfg.get("resample", d.resample),
        )

    def frames(self, image: Image.Image) -> np.ndarray:
        """uint8 [1, 3, H, W]: the image resized to multiples of patch_size * merge_size."""
        image = image.convert("RGB")
        height, width = smart_resize(image.height, image.width, self.patch_size * self.merge_size,
                                     self.min_pixels, self.max_pixels)
        if (image.height, image.width) != (height, width):
            image = image.resize((width, height), resample=self.resample)
        return np.asarray(image, dtype=np.uint8).transpose(2, 0, 1)[None].copy()  # [1, 3, H, W]

    def num_image_tokens(self, frames: np.ndarray) -> int:
        """The <|image_pad|> tokens an image of these frames becomes: one per merge x merge patches."""
        _, _, height, width = frames.shape
        return (height // self.patch_size) * (width // self.patch_size) // self.merge_size ** 2


def smart_resize(height: int, width: int, factor: int = 28, min_pixels: int = 56 * 56,
                 max_pixels: int = 28 * 28 * 1280) -> tuple[int, int]:
    """transformers' smart_resize: both sides multiples of `factor`, the area within
    min_pixels..max_pixels, the aspect ratio kept as closely as that allows."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"an image's aspect ratio must be under 200, got {max(height, width) / min(height, width):.0f}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def patchify(image: np.ndarray, patch_size: int, merge_size: int, temporal_patch_size: int) -> np.ndarray:
    """[C, H, W] -> [grid_h * grid_w, C * temporal_patch_size * patch_size²]: patches in merge-block
    order (each merge x merge block's patches consecutive), a patch's pixels channel-major and repeated
    over the temporal patch (transformers' Qwen2VLImageProcessorPil.patchify)."""
    channel, height, width = image.shape
    grid_h, grid_w = height // patch_size, width // patch_size
    patches = image.reshape(channel, grid_h // merge_size, merge_size, patch_size,
                            grid_w // merge_size, merge_size, patch_size)
    patches = np.transpose(patches, (1, 4, 2, 5, 0, 3, 6))
    patches = np.broadcast_to(patches[:, :, :, :, :, None, :, :],
                              (*patches.shape[:5], temporal_patch_size, *patches.shape[5:]))
    return patches.reshape(grid_h * grid_w, channel * temporal_patch_size * patch_size * patch_size)
