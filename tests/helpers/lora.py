"""LoRA adapters for tests, made with peft on a transformers model: B random (peft starts it at
zero, which would add nothing), so every adapted projection changes the output."""

from __future__ import annotations

import copy

LLAMA_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PHI3_MODULES = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]


def make_peft_adapter(hf_model, path, r: int = 8, lora_alpha: float = 16, target_modules=None,
                      use_rslora: bool = False, seed: int = 1, std: float = 0.1):
    """Save a LoRA adapter of `hf_model` (left untouched) under `path`; returns (path, the peft model)."""
    import torch
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=r, lora_alpha=lora_alpha, target_modules=target_modules or LLAMA_MODULES,
                        use_rslora=use_rslora, lora_dropout=0.0, bias="none")
    peft_model = get_peft_model(copy.deepcopy(hf_model), config).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * std)
    peft_model.save_pretrained(str(path))
    return str(path), peft_model
