"""Mixtral: Mistral's attention with the MoE block in every layer (top-2 of 8 experts in
Mixtral-8x7B, the router's top-k probabilities always renormalised)."""

from __future__ import annotations

from engine.parallel.parallel_state import TensorParallelGroup
from engine.models.attention import Attention
from engine.models.config import ModelConfig
from engine.models.decoder import CheckpointName, DecoderForCausalLM, DecoderLayer
from engine.models.llama import SEPARATE_PROJECTIONS
from engine.models.moe import MoEBlock


class MixtralForCausalLM(DecoderForCausalLM):
    # Experts' w1 (gate), w3 (up) and w2 (down); the router is block_sparse_moe.gate.
    checkpoint_names = SEPARATE_PROJECTIONS[:3] + (
        CheckpointName(r"block_sparse_moe\.gate\.", "mlp.router."),
        CheckpointName(r"block_sparse_moe\.experts\.(\d+)\.w1\.", r"mlp.experts.\1.gate_up_proj.", ("gate",)),
        CheckpointName(r"block_sparse_moe\.experts\.(\d+)\.w3\.", r"mlp.experts.\1.gate_up_proj.", ("up",)),
        CheckpointName(r"block_sparse_moe\.experts\.(\d+)\.w2\.", r"mlp.experts.\1.down_proj."),
    )

    def make_layer(self, config: ModelConfig, layer_index: int, tp: TensorParallelGroup) -> DecoderLayer:
        return DecoderLayer(config, Attention(config, layer_index, tp), MoEBlock(config.hidden_size, config.moe, tp))
