"""Phi-3 and Phi-4-mini: Llama's layout, with q/k/v and gate/up already fused in the
checkpoint (`qkv_proj`, `gate_up_proj`: one tensor each, split into parts only to shard
them under TP). Phi-4-mini rotates only the first 3/4 of each head (partial_rotary_factor
0.75) and, like Phi-3-128k, scales rotary with longrope (engine/models/rotary.py).

Partial rotary is outside the fused rotary + KV store kernel: those layers run rotary and
the store as torch ops; full-rotary Phi-3 gets the fused kernel.
"""

from __future__ import annotations

from engine.models.decoder import CheckpointName, DecoderForCausalLM


class Phi3ForCausalLM(DecoderForCausalLM):
    checkpoint_names = (
        CheckpointName(r"self_attn\.qkv_proj\.", "self_attn.qkv_proj.", ("q", "k", "v")),
        CheckpointName(r"mlp\.gate_up_proj\.", "mlp.gate_up_proj.", ("gate", "up")),
    )
