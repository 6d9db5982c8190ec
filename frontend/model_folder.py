"""The frontend's model folder and tokenizer, found without importing the engine.

A model is a local folder, or a known name (`smollm2`) or a `.gguf` file whose
folder (config and tokenizer; a known name's weights too) `engine.loader.model_files` keeps in
its cache. Making that folder imports transformers and torch, which the frontend must never do,
so it runs in a child process; once made, the child just prints the cached folder. The tokenizer itself is
the shared torch-free `ipc.text.tokenizer.Tokenizer`.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

from ipc.text.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


def resolve_model_folder(model: str) -> str:
    """A local folder for `model`: the folder itself, or `engine.loader.model_files`' cached conversion
    of a known name or a GGUF file (anything but a folder goes to the child process)."""
    if Path(model).expanduser().is_dir():
        return str(Path(model).expanduser())
    logger.info("resolving model %r with engine.loader.model_files", model)
    result = subprocess.run(
        [sys.executable, "-m", "engine.loader.model_files", model], stdout=subprocess.PIPE, text=True, check=False
    )
    lines = result.stdout.strip().splitlines()
    if result.returncode != 0 or not lines:
        raise ValueError(f"cannot resolve model {model!r} (engine.loader.model_files exited with {result.returncode})")
    return lines[-1]


def load_tokenizer(model: str) -> Tokenizer:
    return Tokenizer(resolve_model_folder(model))
