"""Llama-family decoder over a paged KV cache: Llama, Mistral, Qwen2 (q/k/v biases).

Like nanoGPT's model.py in spirit, but the batch is flat: [num_tokens, ...]
with no batch dimension and no padding. Attention reads and writes the paged
cache through an attention backend, so the same module runs the torch path on
the CPU and Triton kernels on a GPU.

With tensor parallelism (`tp`, engine.distributed) each rank builds the same
module with its share of the heads, the intermediate size and the vocabulary;
at TP = 1 (`NO_TP`) every layer is the plain one.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.attention.metadata import AttentionMetadata
from engine.distributed.parallel_layers import (
    num_local_kv_heads, row_parallel_linear, shard_checkpoint_tensor, vocab_parallel_embedding,
)
from engine.distributed.parallel_state import NO_TP, TensorParallelGroup
from engine.models.config import ModelConfig
from engine.models.layers import RMSNorm, RotaryEmbedding, SwiGLUMLP, apply_rotary


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int, tp: TensorParallelGroup = NO_TP) -> None:
        super().__init__()
        self.layer_index = layer_index  # which KV cache is ours, for the compiled path's attention op
        self.num_heads = config.num_heads // tp.size  # this rank's heads
        self.num_kv_heads = num_local_kv_heads(config.num_kv_heads, tp.size)
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * config.head_dim
        self.kv_size = self.num_kv_heads * config.head_dim
        self.scale = config.head_dim**-0.5
        # q, k and v in one matmul; the loader concatenates the three weights (column-parallel: this rank's heads).
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = row_parallel_linear(self.q_size, config.hidden_size, tp)

    fused = None  # engine.models.fused.CpuFusedOps, when the eager CPU path uses the C++ kernels

    def forward(self, cos_sin, hidden, kv_cache, metadata, backend, output_rows=None) -> torch.Tensor:
        """[num_tokens, hidden_size] -> the attention block's output for every row, or for
        `output_rows` only (every row's K and V still reach the cache)."""
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)  # [num_tokens, q_size + 2 * kv_size]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # [num_tokens, num_kv_heads, head_dim]
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if backend is None:  # compiled (engine.compilation): the step's cache and backend reach the op another way
            q, k = apply_rotary(q.view(num_tokens, self.num_heads, self.head_dim), k, cos_sin)
            out = torch.ops.tokenloom.paged_attention(q, k.contiguous(), v.contiguous(), self.layer_index, self.scale)
            return self.o_proj(_rows(out.reshape(num_tokens, self.q_size), output_rows))
        k_cache, v_cache = kv_cache
        if self.fused is not None:
            # Rotary and the KV store in one pass; k is rotated in place inside qkv.
            q = self.fused.rotary_store_kv(
                qkv, cos_sin, metadata.slot_mapping, k_cache, v_cache, self.num_heads, self.num_kv_heads
            )  # [num_tokens, num_heads, head_dim]
        else:
            q, k = apply_rotary(q.view(num_tokens, self.num_heads, self.head_dim), k, cos_sin)
            backend.store_kv(k, v, k_cache, v_cache, metadata.slot_mapping)
        out = backend.forward(q, k_cache, v_cache, metadata, self.scale, k, v)  # [num_tokens, num_heads, head_dim]
        return self.o_proj(_rows(out.reshape(num_tokens, self.q_size), output_rows))  # [num_out, hidden_size]


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int, tp: TensorParallelGroup = NO_TP) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_index, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SwiGLUMLP(config.hidden_size, config.intermediate_size // tp.size,
                             down_proj=row_parallel_linear(config.intermediate_size // tp.size, config.hidden_size, tp))

    def forward(self, cos_sin, hidden, residual, kv_cache, metadata, backend,
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
        hidden = self.self_attn(cos_sin, hidden, kv_cache, metadata, backend, output_rows)
        hidden, residual = self.post_attention_layernorm(hidden, _rows(residual, output_rows))
        return self.mlp(hidden), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallelGroup = NO_TP) -> None:
        super().__init__()
        self.config = config
        self.tp = tp
        self.embed_tokens = vocab_parallel_embedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(config, i, tp) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )
        if config.tie_word_embeddings:
            self.lm_head = None  # logits reuse the embedding matrix
        else:
            # Vocab-parallel under TP: this rank's rows, as many as the embedding's.
            self.lm_head = nn.Linear(config.hidden_size, self.embed_tokens.weight.shape[0], bias=False)
        self.logits_head: nn.Module | None = None  # set by prepack_for_cpu

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None,
        metadata: AttentionMetadata | None,
        backend,  # None: compiled, attention through engine.compilation's op
        output_rows: torch.Tensor | None = None,  # [num_out] int64: the rows to return; None: all
    ) -> torch.Tensor:
        """[num_tokens] ids -> [num_tokens or num_out, hidden_size] final hidden states.
        Only the sampled rows' (a prompt's last) final states are ever used, so with
        `output_rows` the last layer runs its o_proj, MLP and post-attention norm on those
        rows alone: every row's K and V are in the cache by then. For a prompt that is 84%
        of a layer's matmuls left out, 2.8% of the model's."""
        hidden = self.embed_tokens(input_ids)  # [num_tokens, hidden_size]
        cos_sin = self.rotary.cos_sin(positions, hidden.dtype)
        residual = None
        last = len(self.layers) - 1
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches or [None] * len(self.layers))):
            rows = output_rows if i == last else None
            hidden, residual = layer(cos_sin, hidden, residual, kv_cache, metadata, backend, rows)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[num_sampled, vocab_size]; under TP, on rank 0 only (the others return None)."""
        if self.logits_head is not None:
            logits = self.logits_head(hidden)  # [num_sampled, vocab_size]
        else:
            weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
            logits = hidden @ weight.t()  # [num_sampled, vocab_size]
        if self.tp.size == 1:
            return logits
        logits = self.tp.gather_to_first(logits)  # [num_sampled, N * vocab_size / N] on rank 0
        return None if logits is None else logits[:, : self.config.vocab_size]

    def use_fused_ops(self, ops) -> None:
        """Run the element-wise work between the matmuls through `ops` (engine.models.fused.CpuFusedOps)."""
        for module in self.modules():
            if isinstance(module, (RMSNorm, SwiGLUMLP, Attention)):
                module.fused = ops

    def prepack_for_cpu(self, batch_size_hint: int, slabs=None) -> None:
        """Move every matmul, the logits' too, onto oneDNN-prepacked weights (and with
        `slabs`, an engine.models.cpu_packing.SlabPlan, onto bf16 slabs)."""
        from engine.distributed.parallel_layers import RowParallelLinear
        from engine.models.cpu_packing import PackedLinear, gather_slabs_on_huge_pages, prepack_linears

        prepack_linears(self, batch_size_hint, slabs)  # an untied lm_head among them
        for module in self.modules():
            if isinstance(module, RowParallelLinear):  # not nn.Linears: their all-reduce stays
                module.prepack(batch_size_hint, slabs)
        self.logits_head = self.lm_head or PackedLinear(self.embed_tokens.weight, None, batch_size_hint, slabs)
        self.logits_head.out_fp32 = True
        if slabs is not None:
            gather_slabs_on_huge_pages(self)

    def load_weights(self, weights) -> None:
        """Copy Hugging Face-named tensors in, merging q/k/v and gate/up as they arrive.
        Under TP each rank keeps its shard (the tensors may be safetensors slices)."""
        params = dict(self.named_parameters())
        q, kv = self.layers[0].self_attn.q_size, self.layers[0].self_attn.kv_size
        inter = self.config.intermediate_size // self.tp.size
        # HF name fragment -> (our fragment, row offset in the merged weight)
        merged = {
            "self_attn.q_proj": ("self_attn.qkv_proj", 0),
            "self_attn.k_proj": ("self_attn.qkv_proj", q),
            "self_attn.v_proj": ("self_attn.qkv_proj", q + kv),
            "mlp.gate_proj": ("mlp.gate_up_proj", 0),
            "mlp.up_proj": ("mlp.gate_up_proj", inter),
        }
        loaded = set()
        for hf_name, tensor in weights:
            name = hf_name.removeprefix("model.")
            if "rotary_emb" in name or (name == "lm_head.weight" and self.lm_head is None):
                continue
            offset = None
            for src, (dst, row) in merged.items():
                if src in name:
                    name, offset = name.replace(src, dst), row
                    break
            if name not in params:
                raise KeyError(f"unexpected weight {hf_name!r}")
            param = params[name]
            if self.tp.size > 1:
                tensor = shard_checkpoint_tensor(hf_name, tensor, self.config, self.tp)
            with torch.no_grad():
                if offset is None:
                    param.copy_(tensor)
                else:
                    param[offset : offset + tensor.shape[0]].copy_(tensor)
            loaded.add(name)
        missing = set(params) - loaded
        if missing:
            raise ValueError(f"weights missing from the checkpoint: {sorted(missing)[:5]}")


def _rows(x: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    return x if rows is None else x[rows]


class MistralForCausalLM(LlamaForCausalLM):
    """Same decoder as Llama; Mistral-7B-v0.2 and later use no sliding window."""


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Llama with q/k/v biases (ModelConfig.attention_bias is on for Qwen2)."""
