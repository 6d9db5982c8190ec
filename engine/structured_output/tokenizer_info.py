"""xgrammar's TokenizerInfo for a model folder, kept on disk once built.

Building it loads the tokenizer with transformers and decodes every token (seconds on
2 cores, holding the GIL most of that time); a cached one deserializes in a small fraction
of that (docs/structured-outputs.md). The file's name is a hash of what the info depends
on: the tokenizer's files, the vocabulary size, the stop tokens and xgrammar's version, so
a changed tokenizer or xgrammar builds a new one. A cache that cannot be read or written is only a miss: the info is built.

    <cache_dir>/<sha256[:24]>.json     xgrammar's TokenizerInfo.serialize_json()
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

# What AutoTokenizer reads from a folder (a file that is absent is skipped).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "tokenizer.model")


def load_tokenizer_info(model_folder: str | Path, vocab_size: int | None, stop_token_ids: list[int] | None,
                        cache_dir: str | Path | None = None):
    """The xgrammar TokenizerInfo of the folder's tokenizer: from `cache_dir` when it is there, else built
    (and written there, when a `cache_dir` is given)."""
    import xgrammar

    path = None
    if cache_dir is not None:
        path = Path(cache_dir) / f"{info_key(model_folder, vocab_size, stop_token_ids)}.json"
        try:
            return xgrammar.TokenizerInfo.deserialize_json(path.read_text())
        except FileNotFoundError:
            pass
        except Exception as e:  # a torn or foreign file: build it again
            logger.warning("grammar tokenizer info %s unreadable (%s): building it again", path, e)
    info = build_tokenizer_info(model_folder, vocab_size, stop_token_ids)
    if path is not None:
        _write_atomically(path, info.serialize_json())
    return info


def build_tokenizer_info(model_folder: str | Path, vocab_size: int | None, stop_token_ids: list[int] | None):
    import xgrammar
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_folder))
    return xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)


def info_key(model_folder: str | Path, vocab_size: int | None, stop_token_ids: list[int] | None) -> str:
    digest = hashlib.sha256(json.dumps([importlib.metadata.version("xgrammar"), vocab_size,
                                        sorted(stop_token_ids) if stop_token_ids is not None else None]).encode())
    for name in TOKENIZER_FILES:
        file = Path(model_folder) / name
        if file.is_file():
            digest.update(name.encode() + b"\0" + hashlib.sha256(file.read_bytes()).digest())
    return digest.hexdigest()[:24]


def _write_atomically(path: Path, text: str) -> None:
    """Whole or not at all: two engines starting together each write their own file, then rename it."""
    temporary = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as file:
            temporary = file.name
            file.write(text)
        os.replace(temporary, path)
    except OSError as e:  # a read-only or full cache: the next engine builds it again
        logger.warning("grammar tokenizer info not cached at %s: %s", path, e)
        if temporary is not None:
            Path(temporary).unlink(missing_ok=True)
