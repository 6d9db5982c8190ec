"""Model registry: config.json's `architectures` picks the family; weights come from safetensors.

The building blocks (engine/models/): layers.py (RMSNorm, the SwiGLU MLP), rotary.py (full,
partial; linear, llama3, longrope), attention.py (GQA with optional bias and q/k norm),
moe.py (the MoE block), decoder.py (the layer stack and the checkpoint loader). A family
file composes them: llama.py, qwen3.py, phi3.py, mixtral.py, gemma3.py (Gemma 3 text,
with (1 + w) norms, GeGLU and sliding-window layers on their own rotary base). The CPU fast paths are
applied to the built model by engine/cpu/fast_paths.py (through engine/cpu/execution_plan.py)."""

from __future__ import annotations

import glob
import logging
import os

import torch

from engine.models.config import ModelConfig
from engine.models.decoder import DecoderForCausalLM
from engine.models.gemma3 import Gemma3ForCausalLM
from engine.models.idefics3 import Idefics3ForConditionalGeneration
from engine.models.layers import OffsetRMSNorm
from engine.models.llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM
from engine.models.mixtral import MixtralForCausalLM
from engine.models.phi3 import Phi3ForCausalLM
from engine.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration
from engine.models.qwen3 import Qwen3ForCausalLM, Qwen3MoeForCausalLM

logger = logging.getLogger(__name__)

MODEL_CLASSES = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Idefics3ForConditionalGeneration": Idefics3ForConditionalGeneration,  # SmolVLM: images in, text out
    "Qwen2_5_VLForConditionalGeneration": Qwen2_5_VLForConditionalGeneration,  # M-RoPE, dynamic resolution
}
MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "MixtralForCausalLM")


LOAD_FORMATS = ("auto", "dummy")


def load_model(
    config: ModelConfig, dtype: torch.dtype, device: torch.device, load_format: str = "auto", tp=None
) -> DecoderForCausalLM:
    """Build the model for config.json's architecture; `load_format="dummy"` fills random
    weights instead of reading a checkpoint (timing a model's shape without its weights).
    `tp` (engine.parallel.parallel_state.TensorParallelGroup): build and load this rank's shard."""
    from safetensors import safe_open

    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    model = new_model(config, tp)
    files = sorted(glob.glob(os.path.join(config.path, "*.safetensors")))
    if not files and load_format == "auto":
        raise FileNotFoundError(f"no .safetensors files in {config.path}")
    # Materialise on the target device, then fill from the checkpoint.
    model = model.to_empty(device=device)
    if config.tie_word_embeddings:  # materialising may have given the two their own tensors
        model.lm_head.weight = model.embed_tokens.weight

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
    # Routers stay fp32 (MoE expert choice); the rotary tables are rebuilt in fp32 after the
    # cast, since meta tensors hold no values and positions up to 100k+ lose precision in bf16.
    fp32_params = [(p, p.data) for m in model.modules() if getattr(m, "keeps_fp32", False) for p in m.parameters()]
    model = model.to(dtype=dtype)
    for param, data in fp32_params:
        param.data = data.float()
    model.build_rotary(device)
    logger.info("loaded %s (%s) from %s", config.architecture, dtype, config.path)
    return model.eval()


def new_model(config: ModelConfig, tp=None) -> DecoderForCausalLM:
    """The model for config.json's architecture on the meta device: its modules and shapes, no
    memory yet (load_model's first step; engine/loader/gguf_model.py's too)."""
    model_class = MODEL_CLASSES.get(config.architecture)
    if model_class is None:
        raise ValueError(f"architecture {config.architecture!r} is not supported; known: {sorted(MODEL_CLASSES)}")
    if config.architecture in MOE_ARCHITECTURES and config.moe is None:
        raise ValueError(f"{config.architecture} needs num_experts (or num_local_experts) in config.json")
    with torch.device("meta"):
        return model_class(config) if tp is None else model_class(config, tp)


@torch.no_grad()
def _fill_random(model: DecoderForCausalLM) -> None:
    generator = torch.Generator(device=model.embed_tokens.weight.device).manual_seed(0)
    offset_norms = {id(m.weight) for m in model.modules() if isinstance(m, OffsetRMSNorm)}
    for name, param in model.named_parameters():
        if id(param) in offset_norms:  # Gemma's (1 + w) norms: 0 scales by 1
            param.zero_()
        elif name.endswith("norm.weight"):  # layer norms, the final norm, q/k norms
            param.fill_(1.0)
        else:
            param.normal_(0.0, 0.02, generator=generator)
