"""What a model costs per step, from its config.json alone: weight bytes, matmul and
attention FLOPs, KV bytes per token. No weights are loaded.

Counts follow the usual accounting (Kaplan et al. 2020, "Scaling Laws", Table 1; the
vLLM/SGLang roofline notes): a matmul of an [n, k] input by a [k, m] weight is 2·n·k·m
FLOPs; attention is 2·d FLOPs for a query-key score and 2·d for weighting a value, per
head and per (query, key) pair; norms, rotary and SiLU are left out (a few percent).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

ELEMENT_SIZES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class ModelCost:
    weight_bytes: int  # every weight read once per step
    body_flops_per_token: float  # the decoder layers' matmuls, per token
    head_flops_per_token: float  # the logits matmul, per sampled token


def model_cost(hidden: int, intermediate: int, num_layers: int, num_heads: int, num_kv_heads: int,
               head_dim: int, vocab_size: int, tied_embeddings: bool, element_size: int) -> ModelCost:
    per_layer = hidden * (num_heads + 2 * num_kv_heads) * head_dim + num_heads * head_dim * hidden + 3 * hidden * intermediate
    embedding = vocab_size * hidden
    num_params = num_layers * per_layer + embedding * (1 if tied_embeddings else 2)
    return ModelCost(num_params * element_size, 2.0 * num_layers * per_layer, 2.0 * embedding)


@dataclass(frozen=True)
class ModelShape:
    name: str
    dtype: str
    cost: ModelCost
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    sliding_window: int | None
    eos_token_ids: tuple[int, ...]

    @property
    def element_size(self) -> int:
        return ELEMENT_SIZES[self.dtype]

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token in every layer (as engine.worker.model_runner.kv_bytes_per_block, per token)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.element_size

    @property
    def attention_flops_per_pair(self) -> float:
        """One (query, key) pair in every layer and head: the score and the weighted value."""
        return 4.0 * self.num_layers * self.num_heads * self.head_dim

    @property
    def num_allreduces_per_step(self) -> int:
        """Tensor parallelism reduces the hidden state twice per layer (after attention and
        MLP) and once after the vocab-parallel embedding, as engine.parallel's layers do."""
        return 2 * self.num_layers + 1

    @property
    def allreduce_bytes_per_token(self) -> int:
        return self.num_allreduces_per_step * self.hidden_size * self.element_size

    @classmethod
    def from_config(cls, config, dtype: str, name: str = "") -> "ModelShape":
        """`config`: an engine.models.config.ModelConfig."""
        if dtype not in ELEMENT_SIZES:
            raise ValueError(f"dtype must be one of {sorted(ELEMENT_SIZES)}, got {dtype!r}")
        cost = model_cost(config.hidden_size, config.intermediate_size, config.num_layers, config.num_heads,
                          config.num_kv_heads, config.head_dim, config.vocab_size, config.tie_word_embeddings,
                          ELEMENT_SIZES[dtype])
        return cls(name or Path(config.path).name, dtype, cost, config.num_layers, config.hidden_size,
                   config.intermediate_size, config.num_heads, config.num_kv_heads, config.head_dim, config.vocab_size,
                   config.max_position_embeddings, config.sliding_window, tuple(config.eos_token_ids))


def load_model_shape(model: str, dtype: str) -> ModelShape:
    """`model`: a known model name (smollm2), a Hugging Face folder, or a config.json."""
    from engine.models.config import ModelConfig

    path = Path(model)
    if path.is_file():
        folder = path.parent
    elif path.is_dir():
        folder = path
    else:
        from engine.loader.model_files import resolve_model

        folder = Path(resolve_model(model))
    architecture = json.loads((folder / "config.json").read_text()).get("architectures", ["?"])[0]
    return ModelShape.from_config(ModelConfig.from_folder(str(folder)), dtype, name=f"{folder.name} ({architecture})")
