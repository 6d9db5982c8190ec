"""Random-weight Qwen2.5-VL checkpoints built with transformers, for the tests: a tiny one (a 4-block
ViT with window attention in two blocks and full attention in two, 56-px windows so a small image has
several; a 2-layer Qwen2 text model whose M-RoPE sections split its 8 frequencies 2/3/3), served as
Qwen2.5-VL is: SmolLM2's tokenizer (the default model's) with Qwen's vision tokens, a Qwen-style chat
template (an image part renders as <|vision_start|><|image_pad|><|vision_end|>) and an image processor
config with small min/max pixels."""

from __future__ import annotations

import json

from scripts.lib.vision_model import default_model_folder

TINY_QWEN_VISION = dict(depth=4, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=14,
                        temporal_patch_size=2, spatial_merge_size=2, window_size=56, fullatt_block_indexes=[1, 3])
TINY_QWEN_TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-6,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
# Qwen2.5-VL-3B-Instruct's config.json vision_config (the 7B's differs only in out_hidden_size).
QWEN2_5_VL_3B_VISION = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=2048,
                            patch_size=14, temporal_patch_size=2, spatial_merge_size=2, window_size=112,
                            fullatt_block_indexes=[7, 15, 23, 31])
QWEN_VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
QWEN_VL_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>{% endif %}{% endfor %}"
    "{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
MIN_PIXELS, MAX_PIXELS = 56 * 56, 28 * 28 * 36  # up to 6 x 6 merge blocks: 36 image tokens, 9 windows


def make_tiny_qwen2_5_vl(tmp_path, name: str = "TinyQwen2_5_VL"):
    """(the HF folder, the transformers model) of a random-weight Qwen2.5-VL served as the real one is."""
    import torch
    import transformers
    from tokenizers import AddedToken, Tokenizer

    tokenizer = Tokenizer.from_file(str(default_model_folder() / "tokenizer.json"))
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in QWEN_VISION_TOKENS])
    ids = {t: tokenizer.token_to_id(t) for t in QWEN_VISION_TOKENS}
    text = {**TINY_QWEN_TEXT, "vocab_size": tokenizer.get_vocab_size(), "eos_token_id": 2, "bos_token_id": 1,
            "initializer_range": 0.1}
    config = transformers.Qwen2_5_VLConfig(
        text_config=text, vision_config={**TINY_QWEN_VISION, "out_hidden_size": text["hidden_size"]},
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.Qwen2_5_VLForConditionalGeneration(config).eval()
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param_name.endswith(".bias"):
                param.normal_(0, 0.1)  # biases start at zero; make them count
            elif "visual" in param_name and param.dim() > 1:
                param.normal_(0, 0.1)  # the tower's default init is small enough to hide its mistakes
    folder = tmp_path / name
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    tokenizer_config = json.loads((default_model_folder() / "tokenizer_config.json").read_text())
    tokenizer_config["chat_template"] = QWEN_VL_CHAT_TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    (folder / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Qwen2VLImageProcessor", "min_pixels": MIN_PIXELS, "max_pixels": MAX_PIXELS,
        "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2}))
    return str(folder), model


def hf_image_processor():
    from transformers import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS})


def as_published_layout(folder, dest):
    """A copy of a transformers-5 Qwen2.5-VL folder in the published checkpoints' layout (Qwen2.5-VL-3B's):
    the text config at the top level with rope_scaling {"type": "mrope", ...}, and the weights named
    visual.X and model.X instead of model.visual.X and model.language_model.X."""
    import shutil
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    folder, dest = Path(folder), Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "preprocessor_config.json"):
        shutil.copy(folder / name, dest / name)
    cfg = json.loads((folder / "config.json").read_text())
    text = cfg.pop("text_config")
    rope = text.pop("rope_parameters")
    flat = {**text, **cfg, "model_type": "qwen2_5_vl", "rope_theta": rope["rope_theta"],
            "rope_scaling": {"type": "mrope", "mrope_section": rope["mrope_section"]},
            "sliding_window": 32768, "use_sliding_window": False, "max_window_layers": 70}
    flat["vision_config"] = {**cfg["vision_config"], "in_chans": 3}
    flat["vision_config"].pop("in_channels", None)
    flat["vision_config"].pop("rope_parameters", None)
    (dest / "config.json").write_text(json.dumps(flat))
    weights = load_file(str(folder / "model.safetensors"))
    renamed = {name.replace("model.language_model.", "model.", 1).replace("model.visual.", "visual.", 1): tensor
               for name, tensor in weights.items()}
    save_file(renamed, str(dest / "model.safetensors"))
    return str(dest)
