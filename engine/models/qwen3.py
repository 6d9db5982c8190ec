"""Qwen3 and Qwen3-MoE: Llama's layout with a per-head RMSNorm on q and k before rotary,
an explicit head_dim (128 in the released models, not hidden / heads) and no q/k/v bias.
Qwen3-MoE swaps the MLP for the MoE block (top-k of E experts, renormalised when the
config's norm_topk_prob says so) in every layer but its `mlp_only_layers`.

The fused rotary + KV store kernel cannot apply the q/k norm, so these layers run rotary
and the store as torch ops (the norms themselves take the fused RMSNorm kernel on the CPU).
"""

from __future__ import annotations

from engine.parallel.parallel_state import TensorParallelGroup
from engine.models.attention import Attention
from engine.models.config import ModelConfig
from engine.models.decoder import CheckpointName, DecoderForCausalLM, DecoderLayer, dense_mlp, moe_or_dense_mlp
from engine.models.llama import SEPARATE_PROJECTIONS


class Qwen3ForCausalLM(DecoderForCausalLM):
    checkpoint_names = SEPARATE_PROJECTIONS

    def make_layer(self, config: ModelConfig, layer_index: int, tp: TensorParallelGroup) -> DecoderLayer:
        return DecoderLayer(config, Attention(config, layer_index, tp, qk_norm=True), dense_mlp(config, tp))


class Qwen3MoeForCausalLM(DecoderForCausalLM):
    checkpoint_names = (CheckpointName(r"mlp\.gate\.", "mlp.router."),) + SEPARATE_PROJECTIONS

    def make_layer(self, config: ModelConfig, layer_index: int, tp: TensorParallelGroup) -> DecoderLayer:
        attention = Attention(config, layer_index, tp, qk_norm=True)
        return DecoderLayer(config, attention, moe_or_dense_mlp(config, layer_index, tp))
