"""PEFT LoRA adapter folders written without peft (random A and B), for the benchmarks and the hostile
client: `adapter_config.json` and `adapter_model.safetensors` under PEFT's key names."""

from __future__ import annotations

import json
from pathlib import Path

MODULES = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}


def write_adapter(folder: Path, model_path: str, rank: int, seed: int, **config_changes) -> str:
    """A PEFT LoRA adapter of the model at `model_path` with random A and B (std 0.02) on every projection."""
    import torch
    from safetensors.torch import save_file

    from ipc.lora_adapter import ModelShape

    shape = ModelShape.from_folder(model_path)
    sizes = {"q_proj": (shape.hidden_size, shape.q_size), "k_proj": (shape.hidden_size, shape.kv_size),
             "v_proj": (shape.hidden_size, shape.kv_size), "o_proj": (shape.q_size, shape.hidden_size),
             "gate_proj": (shape.hidden_size, shape.intermediate_size),
             "up_proj": (shape.hidden_size, shape.intermediate_size),
             "down_proj": (shape.intermediate_size, shape.hidden_size)}
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(shape.num_layers):
        for block, names in MODULES.items():
            for name in names:
                num_in, num_out = sizes[name]
                key = f"base_model.model.model.layers.{i}.{block}.{name}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(rank, num_in, generator=generator) * 0.02
                tensors[f"{key}.lora_B.weight"] = torch.randn(num_out, rank, generator=generator) * 0.02
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": sorted(sizes),
              "bias": "none", "use_rslora": False, **config_changes}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return str(folder)
