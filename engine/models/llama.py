"""Llama, Mistral and Qwen2: the plain decoder (engine/models/decoder.py), with q/k/v
biases where the config says so (Qwen2 always)."""

from __future__ import annotations

from engine.models.decoder import CheckpointName, DecoderForCausalLM

# q, k and v, and gate and up, are separate tensors in the checkpoint and one matmul here.
# The MLP patterns also match MoE experts' (Qwen3-MoE: mlp.experts.N.gate_proj).
SEPARATE_PROJECTIONS = (
    CheckpointName(r"self_attn\.q_proj\.", "self_attn.qkv_proj.", ("q",)),
    CheckpointName(r"self_attn\.k_proj\.", "self_attn.qkv_proj.", ("k",)),
    CheckpointName(r"self_attn\.v_proj\.", "self_attn.qkv_proj.", ("v",)),
    CheckpointName(r"\.gate_proj\.", ".gate_up_proj.", ("gate",)),
    CheckpointName(r"\.up_proj\.", ".gate_up_proj.", ("up",)),
)


class LlamaForCausalLM(DecoderForCausalLM):
    checkpoint_names = SEPARATE_PROJECTIONS


class MistralForCausalLM(LlamaForCausalLM):
    """Same decoder as Llama; Mistral-7B-v0.2 and later use no sliding window."""


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Llama with q/k/v biases (ModelConfig.attention_bias is on for Qwen2)."""
