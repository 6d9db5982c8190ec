"""Tests for engine.loader.model_files: name resolution (fast) and the converted default model (slow)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.loader.model_files import DEFAULT_MODEL, resolve_model
from tests.helpers import REPO_ROOT


def test_missing_path_raises(tmp_path):
    with pytest.raises(ValueError, match="unknown model"):
        resolve_model(str(tmp_path / "does-not-exist"))


def test_folder_without_config_raises(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        resolve_model(str(tmp_path))


def test_local_folder_returned_unchanged(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path)) == str(tmp_path)


def test_alias_uses_cached_folder_without_torch(tmp_path):
    folder = tmp_path / "models" / "SmolLM2-135M-Instruct"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"")
    script = (
        "import sys; from engine.loader.model_files import resolve_model; "
        "print(resolve_model(sys.argv[1])); print('torch' in sys.modules)"
    )
    env = dict(os.environ, TOKENLOOM_CACHE=str(tmp_path))
    for alias in ("smollm2", "SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct"):
        result = subprocess.run([sys.executable, "-c", script, alias], cwd=REPO_ROOT, env=env,
                                capture_output=True, text=True, check=True)
        assert result.stdout.split() == [str(folder), "False"]


@pytest.mark.slow
def test_default_model_answers_paris():
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = resolve_model(DEFAULT_MODEL)
    config = json.loads((Path(folder) / "config.json").read_text())
    assert config["tie_word_embeddings"] is True
    assert config["architectures"] == ["LlamaForCausalLM"]

    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert tokenizer.chat_template
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)
    with torch.no_grad():
        output_ids = model.generate(**inputs, max_new_tokens=20, do_sample=False)
    num_prompt_tokens = inputs["input_ids"].shape[1]
    text = tokenizer.decode(output_ids[0, num_prompt_tokens:], skip_special_tokens=True)
    assert text.startswith("The capital of France is Paris."), text
