"""The model facts the engine needs, read from a Hugging Face folder's config.json.

Read from the JSON itself rather than through transformers' config classes, so
both the older layout (`rope_theta`, `rope_scaling`) and the newer one
(`rope_parameters`, per layer type for Gemma 3) load the same way.

Sliding windows are per layer (`layer_windows`): from `layer_types` where the config
lists them (Gemma 3, Qwen2/3 as transformers 5 writes them), from Gemma 3's
`sliding_window_pattern` or Qwen's `max_window_layers` in older configs, else on every
layer when `sliding_window` is set (Mistral, Mixtral, Phi-3), as transformers applies it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from engine.models.vision_config import VisionConfig, split_vision_config

# The MLP gates served (config.json's name -> ours); another activation is refused, not run wrong.
SUPPORTED_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
GEMMA3_DEFAULT_PATTERN = 6  # Gemma 3: five sliding-window layers to each global one


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
    sliding_window: int | None = None  # the window's size, where some layer has one
    # Each layer's window (0: full attention); () when no layer has one.
    layer_windows: tuple[int, ...] = ()
    eos_token_ids: list[int] = field(default_factory=list)
    # Rotary on the first partial_rotary_factor of each head (Phi-4-mini: 0.75), the rest passed through.
    partial_rotary_factor: float = 1.0
    # The pretraining context that longrope scaling extends (Phi-3/4's original_max_position_embeddings).
    original_max_position_embeddings: int | None = None
    moe: MoEConfig | None = None
    activation: str = "silu"  # the MLP's gate: "silu" (SwiGLU) or "gelu_tanh" (GeGLU, Gemma)
    # Attention scale query_pre_attn_scalar ** -0.5 (Gemma 3); None: head_dim ** -0.5.
    query_pre_attn_scalar: float | None = None
    # Rotary of the sliding-window layers, where it differs from the global layers' (Gemma 3: base
    # 10k locally, 1M globally, and the global layers alone take rope_scaling); None: the same.
    local_rope_theta: float | None = None
    local_rope_scaling: dict | None = None
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap)
    vision: VisionConfig | None = None  # a vision-language model's encoder and connector (vision_config.py)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def window_of(self, layer_index: int) -> int:
        """Layer `layer_index`'s sliding window, 0 (engine.attention.metadata.NO_WINDOW) for full attention."""
        return self.layer_windows[layer_index] if self.layer_windows else 0

    @classmethod
    def from_folder(cls, path: str) -> "ModelConfig":
        with open(os.path.join(path, "config.json")) as f:
            cfg = json.load(f)
        cfg, vision = split_vision_config(cfg)
        architectures = cfg.get("architectures") or ["LlamaForCausalLM"]
        _refuse_unsupported(architectures[0], cfg)
        num_heads = cfg["num_attention_heads"]
        rope = cfg.get("rope_parameters") or {}
        local_rope: dict | None = None
        if "full_attention" in rope:  # per layer type (Gemma 3 as transformers 5 writes it)
            rope, local_rope = rope["full_attention"] or {}, rope.get("sliding_attention") or {}
        elif "rope_local_base_freq" in cfg:  # Gemma 3's older layout
            local_rope = {"rope_theta": cfg["rope_local_base_freq"]}
        rope_scaling = _scaling(cfg.get("rope_scaling") or rope)
        # Gemma 3 gates with hidden_activation (its hidden_act, where present, is not what transformers runs).
        activation = cfg.get("hidden_activation") or cfg.get("hidden_act", "silu")
        if activation not in SUPPORTED_ACTIVATIONS:
            raise ValueError(f"{architectures[0]} with hidden_act {activation!r} is not supported "
                             f"(supported: {', '.join(SUPPORTED_ACTIVATIONS)})")
        layer_windows, sliding_window = _read_layer_windows(cfg)
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
            sliding_window=sliding_window,
            layer_windows=layer_windows,
            eos_token_ids=_read_eos_token_ids(path, cfg),
            partial_rotary_factor=float(cfg.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0))),
            original_max_position_embeddings=original_max,
            moe=_read_moe(architectures[0], cfg),
            activation=SUPPORTED_ACTIVATIONS[activation],
            query_pre_attn_scalar=cfg.get("query_pre_attn_scalar"),
            local_rope_theta=None if local_rope is None else float(local_rope.get("rope_theta", 10000.0)),
            local_rope_scaling=None if local_rope is None else _scaling(local_rope),
            final_logit_softcapping=cfg.get("final_logit_softcapping"),
            vision=vision,
        )


def _scaling(rope: dict) -> dict | None:
    """A rope_scaling / rope_parameters dict, None where it scales nothing (type "default")."""
    if not rope or rope.get("rope_type", rope.get("type")) in (None, "default"):
        return None
    return rope


# Embedding checkpoints: a base model without its LM head, or a task head that is no language model.
EMBEDDING_ARCHITECTURE_SUFFIXES = ("Model", "ForEmbedding", "ForMaskedLM", "ForSequenceClassification",
                                   "ForTokenClassification")
ENCODER_MODEL_TYPES = ("bert", "roberta", "xlm-roberta", "nomic_bert", "distilbert", "modernbert")


def _refuse_unsupported(architecture: str, cfg: dict) -> None:
    """What no kernel here computes is refused, not run wrong."""
    if architecture.endswith(EMBEDDING_ARCHITECTURE_SUFFIXES) or cfg.get("model_type") in ENCODER_MODEL_TYPES:
        raise ValueError(
            f"{architecture} is an embedding (encoder or headless) architecture, which tokenloom does not serve: it "
            "runs decoder language models (...ForCausalLM, docs/models.md) and makes embeddings from their final "
            "hidden states (--runner pooling, /v1/embeddings, LLM.embed). A BERT-style encoder attends both ways "
            "and our kernels are causal only; for a decoder exported without its LM head, serve the folder's "
            "...ForCausalLM checkpoint instead")
    if cfg.get("attn_logit_softcapping"):
        raise ValueError(f"{architecture} with attn_logit_softcapping is not supported (the attention kernels "
                         "do not cap scores)")
    if cfg.get("use_bidirectional_attention"):
        raise ValueError(f"{architecture} with use_bidirectional_attention is not supported (causal attention only)")


def _read_layer_windows(cfg: dict) -> tuple[tuple[int, ...], int | None]:
    """(each layer's sliding window, 0 for full attention; the window's size), or ((), None)
    when no layer has a window."""
    window = cfg.get("sliding_window")
    num_layers = cfg["num_hidden_layers"]
    if not window or not cfg.get("use_sliding_window", True):
        return (), None
    layer_types = cfg.get("layer_types")
    if layer_types is None and cfg.get("model_type") == "gemma3_text":
        pattern = cfg.get("sliding_window_pattern") or GEMMA3_DEFAULT_PATTERN
        layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
    if layer_types is None and "max_window_layers" in cfg and "use_sliding_window" in cfg:  # Qwen2/3's older layout
        layer_types = ["sliding_attention" if i >= cfg["max_window_layers"] else "full_attention"
                       for i in range(num_layers)]
    if layer_types is None:  # Mistral, Mixtral, Phi-3: every layer
        return (window,) * num_layers, window
    if len(layer_types) != num_layers:
        raise ValueError(f"layer_types lists {len(layer_types)} layers, num_hidden_layers is {num_layers}")
    windows = tuple(window if kind == "sliding_attention" else 0 for kind in layer_types)
    return (windows, window) if any(windows) else ((), None)


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
