"""Idefics3's (SmolVLM's) image preprocessing in numpy and PIL: resize to the longest edge, split into
crops of the encoder's size plus a global view, and the prompt string that stands for them.

A port of transformers' Idefics3ImageProcessorPil (image_processing_pil_idefics3.py) and of
Idefics3Processor.replace_image_token: transformers' image processors import torch whenever it is
installed (transformers/image_utils.py), and the frontend must never. tests/models/test_idefics3.py
checks the frames against transformers' own, bit for bit. The frames stay uint8 here: the core
normalises them (engine.worker.step_inputs.pixels_to_tensor) with the processor's operations, so a
frame travels in a quarter of float32's bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from PIL import Image

MAX_IMAGE_SIZE = 4096  # transformers' absolute upper bound of a resized image's side


@dataclass(frozen=True)
class Idefics3Preprocessing:
    """preprocessor_config.json's choices (SmolVLM: longest edge 2048, crops of 512)."""

    longest_edge: int = 4 * 364
    crop_size: int = 364  # max_image_size.longest_edge: the encoder's frame
    do_image_splitting: bool = True
    rescale_factor: float = 1 / 255
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)
    resample: int = Image.Resampling.LANCZOS

    @classmethod
    def from_dict(cls, cfg: dict) -> "Idefics3Preprocessing":
        defaults = cls()
        return cls(
            longest_edge=(cfg.get("size") or {}).get("longest_edge", defaults.longest_edge),
            crop_size=(cfg.get("max_image_size") or {}).get("longest_edge", defaults.crop_size),
            do_image_splitting=cfg.get("do_image_splitting", True),
            rescale_factor=cfg.get("rescale_factor", defaults.rescale_factor),
            image_mean=tuple(cfg.get("image_mean", defaults.image_mean)),
            image_std=tuple(cfg.get("image_std", defaults.image_std)),
            resample=cfg.get("resample", defaults.resample),
        )

    def frames(self, image: Image.Image) -> tuple[np.ndarray, int, int]:
        """(uint8 frames [num_frames, 3, crop, crop], rows, cols): the crops row by row, then the
        global view; rows = cols = 0 when the image is not split (the global view alone)."""
        image = image.convert("RGB")
        image = self._resize(image, *_fit_longest_edge(image.height, image.width, self.longest_edge))
        if not self.do_image_splitting:
            return _to_chw([self._resize(image, self.crop_size, self.crop_size)]), 0, 0
        image = self._resize(image, *_multiple_of_crop(image.height, image.width, self.crop_size))
        if image.height <= self.crop_size and image.width <= self.crop_size:
            return _to_chw([image]), 0, 0
        rows = (image.height - self.crop_size) // self.crop_size + 1
        cols = (image.width - self.crop_size) // self.crop_size + 1
        size = self.crop_size
        crops = [image.crop((c * size, r * size, (c + 1) * size, (r + 1) * size)) for r in range(rows) for c in range(cols)]
        crops.append(self._resize(image, size, size))
        return _to_chw(crops), rows, cols

    def _resize(self, image: Image.Image, height: int, width: int) -> Image.Image:
        if (image.height, image.width) == (height, width):
            return image
        return image.resize((width, height), resample=self.resample)


def _to_chw(images: list[Image.Image]) -> np.ndarray:
    return np.stack([np.asarray(im, dtype=np.uint8).transpose(2, 0, 1) for im in images])  # [frames, 3, H, W]


def _fit_longest_edge(height: int, width: int, max_len: int) -> tuple[int, int]:
    """transformers' _resize_output_size_rescale_to_max_len, then _scale_below_upper_bound."""
    aspect_ratio = width / height
    if width >= height:
        width = max_len
        height = int(width / aspect_ratio)
        height += height % 2
    else:
        height = max_len
        width = int(height * aspect_ratio)
        width += width % 2
    height, width = max(height, 1), max(width, 1)
    aspect_ratio = width / height
    if width >= height and width > MAX_IMAGE_SIZE:
        width, height = MAX_IMAGE_SIZE, int(MAX_IMAGE_SIZE / aspect_ratio)
    elif height > width and height > MAX_IMAGE_SIZE:
        height, width = MAX_IMAGE_SIZE, int(MAX_IMAGE_SIZE * aspect_ratio)
    return max(height, 1), max(width, 1)


def _multiple_of_crop(height: int, width: int, crop: int) -> tuple[int, int]:
    """transformers' resize_for_vision_encoder: both sides up to multiples of the crop size."""
    aspect_ratio = width / height
    if width >= height:
        width = math.ceil(width / crop) * crop
        height = math.ceil(int(width / aspect_ratio) / crop) * crop
    else:
        height = math.ceil(height / crop) * crop
        width = math.ceil(int(height * aspect_ratio) / crop) * crop
    return height, width


def image_prompt_string(rows: int, cols: int, tokens_per_frame: int) -> str:
    """What an image's `<image>` becomes in the prompt (transformers' Idefics3Processor.replace_image_token)."""
    fake, image, global_tag = "<fake_token_around_image>", "<image>", "<global-img>"
    global_view = f"{fake}{global_tag}{image * tokens_per_frame}{fake}"
    if rows == 0 and cols == 0:
        return global_view
    text = ""
    for r in range(rows):
        for c in range(cols):
            text += f"{fake}<row_{r + 1}_col_{c + 1}>{image * tokens_per_frame}"
        text += "\n"
    return text + "\n" + global_view
