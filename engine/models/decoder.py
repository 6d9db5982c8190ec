"""The decoder every family composes: embeddings, layers of (norm, attention, norm, MLP or
MoE), a final norm and the LM head, over a paged KV cache; and the checkpoint loader.

Like nanoGPT's model.py in spirit, but the batch is flat: [num_tokens, ...] with no
batch dimension and no padding. Attention reads and writes the paged cache through an
attention backend, so the same module runs the torch path on the CPU and Triton kernels
on a GPU. A family (llama.py, qwen3.py, phi3.py, mixtral.py) says how to build its
attention and MLP and how its checkpoint names map onto these modules; the CPU fast
paths are applied from outside (engine/cpu/fast_paths.py), to whatever blocks it has.

With tensor parallelism (`tp`, engine.parallel) each rank builds the same module with
its share of the heads, the intermediate size and the vocabulary; at TP = 1 (`NO_TP`)
every layer is the plain one. Under pipeline parallelism (`tp.stage`,
engine.parallel.pipeline) a rank builds, loads and runs only its stage's layers; the
others are `MissingLayer`s.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from engine.attention.backend import AttentionBackend
from engine.attention.metadata import NO_WINDOW
from engine.parallel.parallel_layers import (
    num_local_kv_heads, row_parallel_linear, shard_checkpoint_tensor, shard_rows, vocab_parallel_embedding,
)
from engine.parallel.parallel_state import NO_TP, TensorParallelGroup
from engine.models.attention import Attention, take_rows
from engine.models.config import ModelConfig
from engine.models.layers import RMSNorm, SwiGLUMLP
from engine.models.moe import MoEBlock
from engine.models.rotary import make_rotary


@dataclass(frozen=True)
class CheckpointName:
    """How a checkpoint tensor's name (without "model.") becomes one of our parameters'."""

    pattern: str  # a regex, replaced by `ours` (re.sub, so groups like an expert's number carry over)
    ours: str
    # The row blocks the tensor holds, in order ("q", "k", "v", "gate", "up"), each written to its
    # place in our merged weight and sharded on its own under TP. (): the tensor is one whole
    # parameter, sharded by its name (engine.parallel.parallel_layers.shard_checkpoint_tensor).
    parts: tuple[str, ...] = ()


def dense_mlp(config: ModelConfig, tp: TensorParallelGroup, intermediate_size: int | None = None) -> SwiGLUMLP:
    local = (intermediate_size or config.intermediate_size) // tp.size
    return SwiGLUMLP(config.hidden_size, local, down_proj=row_parallel_linear(local, config.hidden_size, tp),
                     activation=config.activation)


def moe_or_dense_mlp(config: ModelConfig, layer_index: int, tp: TensorParallelGroup) -> nn.Module:
    if config.moe is not None and config.moe.is_moe_layer(layer_index):
        return MoEBlock(config.hidden_size, config.moe, tp)
    return dense_mlp(config, tp)


class MissingLayer(nn.Module):
    """A layer another pipeline stage holds: no weights here, never run here."""


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, attention: Attention, mlp: nn.Module) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = attention
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = mlp  # SwiGLUMLP or MoEBlock: [num_tokens, hidden_size] -> the same

    def forward(self, cos_sin, hidden, residual, kv_cache, backend,
                output_rows=None) -> tuple[torch.Tensor, torch.Tensor]:
        """vLLM's layout: the residual stream travels beside the hidden state, and each
        residual add happens inside the next norm (one fused pass on the CPU). Returns
        (the MLP's output, the residual stream before it is added), for `output_rows` only
        when given: the rows past attention are then those alone."""
        if residual is None:  # the first layer: the embeddings are the residual stream
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(cos_sin, hidden, kv_cache, backend, output_rows)
        hidden, residual = self.post_attention_layernorm(hidden, take_rows(residual, output_rows))
        return self.mlp(hidden), residual


class DecoderForCausalLM(nn.Module):
    """The base of every family. A family sets `checkpoint_names` and, when it differs from
    the plain layer (GQA attention, dense SwiGLU MLP), overrides `make_layer`."""

    checkpoint_names: tuple[CheckpointName, ...] = ()

    def __init__(self, config: ModelConfig, tp: TensorParallelGroup = NO_TP) -> None:
        super().__init__()
        self.config = config
        self.tp = tp
        self.embed_tokens = vocab_parallel_embedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(self.make_layer(config, i, tp) if tp.stage.holds(i, config.num_layers)
                                    else MissingLayer() for i in range(config.num_layers))
        self.stage_layers = tp.stage.layers(config.num_layers)  # this pipeline stage's, fixed from here on
        self.is_last_stage = tp.stage.is_last
        self.norm = self.make_norm(config)
        self.rotary = make_rotary(config)
        # The sliding-window layers' own rotary where the config gives one (Gemma 3); None: the same.
        self.local_rotary = make_rotary(config, local=True) if config.local_rope_theta is not None else None
        # Vocab-parallel under TP: this rank's rows, as many as the embedding's.
        self.lm_head = nn.Linear(config.hidden_size, self.embed_tokens.weight.shape[0], bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight  # one parameter, listed once (as embed_tokens.weight)
        self.attention_dtype: torch.dtype | None = None  # set_attention_dtype's

    def make_layer(self, config: ModelConfig, layer_index: int, tp: TensorParallelGroup) -> DecoderLayer:
        return DecoderLayer(config, Attention(config, layer_index, tp), dense_mlp(config, tp))

    def make_norm(self, config: ModelConfig) -> nn.Module:
        """The final norm."""
        return RMSNorm(config.hidden_size, config.rms_norm_eps)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)  # [num_tokens, hidden_size]

    def set_attention_dtype(self, dtype: torch.dtype | None) -> None:
        """Rotary, the KV store and attention in `dtype`, the KV cache's, between matmuls in the
        model's own dtype; None: all in the model's dtype (engine.models.attention)."""
        self.attention_dtype = dtype
        for layer in self.layers:
            if isinstance(layer, MissingLayer):
                continue
            attn = layer.self_attn
            attn.attention_dtype = dtype
            for norm in (attn.q_norm, attn.k_norm):  # they norm heads in attention's dtype, as a bf16 model's do
                if norm is not None and dtype is not None:
                    norm.to(dtype)

    def build_rotary(self, device: torch.device) -> None:
        """(Re)build the rotary tables in fp32 on `device` (after loading and casting the weights)."""
        self.rotary = make_rotary(self.config, device)
        if self.local_rotary is not None:
            self.local_rotary = make_rotary(self.config, device, local=True)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None,
        backend: AttentionBackend | None,  # prepared for the step; COMPILED (None): engine.worker.compilation's op
        output_rows: torch.Tensor | None = None,  # [num_out] int64: the rows to return; None: all
        carried: tuple[torch.Tensor, torch.Tensor] | None = None,  # (hidden, residual) from the previous stage
        inputs_embeds: torch.Tensor | None = None,  # [num_tokens, hidden]: in place of embed(input_ids) (images)
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """[num_tokens] ids -> [num_tokens or num_out, hidden_size] final hidden states.
        Only the sampled rows' (a prompt's last) final states are ever used, so with
        `output_rows` the last layer runs its o_proj, MLP and post-attention norm on those
        rows alone: every row's K and V are in the cache by then. For a prompt that is 84%
        of a layer's matmuls left out, 2.8% of the model's.
        A pipeline stage runs its own layers, from `carried` past the first stage; every stage
        but the last returns (hidden, residual) [num_tokens, hidden_size] each, for the next."""
        if carried is None:
            carried = (self.embed(input_ids) if inputs_embeds is None else inputs_embeds, None)
        hidden, residual = carried  # [num_tokens, hidden]
        angle_dtype = self.attention_dtype or hidden.dtype  # rotary runs in attention's dtype
        cos_sin = self.rotary.cos_sin(positions, angle_dtype)
        local_cos_sin = cos_sin if self.local_rotary is None else self.local_rotary.cos_sin(positions, angle_dtype)
        last = len(self.layers) - 1
        for i in self.stage_layers:
            layer, kv_cache = self.layers[i], kv_caches[i] if kv_caches else None
            rows = output_rows if i == last else None
            angles = cos_sin if layer.self_attn.sliding_window == NO_WINDOW else local_cos_sin
            hidden, residual = layer(angles, hidden, residual, kv_cache, backend, rows)
        if not self.is_last_stage:
            return hidden, residual
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[num_sampled, vocab_size]; under TP, on rank 0 only (the others return None)."""
        logits = self.lm_head(hidden)  # [num_sampled, vocab_size / N]
        if self.tp.size > 1:
            logits = self.tp.gather_to_first(logits)  # [num_sampled, N * vocab_size / N] on rank 0
            if logits is None:
                return None
            logits = logits[:, : self.config.vocab_size]
        cap = self.config.final_logit_softcapping
        if cap:  # element-wise, so capping this rank's rows or the gathered ones is the same
            logits = torch.tanh(logits / cap) * cap
        return logits

    def load_weights(self, weights, into: dict[str, torch.Tensor] | None = None) -> set[str]:
        """Copy Hugging Face-named tensors in, each renamed by `checkpoint_names` and its parts
        written to their rows of our merged weights. Under TP each rank keeps its shard (the
        tensors may be safetensors slices). `into`: write into these tensors, by our parameter
        name, instead (row by row, any dtype and width: a GGUF's blocks, engine/loader/gguf_blocks.py),
        skipping the names it lacks; at TP = 1 only. Returns the names (ours) it wrote."""
        params = dict(self.decoder_parameters()) if into is None else into
        if into is not None and self.tp.size != 1:
            raise ValueError("loading into other tensors is for TP = 1")
        rules = [(re.compile(rule.pattern), rule) for rule in self.checkpoint_names]
        loaded = set()
        for hf_name, tensor in weights:
            name = hf_name.removeprefix("model.")
            if "rotary_emb" in name or (name == "lm_head.weight" and self.config.tie_word_embeddings):
                continue
            parts: tuple[str, ...] = ()
            for pattern, rule in rules:
                if pattern.search(name):
                    name, parts = pattern.sub(rule.ours, name, count=1), rule.parts
                    break
            if name not in params:
                if into is not None or self._is_elsewhere(name):
                    continue
                raise KeyError(f"unexpected weight {hf_name!r}")
            param = params[name]
            with torch.no_grad():
                if not parts:
                    # tensor may be a safetensors slice (under TP or PP): [:] reads it
                    whole = self.tp.size == 1
                    param.copy_(tensor[:] if whole else shard_checkpoint_tensor(name, tensor, self.config, self.tp))
                else:
                    self._load_parts(param, tensor, parts)
            loaded.add(name)
        missing = set(params) - loaded
        if missing == {"lm_head.weight"} and into is None:
            raise ValueError("the checkpoint has no LM head (lm_head.weight), as an embedding-only export has; "
                             "tokenloom serves decoders with their LM head and pools their hidden states itself "
                             "(--runner pooling)")
        if missing and into is None:
            raise ValueError(f"weights missing from the checkpoint: {sorted(missing)[:5]}")
        return loaded

    def decoder_parameters(self):
        """(name, parameter) of what load_weights loads: all of them (a vision model's encoder loads apart)."""
        return self.named_parameters()

    def _is_elsewhere(self, name: str) -> bool:
        """Whether `name` (ours) is a weight of a layer another pipeline stage holds."""
        match = re.match(r"layers\.(\d+)\.", name)
        return match is not None and not self.tp.stage.holds(int(match.group(1)), len(self.layers))

    def _load_parts(self, param: torch.Tensor, tensor, parts: tuple[str, ...]) -> None:
        """Each part's rows of `tensor` (this rank's share) into its place in `param`
        (q, k, v in qkv_proj; gate, up in gate_up_proj)."""
        config, tp = self.config, self.tp
        num_rows = list(tensor.shape)[0] if isinstance(tensor, torch.Tensor) else tensor.get_shape()[0]
        full = {"q": config.num_heads * config.head_dim, "k": config.num_kv_heads * config.head_dim}
        full["v"] = full["k"]
        local_q = config.num_heads // tp.size * config.head_dim
        local_kv = num_local_kv_heads(config.num_kv_heads, tp.size) * config.head_dim
        place = {"q": 0, "k": local_q, "v": local_q + local_kv, "gate": 0, "up": param.shape[0] // 2}
        start = 0
        for part in parts:
            part_rows = full.get(part, num_rows // len(parts))  # gate and up: equal halves
            rows = shard_rows(part, tensor, start, part_rows, config, tp)
            param[place[part] : place[part] + rows.shape[0]].copy_(rows)
            start += part_rows
