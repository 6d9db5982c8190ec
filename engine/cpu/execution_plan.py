"""What the CPU does with a model: decided before its weights load, applied once they have.

The model runner's one way into engine/cpu. `CpuExecutionPlan.make` settles, from the
config, the device and the CPU's features, which matmuls the model gets (int8/int4,
oneDNN-prepacked, bf16 slabs, plain), which fused kernels (also the attention backend's),
and whether decode steps run as one C++ call; `prepare` then applies all of it to the
built model, the backend and the KV pool, and returns the decode stack. Off the CPU (or
compiled) the plan is empty and `prepare` only logs what runs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch
from torch import nn

from engine.attention.backend import AttentionBackend, KVCache
from engine.config import EngineConfig
from engine.cpu.decode_stack import DecodeStack, build_decode_stack
from engine.cpu.fast_paths import apply_fast_paths
from engine.cpu.fused import CpuFusedOps, select_fused_ops
from engine.cpu.gguf_kernels import GgufKernels, load_gguf_kernels
from engine.cpu.packing import bound_primitive_caches, can_prepack, plan_slabs
from engine.cpu.quantized_plan import QuantizedPlan, plan_quantization
from engine.cpu.host import CpuFeatures
from engine.cpu.vision_int8 import check_vision_quantization_supported, quantize_vision_tower
from engine.cpu.huge_pages import zeros_on_huge_pages
from engine.parallel.parallel_state import threads_per_rank

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CpuExecutionPlan:
    cpu: CpuFeatures
    device: torch.device
    dtype: torch.dtype
    quantization: QuantizedPlan | None  # int8 or int4 matmuls (then nothing is prepacked)
    is_prepacked: bool  # oneDNN's blocked weights, or bf16 slabs where plan_slabs says
    is_compiled: bool  # inductor prepacks and fuses instead
    fused_ops: CpuFusedOps | None
    batch_size_hint: int  # oneDNN packs for steps of about this many rows
    has_decode_stack: bool  # config allows it, on the CPU, eager, one pipeline stage
    gguf_source: tuple[str, Path] | None  # (model as given, its folder): quantize from a GGUF's own blocks
    read_gguf_blocks: Callable | None  # the loader's (engine.loader.gguf_blocks.blocks_for_model), handed in
    can_keep_gguf_blocks: bool  # a GGUF's matmuls may run on its own blocks (GgufLinear), not dequantized
    vision_int8: bool = False  # --vision-quantization int8: the vision tower's linears on fbgemm's int8

    @classmethod
    def make(cls, config: EngineConfig, model_path: Path, device: torch.device, dtype: torch.dtype,
             cpu: CpuFeatures, backend_name: str, is_compiled: bool, is_tensor_parallel: bool,
             read_gguf_blocks: Callable | None = None) -> CpuExecutionPlan:
        """Called before the weights load: int8 on a CPU without VNNI is refused at once, and
        oneDNN's primitive caches are capped before the weights make primitives, and the matmul
        threads set (a tensor-parallel rank takes its share of the host's cores). `read_gguf_blocks`
        (model, model as given, folder, scheme) -> blocks: how a GGUF's own blocks are read, the
        loader's business; without it quantized weights are always quantized from the folder."""
        if device.type == "cpu":
            set_num_threads(config, is_tensor_parallel)
        quantization = (plan_quantization(device.type, cpu.has_avx512_vnni, config.quantization)
                        if config.quantization else None)
        is_prepacked = (config.cpu_prepack and not is_compiled and quantization is None
                        and can_prepack(device, dtype))
        if is_prepacked or is_compiled:
            bound_primitive_caches()
        if config.vision_quantization:
            check_vision_quantization_supported(config.vision_quantization, device.type)
        may_use_gguf = (quantization is not None and not is_tensor_parallel and config.load_format == "auto"
                        and read_gguf_blocks is not None)
        return cls(
            cpu=cpu, device=device, dtype=dtype, quantization=quantization, is_prepacked=is_prepacked, is_compiled=is_compiled,
            fused_ops=select_fused_ops(device, backend_name, is_compiled),
            batch_size_hint=config.max_num_seqs,
            has_decode_stack=_has_decode_stack(config, device, is_compiled),
            gguf_source=(config.model, model_path) if may_use_gguf else None, read_gguf_blocks=read_gguf_blocks,
            # The block kernels are eager CPU matmuls of one process: --quantization, inductor and
            # tensor parallelism take dequantized weights instead.
            can_keep_gguf_blocks=(config.gguf_blocks and device.type == "cpu" and quantization is None
                                  and not is_compiled and not is_tensor_parallel),
            vision_int8=config.vision_quantization == "int8",
        )

    def gguf_kernels(self) -> GgufKernels | None:
        """The GGUF block kernels a GGUF's matmuls may run on (engine/loader/gguf_model.py), or None."""
        return load_gguf_kernels() if self.can_keep_gguf_blocks else None

    @property
    def attention_kernels(self) -> ModuleType | None:
        """The fused ops' kernels, for the backend's KV store with rotary (None: the torch ops)."""
        return self.fused_ops.kernels if self.fused_ops is not None else None

    def new_kv_tensor(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A zeroed KV pool tensor: on the CPU on huge pages (blocks are read scattered: fewer TLB
        misses), elsewhere plain."""
        if self.device.type == "cpu":
            return zeros_on_huge_pages(shape, dtype)
        return torch.zeros(shape, dtype=dtype, device=self.device)

    def prepare(self, model: nn.Module, backend: AttentionBackend, kv_caches: list[KVCache],
                num_weight_bytes: int) -> DecodeStack | None:
        """Quantized, prepacked (or slab) matmuls and the fused element-wise ops, on whatever
        blocks the model has; then the decode stack over them and the KV pool, where it can run."""
        slabs = plan_slabs(self.dtype, num_weight_bytes, self.cpu) if self.is_prepacked else None
        gguf_blocks = None
        if self.gguf_source is not None:
            gguf_blocks = self.read_gguf_blocks(model, *self.gguf_source, self.quantization.scheme)
        if self.vision_int8:
            # Before the passes below: they take nn.Linears only, so the tower is neither packed nor
            # block-quantized again.
            quantize_vision_tower(model, reduce_range=not self.cpu.has_avx512_vnni)
        apply_fast_paths(model, batch_size_hint=self.batch_size_hint if self.is_prepacked else None, slabs=slabs,
                         fused_ops=self.fused_ops, backend=backend, is_compiled=self.is_compiled,
                         int8=self.quantization, gguf_blocks=gguf_blocks)
        if not self.has_decode_stack:
            return None
        stack, note = build_decode_stack(model, kv_caches, backend, self.fused_ops, self.attention_kernels)
        logger.info("decode steps: %s", f"one C++ call for {note}" if stack is not None else f"eager ({note})")
        return stack


def set_num_threads(config: EngineConfig, is_tensor_parallel: bool) -> None:
    num_threads = config.num_threads
    if not num_threads and is_tensor_parallel:
        num_threads = threads_per_rank(config.world_size, config.nnodes)
    if num_threads:
        torch.set_num_threads(num_threads)


def _has_decode_stack(config: EngineConfig, device: torch.device, is_compiled: bool) -> bool:
    if not config.cpu_decode_stack or device.type != "cpu" or is_compiled:
        return False
    if config.pipeline_parallel_size > 1:
        logger.info("decode steps: eager (pipeline parallelism)")
        return False
    return True
