"""The model facts the engine needs, read from a Hugging Face folder's config.json.

Read from the JSON itself rather than through transformers' config classes, so
both the older layout (`rope_theta`, `rope_scaling`) and the newer one
(`rope_parameters`) load the same way.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

# Every family served here gates its MLP with SiLU; another activation is refused, not run wrong.
SUPPORTED_ACTIVATIONS = ("silu", "swish")


@dataclass(frozen=True)
class MoEConfig:
    """A mixture-of-experts MLP: each token runs `num_experts_per_tok` of `num_experts` SwiGLU experts."""

    num_experts: int
    num_experts_per_tok: int
    intermediate_size: int  # each expert's
    # Renormalise the top-k router probabilities to sum to 1 (Mixtral always; Qwen3-MoE per its config).
    norm_topk_prob: bool
    sparse_step: int = 1  # every sparse_step-th layer is MoE (Qwen3-MoE's decoder_sparse_step) ...
    dense_layers: tuple[int, ...] = ()  # ... except these, which keep the dense MLP (mlp_only_layers)

    def is_moe_layer(self, layer_index: int) -> bool:
        return layer_index not in self.dense_layers and (layer_index + 1) % self.sparse_step == 0


@dataclass
class ModelConfig:
    path: str
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    # Within the window, sliding-window attention equals full attention, so the
    # engine caps the context at the window instead of implementing it.
    sliding_window: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    # Rotary on the first partial_rotary_factor of each head (Phi-4-mini: 0.75), the rest passed through.
    partial_rotary_factor: float = 1.0
    # The pretraining context that longrope scaling extends (Phi-3/4's original_max_position_embeddings).
    original_max_position_embeddings: int | None = None
    moe: MoEConfig | None = None

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @classmethod
    def from_folder(cls, path: str) -> "ModelConfig":
        with open(os.path.join(path, "config.json")) as f:
            cfg = json.load(f)
        architectures = cfg.get("architectures") or ["LlamaForCausalLM"]
        num_heads = cfg["num_attention_heads"]
        rope = cfg.get("rope_parameters") or {}
        rope_scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) in (None, "default"):
            rope_scaling = None
        activation = cfg.get("hidden_act", "silu")
        if activation not in SUPPORTED_ACTIVATIONS:
            raise ValueError(f"{architectures[0]} with hidden_act {activation!r} is not supported (only SiLU-gated MLPs)")
        original_max = cfg.get("original_max_position_embeddings") or (rope_scaling or {}).get(
            "original_max_position_embeddings")
        return cls(
            path=path,
            architecture=architectures[0],
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(cfg.get("rope_theta", rope.get("rope_theta", 10000.0))),
            rope_scaling=rope_scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases; Llama-style configs say so explicitly.
            attention_bias=bool(cfg.get("attention_bias", architectures[0] == "Qwen2ForCausalLM")),
            sliding_window=cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None,
            eos_token_ids=_read_eos_token_ids(path, cfg),
            partial_rotary_factor=float(cfg.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0))),
            original_max_position_embeddings=original_max,
            moe=_read_moe(architectures[0], cfg),
        )


def _read_moe(architecture: str, cfg: dict) -> MoEConfig | None:
    num_experts = cfg.get("num_experts", cfg.get("num_local_experts"))  # Qwen3-MoE's name, Mixtral's
    if not num_experts:
        return None
    return MoEConfig(
        num_experts=num_experts,
        num_experts_per_tok=cfg["num_experts_per_tok"],
        # Qwen3-MoE sizes its experts apart from its (unused unless dense layers) intermediate_size.
        intermediate_size=cfg.get("moe_intermediate_size") or cfg["intermediate_size"],
        norm_topk_prob=architecture == "MixtralForCausalLM" or bool(cfg.get("norm_topk_prob", False)),
        sparse_step=cfg.get("decoder_sparse_step") or 1,
        dense_layers=tuple(cfg.get("mlp_only_layers") or ()),
    )


def _read_eos_token_ids(path: str, cfg: dict) -> list[int]:
    """EOS ids from config.json and generation_config.json (the latter often lists more)."""
    ids: list[int] = []
    sources = [cfg]
    gen_path = os.path.join(path, "generation_config.json")
    if os.path.exists(gen_path):
        with open(gen_path) as f:
            sources.append(json.load(f))
    for source in sources:
        eos = source.get("eos_token_id")
        for token_id in eos if isinstance(eos, list) else [eos]:
            if isinstance(token_id, int) and token_id not in ids:
                ids.append(token_id)
    return ids
