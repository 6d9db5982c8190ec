"""A vision-language checkpoint's config.json: the text model's facts, read by ModelConfig as a
text family's are, and the vision side's (`VisionConfig`).

Idefics3 (SmolVLM) nests its text model under `text_config` and its SigLIP encoder under
`vision_config`; the connector's pixel shuffle factor and the image placeholder token sit at the top.
"""

from __future__ import annotations

from dataclasses import dataclass

# Vision-language architecture -> the text architecture its decoder is built as.
VISION_ARCHITECTURES = {"Idefics3ForConditionalGeneration": "LlamaForCausalLM"}


@dataclass(frozen=True)
class VisionConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_channels: int
    image_size: int  # the encoder's position grid covers image_size x image_size pixels
    patch_size: int
    layer_norm_eps: float
    scale_factor: int  # pixel shuffle: scale_factor**2 patches become one token
    image_token_id: int  # the placeholder whose embedding an image token replaces

    @property
    def num_patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def tokens_per_frame(self) -> int:
        """Image tokens one encoder frame (a crop, or the global view) becomes."""
        return self.num_patches_per_side ** 2 // self.scale_factor ** 2


def split_vision_config(cfg: dict) -> tuple[dict, VisionConfig | None]:
    """(the config to read the text model from, the vision config); a text-only config comes back as it is."""
    architecture = (cfg.get("architectures") or [""])[0]
    if architecture not in VISION_ARCHITECTURES:
        return cfg, None
    text = dict(cfg["text_config"])
    text["architectures"] = [architecture]
    # The top level's choice wins: HF ties (or not) the LM head there for the whole model.
    text["tie_word_embeddings"] = cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    for key in ("eos_token_id",):
        if key in cfg and key not in text:
            text[key] = cfg[key]
    vision = cfg["vision_config"]
    if vision.get("hidden_act", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise ValueError(f"{architecture} with vision hidden_act {vision.get('hidden_act')!r} is not supported")
    return text, VisionConfig(
        hidden_size=vision["hidden_size"],
        intermediate_size=vision["intermediate_size"],
        num_layers=vision["num_hidden_layers"],
        num_heads=vision["num_attention_heads"],
        num_channels=vision.get("num_channels", 3),
        image_size=vision["image_size"],
        patch_size=vision["patch_size"],
        layer_norm_eps=vision.get("layer_norm_eps", 1e-6),
        scale_factor=cfg.get("scale_factor", 2),
        image_token_id=cfg["image_token_id"],
    )
