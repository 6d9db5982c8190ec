"""The CPU fast paths, applied by the model runner to whatever blocks a model is built
from, so a new family gets them without code of its own:

- int8 or int4 matmuls with `--quantization int8|int4` (engine/cpu/int8_linear.py,
  int4_linear.py), in place of the prepacked ones: every nn.Linear and RowParallelLinear,
  the LM head too; of a GGUF's own Q8_0 / Q4_0 / Q4_1 blocks where the model came from one
  (engine/loader/gguf_blocks.py);
- a GGUF's matmuls in its own blocks (engine/cpu/gguf_linear.py) are kept as they are (the
  passes below touch nn.Linears only), moved onto huge pages; the LM head among them gives fp32 logits;
- prepacked matmuls (engine/cpu/packing.py): every nn.Linear (attention, MLPs, MoE
  experts, the LM head, tied or not) becomes a PackedLinear, on oneDNN's blocked layout or
  on bf16 slabs per the SlabPlan; a RowParallelLinear packs its matmul and keeps its
  all-reduce; the slabs then move onto huge pages;
- the fused element-wise kernels (engine/cpu/fused.py), handed to each block that can
  use them: every RMSNorm (with the residual add; the per-head q/k norms too), every
  SwiGLU MLP's SiLU×up (the MoE experts' too), and, in attention layers whose rotary the
  kernel computes, rotary inside the attention backend's KV store. It cannot apply a q/k norm between the
  projection and rotary (Qwen3) or rotate part of a head (Phi-4-mini): those layers run
  the torch ops, the reference, and the log says so. Nor are there kernels for Gemma's
  (1 + w) RMSNorm or a GELU-tanh gate: those blocks run the torch ops, and the log says so.

One log line per model says which fast paths it got.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import TYPE_CHECKING

import torch
from torch import nn

from engine.attention.backend import AttentionBackend
from engine.cpu.fused import CpuFusedOps
from engine.cpu.block_quantize import block_linear
from engine.cpu.gguf_extension import load_gguf_kernels
from engine.cpu.gguf_linear import GgufLinear, gather_blocks_on_huge_pages
from engine.cpu.int4_linear import BLOCK, Int4Linear
from engine.cpu.int8_linear import GROUP, Int8Linear, QuantizedEmbedding, QuantizedLinear, gather_panels_on_huge_pages
from engine.cpu.packing import PackedLinear, SlabPlan, gather_slabs_on_huge_pages, prepack_linears
from engine.cpu.quantized_plan import QuantizedPlan
from engine.parallel.parallel_layers import RowParallelLinear
from engine.models.attention import Attention
from engine.models.layers import OffsetRMSNorm, RMSNorm, SwiGLUMLP
from engine.models.moe import MoEBlock

if TYPE_CHECKING:
    from engine.loader.gguf_blocks import GgufBlocks

logger = logging.getLogger(__name__)


def apply_fast_paths(model: nn.Module, *, batch_size_hint: int | None, slabs: SlabPlan | None,
                     fused_ops: CpuFusedOps | None, backend: AttentionBackend, is_compiled: bool,
                     int8: QuantizedPlan | None = None, gguf_blocks: dict[str, GgufBlocks] | None = None) -> list[str]:
    """Quantize the matmuls to int8 (with `int8`; of a GGUF's blocks where `gguf_blocks` has
    them), or prepack them (when `batch_size_hint` is given), and hand out the fused ops (when
    given); returns the notes it logs, one per kind of fast path."""
    notes = []
    if int8 is not None:
        notes.append(quantize_model(model, int8, gguf_blocks))
    elif is_compiled:
        notes.append("compiled: inductor prepacks the matmuls and fuses the element-wise ops")
    elif batch_size_hint is not None:
        notes.append(f"{prepack_model(model, batch_size_hint, slabs)} matmuls on {_packing(slabs)}")
    else:
        notes.append("matmuls: plain F.linear")
    if fused_ops is not None:
        notes.append(use_fused_ops(model, fused_ops, backend.can_rotate_and_store))
    elif not is_compiled:
        notes.append("element-wise ops: torch (no fused kernels for this device and backend)")
    gguf_note = keep_gguf_linears(model)
    if gguf_note and (int8 is None or int8.block_type is None):  # else the quantization's note says it
        notes.append(gguf_note)
    notes.append(f"attention: {backend.name} backend")
    num_moe = sum(isinstance(m, MoEBlock) for m in model.modules())
    if num_moe:
        notes.append(f"MoE: {num_moe} layers, tokens grouped by expert (steps run without CUDA graphs)")
    logger.info("%s fast paths: %s", type(model).__name__, "; ".join(notes))
    return notes


def keep_gguf_linears(model: nn.Module) -> str:
    """A GGUF's matmuls in its own blocks (GgufLinear, engine/cpu/gguf_linear.py) are neither
    packed nor quantized again (neither pass touches anything but nn.Linear); the LM head among
    them gives fp32 logits. Returns the note ("" if there are none)."""
    linears = [m for m in model.modules() if isinstance(m, GgufLinear)]
    head = getattr(model, "lm_head", None)
    if isinstance(head, GgufLinear):
        head.out_fp32 = True
    if not linears:
        return ""
    types = Counter(name for m in linears for name in m.type_names)
    moved = gather_blocks_on_huge_pages(linears)
    pages = f", {moved / 2**20:.0f} MB on huge pages" if moved else ""
    isa = "AVX2 kernels, prompts' groups on AVX512-VNNI" if load_gguf_kernels().dot_isa() == "avx512_vnni" else "AVX2 kernels"
    return f"{len(linears)} matmuls in the GGUF's own blocks ({', '.join(sorted(types))}, on the {isa}{pages})"


def prepack_model(model: nn.Module, batch_size_hint: int, slabs: SlabPlan | None = None) -> int:
    """Move every matmul, the logits' too, onto oneDNN-prepacked weights (with `slabs`, onto
    bf16 slabs); returns how many."""
    num_packed = prepack_linears(model, batch_size_hint, slabs)  # the LM head among them, tied or not
    for module in model.modules():
        if isinstance(module, RowParallelLinear):  # not nn.Linears: their all-reduce stays
            module.packed = PackedLinear(module.weight, None, batch_size_hint, slabs)
            num_packed += 1
    head = getattr(model, "lm_head", None)
    if isinstance(head, PackedLinear):
        head.out_fp32 = True
    if slabs is not None:
        gather_slabs_on_huge_pages(model)
    return num_packed


def quantize_model(model: nn.Module, plan: QuantizedPlan, gguf_blocks: dict[str, GgufBlocks] | None = None) -> str:
    """Every matmul, the logits' too, onto int8 (or int4); a tied embedding reads the head's."""
    num_quantized = quantize_linears(model, plan, gguf_blocks)  # the LM head among them, tied or not
    for module in model.modules():
        if isinstance(module, RowParallelLinear):  # not nn.Linears: their all-reduce stays
            packed = quantized_linear(module.weight, None, plan)
            if packed is not None:
                module.packed, module.weight = packed, None
                num_quantized += 1
    head = getattr(model, "lm_head", None)
    if plan.block_type is not None:
        num_plain = sum(type(m) is nn.Linear for m in model.modules())
        note = (f"{num_quantized} matmuls {plan.scheme} ({plan.block_type} blocks on the AVX2 GGUF kernels: "
                f"this CPU has no AVX512_VNNI)")
        if num_plain:
            note += f", {num_plain} left unquantized (inputs not a multiple of {BLOCK})"
    elif plan.scheme == "int4":
        note = f"{num_quantized} matmuls int4 (W4A8 on vpdpbusd, Q4_1's blocks of {BLOCK} inputs)"
    else:
        note = f"{num_quantized} matmuls int8 (W8A8 on vpdpbusd, scales per group of {GROUP} inputs)"
    num_from_gguf = sum(getattr(m, "from_gguf", False) for m in model.modules())
    if num_from_gguf:
        kind = "Q4_0/Q4_1 blocks" if plan.scheme == "int4" else "Q8_0 blocks, groups of 32"
        note += f", {num_from_gguf} of them the GGUF's own {kind}"
    moved = gather_panels_on_huge_pages(model)
    if moved:
        note += f", {moved / 1e6:.1f} MB of panels on huge pages"
    if isinstance(head, (QuantizedLinear, GgufLinear)):
        head.out_fp32 = True
        if getattr(getattr(model, "config", None), "tie_word_embeddings", False) and getattr(model.tp, "size", 1) == 1:
            model.embed_tokens = QuantizedEmbedding(head, model.embed_tokens.weight.dtype)
            note += f", the tied embedding read from the head's {plan.scheme}"
    return note


def use_fused_ops(model: nn.Module, ops: CpuFusedOps, can_rotate_and_store: bool) -> str:
    """Hand `ops` to every block that can use them, and turn on the backend's fused rotary
    + KV store in the attention layers it applies to; returns what each kind got."""
    fused: Counter[str] = Counter()
    unfused: Counter[str] = Counter()  # attention layers on torch rotary, by reason
    torch_ops: Counter[str] = Counter()  # blocks no fused kernel computes
    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.fused = ops
            fused["RMSNorm"] += 1
        elif isinstance(module, OffsetRMSNorm):
            torch_ops["(1 + w) RMSNorm"] += 1
        elif isinstance(module, SwiGLUMLP) and module.activation == "silu":
            module.fused = ops
            fused["SiLU×up"] += 1
        elif isinstance(module, SwiGLUMLP):
            torch_ops[f"{module.activation}×up"] += 1
        elif isinstance(module, Attention):
            reason = module.why_rotary_not_fused
            if reason is None and not can_rotate_and_store:
                reason = "the attention backend cannot fuse rotary into its KV store"
            if reason is None:
                module.is_rotary_fused = True
                fused["rotary+KV store"] += 1
            else:
                unfused[reason] += 1
    note = "fused " + ", ".join(f"{kind} ×{n}" for kind, n in fused.items()) if fused else "nothing fused"
    if torch_ops:
        note += "; torch ops (no fused kernel) for " + ", ".join(f"{kind} ×{n}" for kind, n in torch_ops.items())
    for reason, n in unfused.items():
        note += f"; torch rotary and KV store in {n} attention layers ({reason})"
    return note


def _packing(slabs: SlabPlan | None) -> str:
    if slabs is None:
        return "oneDNN's prepacked layout"
    if slabs.max_tokens is None:
        return "bf16 slabs (the CPU has AVX512_BF16 and no AMX)"
    return f"oneDNN's layout, and bf16 slabs for steps of up to {slabs.max_tokens} tokens"


def quantized_linear(weight: torch.Tensor, bias: torch.Tensor | None, plan: QuantizedPlan,
                     blocks: GgufBlocks | None = None) -> nn.Module | None:
    """An Int8Linear, or with plan.scheme "int4" an Int4Linear, of `weight`; of a GGUF's `blocks`
    as they are where given (the scheme's own: Q8_0 for int8, Q4_0 or Q4_1 for int4). Without
    VNNI a GgufLinear in plan.block_type's blocks, or None where the inputs are not whole blocks."""
    if plan.block_type is not None:
        return block_linear(weight, bias, plan.block_type, blocks)
    if plan.scheme == "int4":
        return Int4Linear(weight, bias, plan, None if blocks is None else (blocks.codes, blocks.d, blocks.m))
    return Int8Linear(weight, bias, plan, None if blocks is None else (blocks.codes, blocks.d))


def quantize_linears(model: nn.Module, plan: QuantizedPlan, blocks: dict[str, GgufBlocks] | None = None) -> int:
    """Swap every nn.Linear in `model` for the plan's quantized linear, of its GGUF blocks where
    `blocks` (by weight name, engine/gguf_blocks.place_blocks) has them; returns how many."""
    blocks = blocks or {}
    num_quantized = 0
    for prefix, module in list(model.named_modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                weight_name = f"{prefix}.{name}.weight" if prefix else f"{name}.weight"
                quantized = quantized_linear(child.weight, child.bias, plan, blocks.get(weight_name))
                if quantized is not None:
                    setattr(module, name, quantized)
                    num_quantized += 1
    return num_quantized
