"""The model folder of scripts/lib/fake_engine.py's fake core: a real (tiny) tokenizer, no weights.

`write_fake_model(folder)` writes a byte-level BPE tokenizer trained on a few lines
(tokenizer.json), a tokenizer_config.json with a ChatML template, and a config.json; the
frontend loads it as it loads a real model's folder. The fake core "generates" SCRIPT's tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

SCRIPT = "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs! "
CORPUS = [SCRIPT * 3, "Hello world, how are you today? I am fine, thank you.", "user assistant system\n"]
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
MAX_MODEL_LEN = 1024


def write_fake_model(folder: Path) -> Path:
    """A model folder with a real (tiny) tokenizer; the fake core needs no weights."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(CORPUS, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    tokenizer_config = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "unk_token": "<|endoftext|>",
                        "chat_template": CHATML}
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    config = {"model_type": "fake", "vocab_size": tokenizer.get_vocab_size(), "max_position_embeddings": MAX_MODEL_LEN}
    (folder / "config.json").write_text(json.dumps(config))
    return folder
