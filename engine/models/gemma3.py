"""Gemma 3 (text; Gemma3ForCausalLM, config model_type "gemma3_text"): Llama's attention and
gated MLP with Gemma's differences, each a shared block or a config field:

- every norm is the (1 + w) RMSNorm (layers.OffsetRMSNorm), the q/k norms too;
- four norms per layer: the attention's and the MLP's outputs are normed before their
  residual adds (post_attention_layernorm, post_feedforward_layernorm);
- the embeddings are scaled by sqrt(hidden_size), rounded to the model's dtype first as
  transformers does (in bf16 sqrt(1152) = 33.94 becomes 34.0);
- the MLP gates with GELU-tanh (GeGLU), the attention scale is query_pre_attn_scalar ** -0.5;
- five sliding-window layers to each global one (config.layer_windows), the local ones on
  their own rotary base (10k; the global layers 1M, and they alone take rope_scaling);
- final_logit_softcapping where the config sets it (decoder.compute_logits); a config with
  attn_logit_softcapping is refused (engine/models/config.py).

No fused CPU kernel computes the (1 + w) norm or GELU-tanh, so those run the torch ops
(engine/cpu/fast_paths.py logs it), as do rotary and the KV store (the q/k norm comes first).

Reference: transformers' models/gemma3/modeling_gemma3.py.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.parallel.parallel_state import TensorParallelGroup
from engine.models.attention import Attention, take_rows
from engine.models.config import ModelConfig
from engine.models.decoder import DecoderForCausalLM, dense_mlp
from engine.models.layers import OffsetRMSNorm
from engine.models.llama import SEPARATE_PROJECTIONS


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int, tp: TensorParallelGroup) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = OffsetRMSNorm(hidden, eps)
        self.self_attn = Attention(config, layer_index, tp, qk_norm=True, norm=OffsetRMSNorm)
        self.post_attention_layernorm = OffsetRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = OffsetRMSNorm(hidden, eps)
        self.mlp = dense_mlp(config, tp)  # GELU-tanh gate (config.activation)
        self.post_feedforward_layernorm = OffsetRMSNorm(hidden, eps)

    def forward(self, cos_sin, hidden, residual, kv_cache, backend,
                output_rows=None) -> tuple[torch.Tensor, torch.Tensor]:
        """DecoderLayer's contract: returns (the normed MLP output, the residual stream before
        it is added); the next layer's input norm (or the final norm) adds them."""
        if residual is None:  # the first layer: the scaled embeddings are the residual stream
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(cos_sin, hidden, kv_cache, backend, output_rows)
        hidden = self.post_attention_layernorm(hidden)  # before the residual add
        hidden, residual = self.pre_feedforward_layernorm(hidden, take_rows(residual, output_rows))
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class Gemma3ForCausalLM(DecoderForCausalLM):
    checkpoint_names = SEPARATE_PROJECTIONS

    def make_layer(self, config: ModelConfig, layer_index: int, tp: TensorParallelGroup) -> Gemma3DecoderLayer:
        return Gemma3DecoderLayer(config, layer_index, tp)

    def make_norm(self, config: ModelConfig) -> nn.Module:
        return OffsetRMSNorm(config.hidden_size, config.rms_norm_eps)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)  # [num_tokens, hidden_size]
        return hidden * torch.tensor(self.config.hidden_size**0.5, dtype=hidden.dtype)
