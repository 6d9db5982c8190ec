"""A Hugging Face folder of a Llama shape with random weights in bf16 (transformers' LlamaConfig and
its own initialisation) and the default model's tokenizer: what `--quantization int4|int8` serves
on a model of that size without downloading one (docs/cpu-kernels.md, "int4 and int8 without
VNNI", compares it with the GGUF file of the same shape, scripts/bench/gguf_load.py's SHAPES).

    python -m scripts.bench.random_hf_folder --shape llama-3.2-1b --out /work/gs-files/llama1b-hf

Ids past the tokenizer's vocabulary decode to nothing, as the random GGUF files' padding does.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from scripts.bench.gguf_load import SHAPES

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def write_folder(shape: str, out: Path, seed: int = 0) -> dict:
    """Writes config.json, model.safetensors and the tokenizer's files into `out`; returns a summary."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from engine.loader.model_files import resolve_model

    sizes = SHAPES[shape]
    config = LlamaConfig(vocab_size=sizes["vocab_size"], hidden_size=sizes["hidden_size"],
                         intermediate_size=sizes["intermediate_size"], num_hidden_layers=sizes["num_layers"],
                         num_attention_heads=sizes["num_heads"], num_key_value_heads=sizes["num_kv_heads"],
                         head_dim=sizes["hidden_size"] // sizes["num_heads"], max_position_embeddings=8192,
                         rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=sizes["tie_word_embeddings"],
                         bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16")
    torch.manual_seed(seed)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # built in bf16: a 1B model never exists in fp32 here
    try:
        model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default_dtype)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer = Path(resolve_model("smollm2"))
    for name in TOKENIZER_FILES:
        if (tokenizer / name).exists():
            shutil.copy(tokenizer / name, out / name)
    return {"shape": shape, "out": str(out), "params": sum(p.numel() for p in model.parameters()),
            "bytes": sum(p.stat().st_size for p in out.iterdir())}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.2-1b")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    json.dump(write_folder(args.shape, args.out, args.seed), sys.stdout)
    print()


if __name__ == "__main__":
    main()
