"""Models for tests: tiny random ones of any supported family and the default model's folder
(transformers' greedy reference is scripts/lib/greedy_drift.py's hf_greedy)."""

from __future__ import annotations

import functools
import json
import os

import pytest


def make_tiny_model(tmp_path, architecture: str, **overrides):
    """A random-weight model of the given architecture, saved as an HF folder under tmp_path;
    (the folder, the transformers model). Small (3 layers of 128, a 512-token vocabulary) unless
    `overrides` say otherwise."""
    import torch
    import transformers

    config_class = {
        "MistralForCausalLM": transformers.MistralConfig,
        "Qwen2ForCausalLM": transformers.Qwen2Config,
        "LlamaForCausalLM": transformers.LlamaConfig,
        "Qwen3ForCausalLM": transformers.Qwen3Config,
        "Qwen3MoeForCausalLM": transformers.Qwen3MoeConfig,
        "Phi3ForCausalLM": transformers.Phi3Config,
        "MixtralForCausalLM": transformers.MixtralConfig,
        "Gemma3ForCausalLM": transformers.Gemma3TextConfig,
    }[architecture]
    # Phi3Config's default special tokens (32000) lie outside a tiny vocabulary.
    family_defaults = {"Phi3ForCausalLM": dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)}.get(architecture, {})
    config = config_class(**{
        **family_defaults,
        "vocab_size": 512,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 3,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "max_position_embeddings": 1024,
        "tie_word_embeddings": False,
        "initializer_range": 0.1,  # peaky logits: no near-ties for greedy to trip on
        **overrides,
    })
    torch.manual_seed(0)
    model = getattr(transformers, architecture)(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0, 0.1)  # biases start at zero; make them count
    path = tmp_path / architecture
    model.save_pretrained(path, safe_serialization=True)
    assert json.loads((path / "config.json").read_text())["architectures"] == [architecture]
    return str(path), model


def cached_default_model():
    """The default model's converted folder, found where engine.loader.model_files puts it
    ($TOKENLOOM_CACHE included). Missing, it skips the test, except under CI, where
    `make test` converts it first and a missing model is a failure."""
    from engine.loader.model_files import DEFAULT_MODEL, cache_dir, find_known_model

    folder = cache_dir() / "models" / find_known_model(DEFAULT_MODEL).folder_name
    if not (folder / "tokenizer.json").is_file():
        message = f"the default model is not converted at {folder} (make model)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return folder


def quantization_runs(scheme: str) -> bool:
    """Whether --quantization `scheme` runs on this CPU: the vpdpbusd kernels (AVX512_VNNI) or,
    without them, llama.cpp blocks on the AVX2 GGUF kernels (engine/cpu/quantized_plan.py)."""
    from engine.cpu.host import detect_cpu_features
    from engine.cpu.quantized_plan import plan_quantization

    try:
        plan_quantization("cpu", detect_cpu_features().has_avx512_vnni, scheme)
    except ValueError:
        return False
    return True


def quantized_llm(model_path: str, quantization: str):
    """An offline LLM with --quantization int8 or int4; skips on a CPU with neither AVX512_VNNI
    nor AVX2 (quantization_runs)."""
    from engine import LLM

    if not quantization_runs(quantization):
        pytest.skip(f"{quantization} needs AVX512_VNNI or AVX2")
    return LLM(model_path, quantization=quantization)


def chat_question_prompts(model_path: str) -> list[list[int]]:
    """scripts/lib/greedy_drift.py's QUESTIONS as chat prompts (token ids) of the model's template."""
    from transformers import AutoTokenizer

    from scripts.lib.greedy_drift import QUESTIONS

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    return [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False) for q in QUESTIONS]


@functools.lru_cache(maxsize=None)
def hf_chat_answers(model_path: str, dtype: str) -> tuple[tuple[int, ...], ...]:
    """Transformers' greedy answers (NUM_NEW_TOKENS each) to chat_question_prompts in `dtype`
    ("float32" or "bfloat16"). Each costs tens of seconds and the bf16, int8 and Q8_0 GGUF
    fidelity tests need the same ones, so a session computes each once."""
    import torch
    from transformers import AutoModelForCausalLM

    from scripts.lib.greedy_drift import NUM_NEW_TOKENS, hf_greedy

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype)).eval()
    return tuple(tuple(hf_greedy(model, p, NUM_NEW_TOKENS)) for p in chat_question_prompts(model_path))
