"""A vision-language checkpoint's config.json: the text model's facts, read by ModelConfig as a
text family's are, and the vision side's (`VisionConfig`).

Idefics3 (SmolVLM) nests its text model under `text_config` and its SigLIP encoder under
`vision_config`; the connector's pixel shuffle factor and the image placeholder token sit at the top.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.models.qwen_vision_config import QwenVisionConfig, split_qwen2_5_vl_config

# Vision-language architecture -> the text architecture its decoder is built as.
VISION_ARCHITECTURES = {"Idefics3ForConditionalGeneration": "LlamaForCausalLM",
                        "Qwen2_5_VLForConditionalGeneration": "Qwen2ForCausalLM"}


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

    def num_image_tokens(self, shape: list[int], what: str) -> int:
        """The placeholder tokens frames of `shape` [F, C, H, W] become; ValueError naming `what` unless
        the encoder takes them: square, in whole patches that pixel-shuffle."""
        frames, channels, height, width = shape
        if channels != self.num_channels or height != width or height % self.patch_size:
            raise ValueError(f"{what}: frames of {channels} x {height} x {width} pixels; the encoder takes "
                             f"{self.num_channels} channels, square, in patches of {self.patch_size}")
        side = height // self.patch_size
        if side % self.scale_factor:
            raise ValueError(f"{what}: {side} patches a side do not pixel-shuffle by {self.scale_factor}")
        return frames * side * side // self.scale_factor ** 2

    @property
    def tokens_per_frame(self) -> int:
        """Image tokens one encoder frame (a crop, or the global view) becomes."""
        return self.num_patches_per_side ** 2 // self.scale_factor ** 2


def split_vision_config(cfg: dict) -> tuple[dict, VisionConfig | None]:
    """(the config to read the text model from, the vision config); a text-only config comes back as it is."""
    architecture = (cfg.get("architectures") or [""])[0]
    if architecture not in VISION_ARCHITECTURES:
        return cfg, None
    if architecture == "Qwen2_5_VLForConditionalGeneration":
        return split_qwen2_5_vl_config(cfg)
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


PIXEL_ITEMSIZE = {1: 1, 2: 4}  # ipc.messages.PixelDType: UINT8, FLOAT32


def check_images(images: list, prompt_token_ids: list[int], vision: VisionConfig | QwenVisionConfig | None) -> None:
    """Raise ValueError naming the image unless every one of `images` (ipc.messages.ImageInput) fits this
    model and the prompt: its bytes match its shape, its frames the encoder, its range the prompt's
    placeholder tokens, which no other image's range overlaps."""
    if vision is None:
        if images:
            raise ValueError("this model is text-only: it takes no images")
        return
    num_placeholders = sum(1 for t in prompt_token_ids if t == vision.image_token_id)
    end = 0
    for i, image in enumerate(images):
        frames, channels, height, width = image.shape
        what = f"image {i}"
        if len(image.data) != frames * channels * height * width * PIXEL_ITEMSIZE[int(image.dtype)]:
            raise ValueError(f"{what}: {len(image.data)} bytes do not hold a {image.dtype.name} array of shape {image.shape}")
        wanted = vision.num_image_tokens(image.shape, what)  # raises where the frames do not fit the encoder
        if int(image.dtype) == 1 and not (len(image.image_mean) == len(image.image_std) == channels
                                          and all(image.image_std)):
            raise ValueError(f"{what}: uint8 pixels need a nonzero image_mean and image_std per channel")
        if image.offset < end or image.offset + image.length > len(prompt_token_ids):
            raise ValueError(f"{what}: tokens {image.offset}..{image.offset + image.length - 1} overlap another "
                             f"image or pass the prompt's {len(prompt_token_ids)} tokens")
        end = image.offset + image.length
        found = sum(1 for t in prompt_token_ids[image.offset:end] if t == vision.image_token_id)
        if found != wanted:
            raise ValueError(f"{what}: its {frames} frames make {wanted} image tokens; its range holds {found}")
        if isinstance(vision, QwenVisionConfig) and image.length != wanted:  # M-RoPE lays them out as one grid
            raise ValueError(f"{what}: its {wanted} image tokens must be consecutive")
        num_placeholders -= found
    if num_placeholders:
        raise ValueError(f"the prompt holds {num_placeholders} image placeholder tokens that no image fills")
