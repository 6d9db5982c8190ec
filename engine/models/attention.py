"""Grouped-query attention over the paged KV cache, shared by every family: q, k and v
in one matmul (optional bias), optional per-head q/k RMSNorm before rotary (Qwen3; Gemma 3's
(1 + w) norm), full or partial rotary, then the attention backend and o_proj. A layer with
a sliding window (config.window_of) hands it to the backend, which reads only the blocks
inside it; the scale is head_dim ** -0.5 unless the config sets query_pre_attn_scalar.
Where the KV cache has a dtype other than the activations' (bf16 beside int8 weights'
fp32 activations: engine.worker.dtype_policy), qkv is cast to it after its matmul and attention's
output back before o_proj: rotary, the KV store and attention run in the cache's dtype.

Three ways through, chosen by what the engine handed the module; in each, the backend
is the KV cache's one writer:

- compiled (engine.worker.compilation calls the model with `backend=None`, COMPILED): plain
  torch ops for inductor to fuse, attention (the KV store with it) as the opaque op
  `tokenloom::paged_attention`;
- eager with rotary fused into the KV store (`is_rotary_fused`, set by
  engine/cpu/fast_paths.py where it applies: full rotary, and q/k norm if any an
  RMSNorm, written back into qkv first): the backend's rotary_store_kv, one C++ pass;
- otherwise the torch ops, then the backend's store_kv: the reference, and the path for
  Gemma's (1 + w) q/k norm and partial rotary, which the fused kernel cannot apply.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.parallel.parallel_layers import num_local_kv_heads, row_parallel_linear
from engine.parallel.parallel_state import NO_TP, TensorParallelGroup
from engine.models.config import ModelConfig
from engine.models.layers import RMSNorm
from engine.models.rotary import apply_rotary

COMPILED = None  # the `backend` engine.worker.compilation passes: the step's cache and backend reach its op another way


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int, tp: TensorParallelGroup = NO_TP, *,
                 qk_norm: bool = False, norm: type[nn.Module] = RMSNorm) -> None:
        super().__init__()
        self.layer_index = layer_index  # which KV cache is ours, for the compiled path's attention op
        self.sliding_window = config.window_of(layer_index)  # NO_WINDOW (0): the whole context
        self.num_heads = config.num_heads // tp.size  # this rank's heads
        self.num_kv_heads = num_local_kv_heads(config.num_kv_heads, tp.size)
        self.head_dim = config.head_dim
        self.rotary_dim = config.rotary_dim
        self.q_size = self.num_heads * config.head_dim
        self.kv_size = self.num_kv_heads * config.head_dim
        self.scale = (config.query_pre_attn_scalar or config.head_dim) ** -0.5
        # q, k and v in one matmul; the loader fills the three parts (column-parallel: this rank's heads).
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        # One weight over head_dim, shared by every head (and every rank).
        self.q_norm = norm(config.head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = norm(config.head_dim, config.rms_norm_eps) if qk_norm else None
        self.o_proj = row_parallel_linear(self.q_size, config.hidden_size, tp)
        # Rotary inside the backend's KV store (rotary_store_kv): set by engine.cpu.fast_paths where it applies.
        self.is_rotary_fused = False
        # The KV cache's dtype where it is not the activations' (DecoderForCausalLM.set_attention_dtype); None: theirs.
        self.attention_dtype: torch.dtype | None = None

    @property
    def why_rotary_not_fused(self) -> str | None:
        """None if the fused rotary + KV store kernel computes this layer's rotary; else why not."""
        if self.q_norm is not None and not isinstance(self.q_norm, RMSNorm):
            return "q/k norm other than RMSNorm before rotary"
        if self.rotary_dim != self.head_dim:
            return "partial rotary"
        return None

    def forward(self, cos_sin, hidden, kv_cache, backend, output_rows=None) -> torch.Tensor:
        """[num_tokens, hidden_size] -> the attention block's output for every row, or for
        `output_rows` only (every row's K and V still reach the cache). `backend` has been
        prepared for the step by the model runner."""
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)  # [num_tokens, q_size + 2 * kv_size]
        if self.attention_dtype is not None:
            qkv = qkv.to(self.attention_dtype)
        if self.is_rotary_fused and backend is not COMPILED:
            # Rotary and the KV store in one pass; k is rotated in place inside qkv.
            if self.q_norm is not None:
                self._norm_qk_in_place(qkv)
            q = backend.rotary_store_kv(qkv, cos_sin, kv_cache, self.num_heads,
                                        self.num_kv_heads)  # [num_tokens, num_heads, head_dim]
            k, v = self._split_kv(qkv)
        else:
            q = qkv[:, : self.q_size].view(num_tokens, self.num_heads, self.head_dim)
            k, v = self._split_kv(qkv)  # [num_tokens, num_kv_heads, head_dim] each
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = apply_rotary(q, k, cos_sin)
            if backend is COMPILED:
                out = torch.ops.tokenloom.paged_attention(q.contiguous(), k.contiguous(), v.contiguous(),
                                                          self.layer_index, self.scale, self.sliding_window)
                return self.o_proj(take_rows(out.reshape(num_tokens, self.q_size), output_rows))
            backend.store_kv(k, v, kv_cache)
        out = backend.forward(q, k, v, kv_cache, self.scale, self.sliding_window)  # [num_tokens, num_heads, head_dim]
        out = take_rows(out.reshape(num_tokens, self.q_size), output_rows)
        if self.attention_dtype is not None:
            out = out.to(hidden.dtype)
        return self.o_proj(out)  # [num_out, hidden_size]

    def _norm_qk_in_place(self, qkv: torch.Tensor) -> None:
        """Per-head q/k RMSNorm written back into qkv, so the fused kernel rotates and stores the
        normed heads (the same bits as the torch path: both norms run the same kernel)."""
        num_tokens = qkv.shape[0]
        q = qkv[:, : self.q_size].view(num_tokens, self.num_heads, self.head_dim)
        k, _ = self._split_kv(qkv)
        q.copy_(self.q_norm(q))  # [num_tokens, num_heads, head_dim]
        k.copy_(self.k_norm(k))  # [num_tokens, num_kv_heads, head_dim]

    def _split_kv(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        num_tokens = qkv.shape[0]
        k = qkv[:, self.q_size : self.q_size + self.kv_size].view(num_tokens, self.num_kv_heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        return k, v


def take_rows(x: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    return x if rows is None else x[rows]
