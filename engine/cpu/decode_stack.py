"""Decode steps' decoder layers in one C++ call (engine/cpu/csrc/decode_stack.cpp).

A one-token step of a small model spent about as long in Python as in its weight read:
SmolLM2-135M ran ~450 module and kernel calls per token (figures: docs/performance.md,
"One user against llama.cpp"). `DecodeStack` hands the kernels the eager path already
uses to a C++ loop over the layers, built once from the model after the runner applied
its fast paths (engine/cpu/fast_paths.py), so the result has the eager path's bits.

It takes decode-only steps (every row one sequence's next token) and verification steps
(engine.worker.step_inputs.to_row_tensors: each token a row) on the CPU attention backend, with no
shared-prefix decode groups (those take the shared kernel, from Python), and models whose every layer is the plain decoder layer with the fused kernels: RMSNorm,
fused rotary + KV store (q/k RMSNorm allowed), SiLU-gated dense MLP, and matmuls on bf16
slabs, int8 or int4 panels, a GGUF's own blocks (gguf_linear.py), oneDNN's prepacked weights or
plain weights. Anything else (MoE, Gemma's
norms, partial rotary, tensor parallelism, torch.compile) keeps the eager path, and the
start-up log says why. The embedding, rotary tables, final norm and LM head stay in Python:
one call each per step. Where every matmul is slabs, int8/int4 panels or GGUF blocks, the layers run in one
OpenMP region whose helpers take each kernel's work as they come free (work_pool.h). Beside AMX,
where bf16 slabs take steps of up to 8 tokens only, wider steps run a second stack of the same
layers on oneDNN's prepacked weights (no second copy).

Under --enable-lora the runner hands the stack the adapter pool's tensors (`use_lora`), and a step
with adapter rows adds each row's adapter after the four projections (csrc/lora_rows.h), grouped
by slot as the eager LoRALinear does. Its fp32 kernel folds the scale into the shrink, so it agrees
with the eager path to fp32 rounding, not bit for bit (docs/lora.md).
"""

from __future__ import annotations

import logging
from types import ModuleType

import torch
from torch import nn

from engine.attention.metadata import AttentionMetadata
from engine.models.attention import Attention
from engine.cpu.packing import PackedLinear
from engine.models.decoder import DecoderLayer
from engine.cpu.fused import CpuFusedOps
from engine.cpu.int4_linear import Int4Linear
from engine.cpu.gguf_linear import GgufLinear
from engine.cpu.int8_linear import Int8Linear, QuantizedLinear
from engine.models.layers import RMSNorm, SwiGLUMLP

logger = logging.getLogger(__name__)

# decode_stack.cpp's LinearKind
SLABS, QUANTIZED, ONEDNN, PLAIN = 0, 1, 2, 3
NONE = torch.empty(0)  # an absent tensor (bias, q/k norm), as the kernels take it


class DecodeStack:
    def __init__(self, stack, max_tokens: int | None, model: nn.Module, wide_stack=None) -> None:
        self._stack = stack  # the C++ DecodeStack
        self._max_tokens = max_tokens  # bf16 slabs beside oneDNN (AMX): steps of up to this many tokens
        self._wide_stack = wide_stack  # the same layers on oneDNN's weights, for steps past max_tokens
        self._model = model
        self._has_final_norm = stack.has_final_norm()  # the stack's call ends with model.norm
        self._lora_state = None  # the adapter pool's step state (use_lora); None: no LoRA
        self._lora_scales: list[float] = []  # the pool's per-slot scales, updated as slots are filled

    @property
    def has_lora(self) -> bool:
        return self._lora_state is not None

    def use_lora(self, layers: dict, state, scales: list[float]) -> None:
        """Add adapters from the LoRA pool (engine.lora.adapter_pool.LoRAPool's `layers`, `state` and
        `scales`): its tensors are held by reference, so slots filled later are seen without a copy."""
        for index in range(self._stack.num_layers()):
            tensors = []
            for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
                layer = layers.get((index, name))
                # A [slots, P*R, in] and B [slots, P*R, out], or none: not adapted
                tensors += [layer.a, layer.b] if layer is not None else [NONE, NONE]
            for stack in (self._stack, self._wide_stack):
                if stack is not None:
                    stack.set_lora(index, *tensors)
        self._lora_state, self._lora_scales = state, scales

    def can_run(self, metadata: AttentionMetadata, backend) -> bool:
        """A decode-only step that the CPU backend runs on its plain decode kernel, within the stacks' size."""
        num_seqs = metadata.num_seqs
        return (metadata.max_query_len == 1 and metadata.slot_mapping.shape[0] == num_seqs
                and self.can_run_rows(num_seqs) and backend.decode_tables() is not None)

    def can_run_rows(self, num_rows: int) -> bool:
        """Whether a step of `num_rows` one-token rows fits a stack (forward_rows)."""
        return self._max_tokens is None or num_rows <= self._max_tokens or self._wide_stack is not None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
                backend) -> torch.Tensor:
        """[num_seqs] ids -> [num_seqs, hidden_size] final hidden states, as the model's forward gives."""
        block_tables, seq_lens = backend.decode_tables()
        return self.forward_rows(input_ids, positions, metadata.slot_mapping, block_tables, seq_lens)

    def forward_rows(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        """Rows of one token each, row i attending to the first seq_lens[i] positions of its block
        table: [num_rows] ids -> [num_rows, hidden_size]. Several rows may be one sequence's
        consecutive tokens (a verification step's proposals): each layer stores every row's KV
        before any row attends, so row i sees the rows before it, as a prefill chunk would."""
        model = self._model
        hidden = model.embed(input_ids)  # [num_rows, hidden_size]
        angle_dtype = model.attention_dtype or hidden.dtype  # rotary runs in attention's dtype
        cos, sin = model.rotary.cos_sin(positions, angle_dtype)  # [num_rows, 1, head_dim] each
        stack = self._stack
        if self._max_tokens is not None and input_ids.shape[0] > self._max_tokens:
            stack = self._wide_stack
        hidden, residual = stack.forward(hidden, cos.squeeze(1), sin.squeeze(1), slot_mapping, block_tables, seq_lens,
                                         *self._lora_groups())
        if not self._has_final_norm:
            hidden, _ = model.norm(hidden, residual)
        return hidden

    def _lora_groups(self) -> tuple[list[int], list[torch.Tensor], list[float]]:
        """The step's rows by slot, as the pool's state holds them over the step's tokens (this stack
        runs every layer on every row): slots, rows (empty: all of them), scales."""
        groups = self._lora_state.token_groups if self._lora_state is not None else []
        return ([slot for slot, _ in groups], [NONE if rows is None else rows for _, rows in groups],
                [self._lora_scales[slot] for slot, _ in groups])


def build_decode_stack(model: nn.Module, kv_caches, backend, fused_ops: CpuFusedOps | None,
                       kernels: ModuleType | None) -> tuple[DecodeStack | None, str]:
    """The stack for `model` (its fast paths applied) and the KV pool, or None and why not."""
    reason = _why_not(model, backend, fused_ops, kernels)
    if reason is not None:
        return None, reason
    max_tokens: list[int] = []
    stack = _build_stack(model, kv_caches, fused_ops, kernels, lambda m: _linear_spec(m, max_tokens))
    # Steps past the slabs' size (AMX: a batch's decodes, a verification step's proposals) on the
    # oneDNN weights the eager path uses there: no second copy, only a second list of layers.
    wide_stack = _build_stack(model, kv_caches, fused_ops, kernels, _wide_linear_spec) if max_tokens else None
    if any(isinstance(m, QuantizedLinear) for m in model.modules()):
        # The quantized matmuls are another library's: it shares out on this one's pool.
        from engine.cpu.quantized_extension import load_quantized_kernels

        load_quantized_kernels().use_work_pool(kernels.work_pool_address())
    if any(isinstance(m, GgufLinear) for m in model.modules()):  # and so do a GGUF's block kernels
        from engine.cpu.gguf_extension import load_gguf_kernels

        load_gguf_kernels().use_work_pool(kernels.work_pool_address())
    note = f"{stack.num_layers()} layers" + (", on one work pool's threads" if stack.is_pooled() else "")
    if wide_stack is not None:
        note += f", oneDNN's weights past {min(max_tokens)} tokens"
    return DecodeStack(stack, min(max_tokens) if max_tokens else None, model, wide_stack), note


def _build_stack(model: nn.Module, kv_caches, fused_ops: CpuFusedOps, kernels: ModuleType, linear_spec):
    """The C++ stack of `model`'s layers, each matmul as `linear_spec` gives it."""
    config = model.config
    first = model.layers[0].self_attn
    stack = kernels.DecodeStack(first.num_heads, first.num_kv_heads, config.head_dim, config.rms_norm_eps,
                                fused_ops.sum_lanes, fused_ops.silu_lanes, fused_ops.is_silu_exact)
    for layer, (k_cache, v_cache) in zip(model.layers, kv_caches):
        attn, mlp = layer.self_attn, layer.mlp
        linears = [linear_spec(m) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
        q_norm = attn.q_norm.weight if attn.q_norm is not None else NONE
        k_norm = attn.k_norm.weight if attn.k_norm is not None else NONE
        stack.add_layer(layer.input_layernorm.weight, layer.post_attention_layernorm.weight, q_norm, k_norm,
                        *linears, k_cache, v_cache, attn.scale, attn.sliding_window)
    final_norm = _final_norm(model, fused_ops)
    if final_norm is not None:
        stack.set_final_norm(final_norm)
    return stack


def _final_norm(model: nn.Module, fused_ops: CpuFusedOps) -> torch.Tensor | None:
    """model.norm's weight where the stack's own add_rms_norm gives its bits (a fused RMSNorm with
    the layers' eps and sum order), else None: then Python runs model.norm after the stack."""
    norm = getattr(model, "norm", None)
    if type(norm) is not RMSNorm or norm.fused is None or norm.eps != model.config.rms_norm_eps:
        return None
    if norm.fused.sum_lanes != fused_ops.sum_lanes:
        return None
    return norm.weight.detach()


def _why_not(model: nn.Module, backend, fused_ops: CpuFusedOps | None, kernels: ModuleType | None) -> str | None:
    if kernels is None or fused_ops is None or not hasattr(kernels, "DecodeStack"):
        return "no fused CPU kernels"
    if getattr(backend, "name", None) != "cpu":
        return "not the CPU attention backend"
    if getattr(model.tp, "size", 1) != 1:
        return "tensor parallelism"
    if model.local_rotary is not None:
        return "a second rotary for local layers"
    if type(model.norm) is not RMSNorm:
        return f"final norm {type(model.norm).__name__}"
    eps = model.config.rms_norm_eps
    for layer in model.layers:
        if type(layer) is not DecoderLayer:
            return f"layer {type(layer).__name__}"
        attn, mlp = layer.self_attn, layer.mlp
        norms = [layer.input_layernorm, layer.post_attention_layernorm]
        if attn.q_norm is not None:
            norms += [attn.q_norm, attn.k_norm]
        if any(type(n) is not RMSNorm or n.fused is None or n.eps != eps for n in norms):
            return "a norm without the fused RMSNorm kernel"
        if type(attn) is not Attention or not attn.is_rotary_fused:
            return "attention without the fused rotary + KV store"
        if type(mlp) is not SwiGLUMLP or mlp.fused is None:
            return f"MLP {type(mlp).__name__} without the fused SiLU×up"
        for linear in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
            if type(linear) not in (PackedLinear, Int8Linear, Int4Linear, GgufLinear, nn.Linear):  # _linear_spec's
                return f"matmul {type(linear).__name__}"
    return None


def _wide_linear_spec(module: nn.Module) -> tuple:
    """A slab-backed linear's oneDNN weights (what PackedLinear.forward takes past the slabs' size)."""
    if isinstance(module, PackedLinear) and module.slabs is not None:
        bias = module.bias if module.bias is not None else NONE
        return ONEDNN, module.packed_weight, NONE, bias, module.out_features, ""
    return _linear_spec(module, [])


def _linear_spec(module: nn.Module, max_tokens: list[int]) -> tuple:
    """(kind, weight, scales, bias, out_features, op name) as decode_stack.cpp takes it; the
    slabs' token limit, if any, appended to `max_tokens`."""
    if isinstance(module, QuantizedLinear):
        return QUANTIZED, module.panels, module.scales, module.bias, module.out_features, module.OP_NAME
    if isinstance(module, GgufLinear):  # its op has the same schema: the blocks and their layout
        return QUANTIZED, module.blocks, module.layout, module.bias, module.out_features, module.OP_NAME
    if isinstance(module, PackedLinear):
        if module.slabs is not None:
            if module.slab_plan.max_tokens is not None:
                max_tokens.append(module.slab_plan.max_tokens)
            return SLABS, module.slabs, NONE, module._slab_bias, module.out_features, ""
        bias = module.bias if module.bias is not None else NONE
        return ONEDNN, module.packed_weight, NONE, bias, module.out_features, ""
    bias = module.bias.detach() if module.bias is not None else NONE
    return PLAIN, module.weight.detach(), NONE, bias, module.out_features, ""
