"""Tiny random Idefics3 (SmolVLM-shaped) checkpoints for tests, built with transformers, and
the published SmolVLM-256M shape (SigLIP-B/16-512 encoder, SmolLM2-135M's text config)."""

from __future__ import annotations

import json

IMAGE_TOKEN_ID = 500  # inside the tiny 512-token vocabulary
TINY_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                   image_size=32, patch_size=8)  # 4 x 4 patches -> 4 tokens per frame (scale 2)
TINY_TEXT = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=False)
# SmolVLM-256M-Instruct's config.json: SigLIP-B/16 at 512 px, SmolLM2-135M, pixel shuffle 4 (64 tokens a frame).
SMOLVLM_256M_VISION = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                           image_size=512, patch_size=16)
SMOLVLM_256M_TEXT = dict(vocab_size=49280, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                         rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)
SMOLVLM_256M_IMAGE_TOKEN_ID = 49190


def make_tiny_idefics3(tmp_path, vision=None, text=None, scale_factor: int = 2, image_token_id: int = IMAGE_TOKEN_ID,
                       name: str = "Idefics3"):
    """(the HF folder, the transformers model) of a random-weight Idefics3."""
    import torch
    import transformers

    config = transformers.Idefics3Config(
        vision_config={**(vision or TINY_VISION)},
        text_config=transformers.LlamaConfig(**{**(text or TINY_TEXT), "initializer_range": 0.1}),
        scale_factor=scale_factor, image_token_id=image_token_id, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.Idefics3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param_name.endswith(".bias"):
                param.normal_(0, 0.1)  # biases start at zero; make them count
    path = tmp_path / name
    model.save_pretrained(path, safe_serialization=True)
    assert json.loads((path / "config.json").read_text())["architectures"] == ["Idefics3ForConditionalGeneration"]
    return str(path), model
