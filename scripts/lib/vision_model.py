"""Random-weight Idefics3 (SmolVLM-shaped) checkpoints built with transformers, for the tests and
scripts/bench/vision.py: tiny ones, and the published SmolVLM-256M shape (SigLIP-B/16-512 encoder,
SmolLM2-135M's text config). Served as SmolVLM is: SmolLM2's tokenizer (the default model's, converted
by `make model`) with SmolVLM's special tokens, its chat template and an image processor config."""

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


# SmolVLM's chat template (its tokenizer_config.json): an image part renders as <image>.
SMOLVLM_CHAT_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n"
    "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}")
VISION_SPECIAL_TOKENS = (["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"]
                         + [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)])


def make_tiny_smolvlm(tmp_path, crop_size: int = 32, longest_edge: int = 64, vision=None, text=None,
                      scale_factor: int = 2, name: str = "TinySmolVLM"):
    """A tiny Idefics3 served as SmolVLM is: SmolLM2's tokenizer with SmolVLM's special tokens (the vocabulary
    sized to it), SmolVLM's chat template and an image processor config; (the folder, the transformers model)."""
    from tokenizers import AddedToken, Tokenizer

    tokenizer = Tokenizer.from_file(str(default_model_folder() / "tokenizer.json"))
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in VISION_SPECIAL_TOKENS])
    image_token_id = tokenizer.token_to_id("<image>")
    text = {**(text or TINY_TEXT), "vocab_size": tokenizer.get_vocab_size(), "eos_token_id": 2}
    path, model = make_tiny_idefics3(tmp_path, vision, text, scale_factor, image_token_id, name)
    folder = tmp_path / name
    tokenizer.save(str(folder / "tokenizer.json"))
    config = json.loads((default_model_folder() / "tokenizer_config.json").read_text())
    config["chat_template"] = SMOLVLM_CHAT_TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Idefics3ImageProcessor", "do_image_splitting": True, "resample": 1,
        "size": {"longest_edge": longest_edge}, "max_image_size": {"longest_edge": crop_size},
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "rescale_factor": 1 / 255}))
    return path, model


def default_model_folder():
    """The default model's converted folder (its tokenizer is SmolVLM's text side's); raises when missing."""
    from engine.loader.model_files import DEFAULT_MODEL, cache_dir, find_known_model

    folder = cache_dir() / "models" / find_known_model(DEFAULT_MODEL).folder_name
    if not (folder / "tokenizer.json").is_file():
        raise FileNotFoundError(f"the default model is not converted at {folder} (make model)")
    return folder
