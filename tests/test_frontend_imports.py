"""The frontend, and the text logic it shares with the offline API, must never import torch,
not even through transformers: check in fresh interpreters."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
TORCH_FREE_MODULES = ["frontend", "frontend.api_server", "frontend.client", "frontend.cli", "frontend.engine_client",
                      "frontend.local_socket", "frontend.tokenizer", "frontend.text_stream"]


@pytest.mark.parametrize("module", TORCH_FREE_MODULES)
def test_import_keeps_torch_out(module):
    code = (f"import sys, {module}; "
            "heavy = sorted(m for m in ('torch', 'transformers') if m in sys.modules); "
            "assert not heavy, heavy")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_loading_a_tokenizer_keeps_torch_out(tmp_path):
    code = ("import sys; sys.path.insert(0, 'tests'); from fake_engine import write_fake_model; "
            "from pathlib import Path; from frontend.tokenizer import load_tokenizer; "
            f"tok = load_tokenizer(str(write_fake_model(Path({str(tmp_path)!r})))); "
            "tok.encode_chat([{'role': 'user', 'content': 'hi'}]); "
            "assert 'torch' not in sys.modules")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
