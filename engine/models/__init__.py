"""Model registry: config.json's `architectures` picks the class; weights come from safetensors."""

from __future__ import annotations

import glob
import logging
import os

import torch

from engine.models.config import ModelConfig
from engine.models.llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM

logger = logging.getLogger(__name__)

MODEL_CLASSES = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
}


LOAD_FORMATS = ("auto", "dummy")


def load_model(
    config: ModelConfig, dtype: torch.dtype, device: torch.device, load_format: str = "auto", tp=None
) -> LlamaForCausalLM:
    """Build the model for config.json's architecture; `load_format="dummy"` fills random
    weights instead of reading a checkpoint (timing a model's shape without its weights).
    `tp` (engine.distributed.parallel_state.TensorParallelGroup): build and load this rank's shard."""
    from safetensors import safe_open

    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    model_class = MODEL_CLASSES.get(config.architecture)
    if model_class is None:
        raise ValueError(f"architecture {config.architecture!r} is not supported; known: {sorted(MODEL_CLASSES)}")
    files = sorted(glob.glob(os.path.join(config.path, "*.safetensors")))
    if not files and load_format == "auto":
        raise FileNotFoundError(f"no .safetensors files in {config.path}")
    with torch.device("meta"):
        model = model_class(config) if tp is None else model_class(config, tp)
    # Materialise on the target device, then fill from the checkpoint; the
    # rotary cache is recomputed since meta tensors hold no values.
    model = model.to_empty(device=device)
    model.rotary.__init__(config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling)
    model.rotary.to(device)

    def weights():
        for path in files:
            with safe_open(path, framework="pt", device="cpu") as f:
                for name in f.keys():
                    # Under TP a lazy slice: each rank reads only its shard.
                    yield name, (f.get_tensor(name) if tp is None else f.get_slice(name))

    if load_format == "dummy":
        _fill_random(model)
    else:
        model.load_weights(weights())
    model = model.to(dtype=dtype)
    # The rotary tables stay fp32: positions up to 100k+ lose precision in bf16.
    model.rotary.float()
    logger.info("loaded %s (%s) from %s", config.architecture, dtype, config.path)
    return model.eval()


@torch.no_grad()
def _fill_random(model: LlamaForCausalLM) -> None:
    generator = torch.Generator(device=model.embed_tokens.weight.device).manual_seed(0)
    for name, param in model.named_parameters():
        if name.endswith("layernorm.weight") or name == "norm.weight":
            param.fill_(1.0)
        else:
            param.normal_(0.0, 0.02, generator=generator)
