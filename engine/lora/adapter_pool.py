"""The adapters a runner serves: a CPU cache of loaded adapters (`max_cpu_loras`, least recently used
evicted beyond it) and a pool of `max_loras` slots per adapted layer, on the model's device:

    layer's A:  [max_loras, P * max_rank, in]     P rank blocks: 3 for qkv_proj, 2 for gate_up_proj, else 1
    layer's B:  [max_loras, P * max_rank, out]    transposed as loaded: each projection's output
                                                  features use its own block's rows
    scales:     [max_loras]                        lora_alpha / r, or lora_alpha / sqrt(r) under rsLoRA

An adapter of rank r < max_rank fills its blocks' first r rows of A and of B; the rest stay
zero and add exact zeros. B is kept transposed (rank rows, output features along them) so that the
CPU decode stack's expand (engine/cpu/csrc/lora_rows.h) reads it in vectors along the outputs. The
scheduler lets at most `max_loras` distinct adapters run at once (engine.core.adapter_admission),
so `activate` always finds a slot: one empty, or the least recently used one whose adapter is not in
this step.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict

import torch
from torch import nn

from engine.lora.adapter_files import LoRAWeights, load_adapter
from engine.lora.adapter_reader import AdapterRead, AdapterReader
from engine.lora.lora_layers import NO_SLOT, LoRALinear, LoRAStepState
from engine.lora.parallel_lora import attach_lora
from ipc.lora_adapter import NUM_PARTS, ModelShape, check_adapter, check_max_lora_rank
from ipc.messages import LoRARequest

logger = logging.getLogger(__name__)
ATTENTION_MODULES = ("qkv_proj", "o_proj")
MLP_MODULES = ("gate_up_proj", "down_proj")


class LoRAPool:
    def __init__(self, model: nn.Module, shape: ModelShape, max_loras: int, max_lora_rank: int,
                 max_cpu_loras: int | None, dtype: torch.dtype, device: torch.device, sharding=None) -> None:
        """`sharding`: this rank's engine.lora.parallel_lora.AdapterSharding under tensor parallelism."""
        check_max_lora_rank(max_lora_rank)
        if max_loras < 1:
            raise ValueError(f"max_loras must be at least 1, got {max_loras}")
        self.shape = shape
        self.max_loras = max_loras
        self.max_rank = max_lora_rank
        self.max_cpu_loras = max(max_cpu_loras or max_loras, max_loras)
        self.dtype = dtype
        self.sharding = sharding
        # The layers' own sizes (this rank's under TP); adapters are checked against the whole model's.
        self.local_shape = shape if sharding is None else sharding.local_shape
        # On the GPU every layer runs the Triton kernels (engine.kernels.lora_sgmv), reading the scales there.
        self.state = LoRAStepState(scales=torch.zeros(max_loras, dtype=torch.float32, device=device),
                                   uses_kernels=device.type == "cuda")
        self.scales = [0.0] * max_loras  # shared with every layer
        self.cache: OrderedDict[int, LoRAWeights] = OrderedDict()  # lora_int_id -> weights, LRU first
        self.reader = AdapterReader(shape, dtype)
        self.reading: dict[int, AdapterRead] = {}  # lora_int_id -> its read on the reader thread, until cached
        self.slot_ids: list[int | None] = [None] * max_loras  # the adapter id in each slot
        self.slot_order: OrderedDict[int, None] = OrderedDict.fromkeys(range(max_loras))  # LRU slot first
        # Per slot, per layer: {rank block: rows written} by its adapter (what a new one must zero).
        self.slot_rows: list[dict[tuple[int, str], dict[int, int]]] = [{} for _ in range(max_loras)]
        self.layers = self._wrap(model, device)

    def _wrap(self, model: nn.Module, device: torch.device) -> dict[tuple[int, str], LoRALinear]:
        """Put a LoRALinear around each adaptable linear of the model's decoder layers."""
        layers: dict[tuple[int, str], LoRALinear] = {}
        last = len(model.layers) - 1
        for i, layer in enumerate(model.layers):
            parents = [(layer.self_attn, ATTENTION_MODULES)] if hasattr(layer, "self_attn") else []
            if not self.shape.is_moe and hasattr(layer, "mlp"):
                parents.append((layer.mlp, MLP_MODULES))
            for parent, names in parents:
                for name in names:
                    start, end = self.local_shape.out_slice(name, None)
                    width = NUM_PARTS[name] * self.max_rank
                    a = torch.zeros(self.max_loras, width, self.local_shape.in_features(name), dtype=self.dtype,
                                    device=device)
                    b = torch.zeros(self.max_loras, width, end - start, dtype=self.dtype, device=device)
                    is_output = i == last and name != "qkv_proj"  # the last layer past attention: output rows
                    wrapped = attach_lora(parent, name, a, b, self.scales, self.state, is_output)
                    layers[(i, name)] = wrapped
        logger.info("LoRA: %d slots of rank %d on %d layers (%.1f MiB)", self.max_loras, self.max_rank, len(layers),
                    sum(m.a.numel() + m.b.numel() for m in layers.values()) * self.a_itemsize / 2**20)
        return layers

    @property
    def a_itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    def prefetch(self, lora_request: LoRARequest) -> AdapterRead | None:
        """Start reading the adapter on the reader thread (engine.lora.adapter_reader), its folder checked
        here first (ValueError naming the field); None when it is cached already."""
        self._collect_reads()
        lora_id = lora_request.lora_int_id
        known = self.cache.get(lora_id) or self.reading.get(lora_id)
        if known is not None:
            self._check_same_path(lora_request, known.path)
            if lora_id in self.cache:
                self.cache.move_to_end(lora_id)
                return None
            return self.reading[lora_id]
        spec = check_adapter(lora_request.lora_path, self.shape, self.max_rank)
        self.reading[lora_id] = read = self.reader.submit(spec)
        return read

    def load(self, lora_request: LoRARequest) -> LoRAWeights:
        """The adapter's weights: from the cache, its read (waited for if not done), or its folder (checked:
        ValueError naming the field)."""
        lora_id = lora_request.lora_int_id
        weights = self.cache.get(lora_id)
        if weights is not None:
            self._check_same_path(lora_request, weights.path)
            self.cache.move_to_end(lora_id)
            return weights
        read = self.reading.pop(lora_id, None)
        if read is not None:
            weights = read.weights()
        else:
            weights = load_adapter(lora_request.lora_path, self.shape, self.max_rank, self.dtype)
        self._cache(lora_id, weights)
        return weights

    @staticmethod
    def _check_same_path(lora_request: LoRARequest, path: str) -> None:
        if path != os.path.abspath(lora_request.lora_path):
            raise ValueError(f"lora_int_id {lora_request.lora_int_id} is already the adapter at {path}; "
                             "give each adapter its own id")

    def _cache(self, lora_id: int, weights: LoRAWeights) -> None:
        self.cache[lora_id] = weights
        while len(self.cache) > self.max_cpu_loras:
            evicted, _ = self.cache.popitem(last=False)  # its slot, if any, keeps its copy
            logger.info("LoRA: adapter %d left the CPU cache (max_cpu_loras %d)", evicted, self.max_cpu_loras)

    def _collect_reads(self) -> None:
        """Finished reads into the cache, failed ones forgotten (their requests got the error): reads of
        aborted requests do not pile up beside the cache's bound."""
        for lora_id, read in list(self.reading.items()):
            if read.future.done():
                del self.reading[lora_id]
                if read.is_ready:
                    self._cache(lora_id, read.future.result())

    def activate(self, lora_requests: list[LoRARequest | None]) -> dict[int, int]:
        """A slot for each adapter of the step (at most max_loras of them): lora_int_id -> slot."""
        wanted = {r.lora_int_id: r for r in lora_requests if r is not None}
        if len(wanted) > self.max_loras:
            raise RuntimeError(f"a step of {len(wanted)} adapters, over max_loras {self.max_loras}")
        slot_of = {lora_id: slot for slot, lora_id in enumerate(self.slot_ids) if lora_id in wanted}
        for lora_id, request in wanted.items():
            if lora_id not in slot_of:
                slot = next(s for s in self.slot_order if self.slot_ids[s] not in wanted)
                self._fill(slot, lora_id, self.load(request))
                slot_of[lora_id] = slot
            self.slot_order.move_to_end(slot_of[lora_id])
        return slot_of

    def step_slots(self, lora_requests: list[LoRARequest | None]) -> list[int]:
        """Each of the step's sequences' slot (NO_SLOT: the base), its adapters activated; [] when none has one."""
        if all(r is None for r in lora_requests):
            return []
        slot_of = self.activate(lora_requests)
        return [NO_SLOT if r is None else slot_of[r.lora_int_id] for r in lora_requests]

    def fill_slot(self, slot: int, lora_request: LoRARequest) -> None:
        """Put the adapter in `slot` as another rank's pool did (a tensor-parallel worker's)."""
        self._fill(slot, lora_request.lora_int_id, self.load(lora_request))

    @torch.no_grad()
    def _fill(self, slot: int, lora_id: int, weights: LoRAWeights) -> None:
        """Copy the adapter into `slot` of every layer (zeros where it adapts nothing).

        Only the rows the slot's last adapter wrote and this one does not are zeroed, not the whole
        slot, which cost the loop more than the copies (docs/lora.md). A block's rows of B are only
        ever written in that block's own output columns (its projection's, or the whole fused module's
        for every adapter of a fused model), so the columns beside them stay zero from the pool's start."""
        if self.sharding is not None:
            weights = self.sharding.shard(weights)  # this rank's cut of the whole adapter (engine.lora.parallel_lora)
        written = self.slot_rows[slot]
        for key, layer in self.layers.items():
            now = {part.part_index: weights.rank for part in weights.layers.get(key, ())}
            for part_index, num_rows in written.get(key, {}).items():
                if num_rows > now.get(part_index, 0):  # the last adapter's rows past this one's
                    first = part_index * self.max_rank
                    rows = slice(first + now.get(part_index, 0), first + num_rows)
                    layer.a[slot, rows].zero_()
                    layer.b[slot, rows].zero_()
            for part in weights.layers.get(key, ()):
                rows = slice(part.part_index * self.max_rank, part.part_index * self.max_rank + weights.rank)
                layer.a[slot, rows].copy_(part.a)  # [rank, in]
                layer.b[slot, rows, part.out_start : part.out_end].copy_(part.b_t)  # [rank, out_p]
            written[key] = now
        self.scales[slot] = weights.scale
        self.state.scales[slot] = weights.scale
        self.slot_ids[slot] = lora_id
        logger.debug("LoRA: adapter %d in slot %d", lora_id, slot)

