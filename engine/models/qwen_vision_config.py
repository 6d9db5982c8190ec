"""Qwen2.5-VL's config.json: the text model's facts (a Qwen2 decoder, under `text_config` as
transformers 5 writes it or at the top level as the published checkpoints have them) and the vision
tower's (`QwenVisionConfig`), with the text rotary's M-RoPE sections.

M-RoPE (`rope_scaling: {"type": "mrope", "mrope_section": [16, 24, 24]}`) is ordinary rotary over
3-component positions, so the text model reads it as plain rope at `rope_theta`; the sections go with
the vision config, to the model's rotary (engine.models.qwen2_5_vl).
"""

from __future__ import annotations

from dataclasses import dataclass

VISION_KEYS = ("vision_config", "text_config", "image_token_id", "video_token_id", "vision_start_token_id",
               "vision_end_token_id")


@dataclass(frozen=True)
class QwenVisionConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int  # depth
    num_heads: int
    num_channels: int
    patch_size: int  # 14 px
    temporal_patch_size: int  # 2: an image is its frame twice
    spatial_merge_size: int  # 2: each 2 x 2 patches become one text token
    window_size: int  # 112 px: the windows of the window-attention blocks
    out_hidden_size: int  # the text model's hidden size
    fullatt_block_indexes: tuple[int, ...]  # the blocks that attend over the whole image
    rope_theta: float  # the ViT's 2D rotary
    image_token_id: int  # <|image_pad|>
    vision_start_token_id: int
    mrope_section: tuple[int, ...]  # the text rotary's frequencies per (temporal, height, width) component
    hidden_act: str = "silu"

    def num_image_tokens(self, shape: list[int], what: str) -> int:
        """The <|image_pad|> tokens a resized image [1, C, H, W] becomes; ValueError naming `what` unless
        the tower takes it: one frame, whole 28-px merge blocks."""
        frames, channels, height, width = shape
        unit = self.patch_size * self.spatial_merge_size
        if frames != 1 or channels != self.num_channels or height % unit or width % unit:
            raise ValueError(f"{what}: frames of {frames} x {channels} x {height} x {width} pixels; the encoder takes "
                             f"one frame of {self.num_channels} channels, both sides multiples of {unit}")
        return (height // unit) * (width // unit)


def split_qwen2_5_vl_config(cfg: dict) -> tuple[dict, QwenVisionConfig]:
    """(the text model's config, read as a Qwen2's; the vision config)."""
    architecture = cfg["architectures"][0]
    text = dict(cfg["text_config"]) if cfg.get("text_config") else {k: v for k, v in cfg.items() if k not in VISION_KEYS}
    text["architectures"] = [architecture]
    text["tie_word_embeddings"] = cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    text["attention_bias"] = True  # Qwen2's q/k/v biases
    if "eos_token_id" in cfg and "eos_token_id" not in text:
        text["eos_token_id"] = cfg["eos_token_id"]
    rope = dict(text.pop("rope_scaling", None) or text.get("rope_parameters") or {})
    mrope_section = tuple(rope.get("mrope_section") or (16, 24, 24))
    text["rope_parameters"] = {"rope_type": "default",
                               "rope_theta": text.pop("rope_theta", rope.get("rope_theta", 1000000.0))}
    head_dim = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
    if 2 * sum(mrope_section) != head_dim:
        raise ValueError(f"mrope_section {list(mrope_section)} does not cover the head's {head_dim // 2} frequencies")
    vision = cfg["vision_config"]
    if vision.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{architecture} with vision hidden_act {vision.get('hidden_act')!r} is not supported")
    vision_rope = vision.get("rope_parameters") or {}
    return text, QwenVisionConfig(
        hidden_size=vision["hidden_size"],
        intermediate_size=vision["intermediate_size"],
        num_layers=vision["depth"],
        num_heads=vision["num_heads"],
        num_channels=vision.get("in_channels", vision.get("in_chans", 3)),
        patch_size=vision.get("patch_size", 14),
        temporal_patch_size=vision.get("temporal_patch_size", 2),
        spatial_merge_size=vision.get("spatial_merge_size", 2),
        window_size=vision.get("window_size", 112),
        out_hidden_size=vision.get("out_hidden_size", text["hidden_size"]),
        fullatt_block_indexes=tuple(vision.get("fullatt_block_indexes", (7, 15, 23, 31))),
        rope_theta=float(vision_rope.get("rope_theta", 10000.0)),
        image_token_id=cfg.get("image_token_id", 151655),
        vision_start_token_id=cfg.get("vision_start_token_id", 151652),
        mrope_section=mrope_section,
    )
