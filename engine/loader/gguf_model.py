"""Build a model straight from a GGUF file: each matmul in the file's own blocks where a kernel
runs its types, else dequantized tensor by tensor into the model's dtype. No fp32 copy anywhere.

    load_gguf_model(config, gguf_path, dtype, device, tp, kernels, reserve_bytes)

1. Map. transformers' GGUF loader (names, llama.cpp's q/k row permutation, experts) runs on row
   numbers instead of values (`map_checkpoint`): each Hugging Face tensor comes back as the
   (GGUF tensor, row) of each of its rows, and no weight is read. 1-D tensors (norms, biases) are
   small and read as values: a loader may change those (Gemma's norms: w - 1).
2. Place. The model's own loader (`load_weights(into=...)`) writes those row numbers into each
   matmul's merged weight (q, k, v into qkv_proj), so each of our matmuls learns which rows of
   which GGUF tensors make it up, in order: its parts.
3. Plan and check. A matmul whose every part's type has a kernel keeps its blocks; the others,
   and whatever is no matmul (norms, MoE experts), are dequantized. The bytes that makes are
   checked against MemAvailable before anything is allocated.
4. Fill. The rest of the model is allocated and loaded through `load_weights`; then each matmul
   is read from the file part by part (engine/loader/gguf_file.py: into our own buffer, so the
   peak is the model plus one tensor) and becomes a GgufLinear or a weight
   (`gguf_linear_or_weight`, the one seam with engine/cpu/gguf_kernels.py).
"""

from __future__ import annotations

import itertools
import logging
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from engine.loader.gguf_file import (
    GgufFile, available_memory_bytes, can_dequantize, dequantize_rows, open_gguf, read_tensor,
)
from engine.models import new_model
from engine.models.config import ModelConfig
from engine.models.moe import MoEBlock

logger = logging.getLogger(__name__)

# A row id is tensor_index * ROW_SPAN + row, exact in the float64 the loader carries it in.
ROW_SPAN = 1 << 32
GB = 1e9


@dataclass
class CheckpointMap:
    """A GGUF as transformers' loader names it, read nowhere but for its 1-D tensors."""

    rows: dict[str, torch.Tensor]  # HF name -> int64 row ids, the tensor's shape less its last dim
    values: dict[str, torch.Tensor]  # HF name -> the tensor itself (norms, biases)


@dataclass
class MatmulPlan:
    """One of our matmuls (or the embedding) and the GGUF rows that make up its weight."""

    name: str  # our module: "layers.0.self_attn.qkv_proj", "lm_head", "embed_tokens"
    row_ids: torch.Tensor  # [out_features] int64
    in_features: int
    hf_names: set[str]  # the checkpoint tensors placed in it
    keeps_blocks: bool = False

    def runs(self) -> list[tuple[int, torch.Tensor]]:
        """(GGUF tensor index, its rows in our order) for each stretch of rows from one tensor."""
        index = self.row_ids // ROW_SPAN
        starts = [0, *(torch.nonzero(index[1:] != index[:-1]).flatten() + 1).tolist(), len(index)]
        return [(int(index[a]), self.row_ids[a:b] % ROW_SPAN) for a, b in itertools.pairwise(starts)]

    def type_names(self, file: GgufFile) -> list[str]:
        return [file.tensors[i].type_name for i, _ in self.runs()]

    def block_bytes(self, file: GgufFile) -> int:
        return sum(len(rows) * file.tensors[i].row_bytes for i, rows in self.runs())


def gguf_linear_or_weight(parts: list[tuple[str, torch.Tensor]], in_features: int, dtype: torch.dtype,
                          bias: torch.Tensor | None, kernels) -> nn.Module | torch.Tensor:
    """A matmul's parts ((ggml type, [rows, bytes per row] uint8), stacked along its outputs) ->
    a GgufLinear on those blocks where `kernels` (engine.cpu.gguf_kernels.GgufKernels) runs every
    part's type, else the weight dequantized into `dtype` ([out_features, in_features])."""
    if kernels is not None and all(type_name in kernels.types for type_name, _ in parts):
        return kernels.linear(parts, in_features, bias=bias)
    weight = torch.empty(sum(raw.shape[0] for _, raw in parts), in_features, dtype=dtype)
    start = 0
    for type_name, raw in parts:
        dequantize_rows(raw, type_name, dtype, out=weight[start:start + raw.shape[0]])
        start += raw.shape[0]
    return weight


def load_gguf_model(config: ModelConfig, gguf_path: Path, dtype: torch.dtype, device: torch.device, tp=None,
                    kernels=None, reserve_bytes: int = 0) -> nn.Module:
    """The model of `config` (the GGUF's folder, engine/loader/model_files.py) with the weights of
    `gguf_path`. `kernels`: engine.cpu.gguf_kernels.GgufKernels, or None to dequantize every
    tensor (another device, --quantization, TP). `reserve_bytes`: memory the caller allocates
    next (the KV pool), counted in the check against MemAvailable."""
    file = open_gguf(gguf_path)
    checkpoint = map_checkpoint(file, Path(config.path))
    model = new_model(config, tp)
    # Cast while nothing is allocated: what is allocated below is then in its final dtype, and
    # no cast ever touches the blocks' tensors. Routers stay fp32 (engine.models.load_model).
    model = model.to(dtype=dtype)
    for module in model.modules():
        if getattr(module, "keeps_fp32", False):
            module.float()
    plans = place_rows(model, checkpoint) if tp is None else []
    for plan in plans:
        plan.keeps_blocks = kernels is not None and all(t in kernels.types for t in plan.type_names(file))
        for module in _modules_of(model, plan):
            module.weight = None  # made below, from the file: to_empty must not allocate it
    _check_types(file, checkpoint, plans)
    _check_memory(file, model, plans, dtype, reserve_bytes)
    model = model.to_empty(device=device)

    consumed = set().union(*(plan.hf_names for plan in plans))
    rest = (*checkpoint.values.items(),
            *((name, ids) for name, ids in checkpoint.rows.items() if name not in consumed))
    weights = ((name, _gather_rows(file, t, dtype) if t.dtype == torch.int64 else t) for name, t in rest)
    if tp is None:
        params = dict(model.named_parameters())
        missing = set(params) - model.load_weights(weights, into=params)
        if missing:
            raise ValueError(f"{file.path.name}: weights missing from the GGUF: {sorted(missing)[:5]}")
    else:
        model.load_weights(weights)
    for plan in plans:
        _fill_matmul(model, plan, file, dtype, kernels)
    model.build_rotary(device)
    # Each matmul's ggml types, part by part, kept or not: what the log sums up, for a look.
    model.gguf_types = {plan.name: tuple(plan.type_names(file)) for plan in plans}
    _log_summary(file, plans, dtype)
    return model.eval()


def map_checkpoint(file: GgufFile, folder: Path) -> CheckpointMap:
    """transformers' GGUF tensor processing (its load_gguf_checkpoint's loop: the name map, the
    architecture's processor) run on row numbers for values (module docstring, step 1). The loop
    is ours so that the file is read by open_gguf alone: load_gguf_checkpoint also parses the
    whole vocabulary with GGUFReader, which takes longer than loading the weights."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

    from engine.loader.gguf_convert import memoized_tensor_name_maps

    config = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    processor_class = TENSOR_PROCESSORS.get(file.metadata.get("general.architecture"), TensorProcessor)
    processor = processor_class(config=config.to_dict())
    with memoized_tensor_name_maps():
        names = get_gguf_hf_weights_map(skeleton, processor)
    parsed = {"tensors": {}}
    for info in file.tensors:
        result = processor.process(weights=_rows_or_values(file, info), name=info.name, tensor_key_mapping=names,
                                   parsed_parameters=parsed)
        if result.name in names:
            parsed["tensors"][names[result.name]] = torch.from_numpy(np.copy(result.weights))
    checkpoint = CheckpointMap({}, {})
    for name, tensor in parsed["tensors"].items():
        if tensor.dtype != torch.float64:  # values (fp32, from the 1-D branch)
            checkpoint.values[name] = tensor
            continue
        if tensor.shape[-1] != 1 or not torch.equal(tensor, tensor.round()):
            raise ValueError(f"{file.path.name}: transformers' GGUF loader changes the values of {name}, "
                             "not only the order of its rows; tokenloom cannot load it from the file's blocks")
        checkpoint.rows[name] = _checked_row_ids(tensor.squeeze(-1).long(), file, name)
    return checkpoint


def _rows_or_values(file: GgufFile, info) -> np.ndarray:
    """A 1-D tensor's values (fp32; small: norms, biases), read through our own buffer; else its
    row ids (float64, rows first, a last dimension of 1) in place of its values."""
    import gguf

    if len(info.shape) == 1:
        return gguf.dequantize(read_tensor(file.path, info).numpy().reshape(-1), gguf.GGMLQuantizationType[info.type_name])
    shape = info.shape[:-1] + (1,)  # a row a value, whatever the row's bytes
    return np.arange(int(np.prod(shape)), dtype=np.float64).reshape(shape) + info.index * ROW_SPAN


def place_rows(model: nn.Module, checkpoint: CheckpointMap) -> list[MatmulPlan]:
    """Our matmuls whose every row the checkpoint fills, each with its rows (step 2): the model's
    own loader writes (row id, HF tensor number) pairs where it would write the weights."""
    matmuls = _matmul_modules(model)
    into = {f"{name}.weight": torch.full((module.weight.shape[0], 2), -1, dtype=torch.int64)
            for name, module in matmuls.items()}
    names = list(checkpoint.rows)
    pairs = ((name, torch.stack([ids, torch.full_like(ids, i)], dim=1))
             for i, (name, ids) in enumerate(checkpoint.rows.items()) if ids.dim() == 1)
    model.load_weights(pairs, into=into)
    plans = []
    for name, module in matmuls.items():
        table = into[f"{name}.weight"]
        if (table < 0).any():  # not every row from the file's 2-D tensors: loaded as values instead
            continue
        plans.append(MatmulPlan(name, table[:, 0].clone(), module.weight.shape[1],
                                {names[i] for i in table[:, 1].unique().tolist()}))
    return plans


def _matmul_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Our name -> module of each nn.Linear whose weight may stay in blocks, and the embedding;
    not MoE experts or fp32 routers, which their blocks' own code reads. A tied LM head is
    listed as the embedding (its one weight)."""
    excluded = [name for name, m in model.named_modules() if isinstance(m, MoEBlock) or getattr(m, "keeps_fp32", False)]
    is_tied = getattr(model.config, "tie_word_embeddings", False)
    found = {}
    for name, module in model.named_modules():
        if any(name == e or name.startswith(e + ".") for e in excluded):
            continue
        if (isinstance(module, nn.Linear) and not (is_tied and name == "lm_head")) or \
                (name == "embed_tokens" and isinstance(module, nn.Embedding)):
            found[name] = module
    return found


def _modules_of(model: nn.Module, plan: MatmulPlan) -> list[nn.Module]:
    """The modules whose weight `plan` makes: a tied embedding's is the LM head's too."""
    modules = [model.get_submodule(plan.name)]
    if plan.name == "embed_tokens" and model.config.tie_word_embeddings:
        modules.append(model.lm_head)
    return modules


def _fill_matmul(model: nn.Module, plan: MatmulPlan, file: GgufFile, dtype: torch.dtype, kernels) -> None:
    """Read the plan's rows from the file and put the GgufLinear or the weight in place (step 4)."""
    parts = []
    for index, rows in plan.runs():
        info = file.tensors[index]
        parts.append((info.type_name, _take_rows(read_tensor(file.path, info), rows)))
    module = model.get_submodule(plan.name)
    bias = module.bias.detach() if getattr(module, "bias", None) is not None else None
    made = gguf_linear_or_weight(parts, plan.in_features, dtype, bias, kernels if plan.keeps_blocks else None)
    del parts  # the blocks are the GgufLinear's now (or dequantized): free the file's bytes at once
    if isinstance(made, torch.Tensor):
        for target in _modules_of(model, plan):
            target.weight = nn.Parameter(made, requires_grad=False)
        return
    if plan.name != "embed_tokens":
        parent, _, child = plan.name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, made)
    elif model.config.tie_word_embeddings:  # one copy of the vocabulary: the head's, read by the embedding
        model.lm_head = made
        model.embed_tokens = kernels.embedding(made, dtype, is_shared=True)
    else:
        model.embed_tokens = kernels.embedding(made, dtype, is_shared=False)


def _gather_rows(file: GgufFile, row_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A checkpoint tensor of any shape from its row ids: each GGUF tensor it draws on read and
    dequantized once."""
    index = row_ids // ROW_SPAN
    out = None
    for tensor_index in index.unique().tolist():
        info = file.tensors[tensor_index]
        mask = index == tensor_index
        values = dequantize_rows(_take_rows(read_tensor(file.path, info), row_ids[mask] % ROW_SPAN),
                                 info.type_name, dtype)
        if out is None:
            out = torch.empty(*row_ids.shape, values.shape[1], dtype=dtype)
        out[mask] = values
    return out


def _take_rows(raw: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """raw's `rows`, without a copy where they are all of them in order."""
    if len(rows) == raw.shape[0] and torch.equal(rows, torch.arange(len(rows))):
        return raw
    return raw[rows]


def _checked_row_ids(ids: torch.Tensor, file: GgufFile, name: str) -> torch.Tensor:
    index, rows = ids // ROW_SPAN, ids % ROW_SPAN
    num_rows = torch.tensor([t.num_rows for t in file.tensors])
    if ids.numel() and (ids.min() < 0 or index.max() >= len(file.tensors) or (rows >= num_rows[index]).any()):
        raise ValueError(f"{file.path.name}: transformers' GGUF loader gave {name} rows that are not the file's")
    return ids


def _check_types(file: GgufFile, checkpoint: CheckpointMap, plans: list[MatmulPlan]) -> None:
    """Every tensor that is not kept in its blocks must be one the gguf package dequantizes."""
    dequantized = {i for plan in plans if not plan.keeps_blocks for i, _ in plan.runs()}
    consumed = set().union(*(plan.hf_names for plan in plans))
    for name, ids in checkpoint.rows.items():
        if name not in consumed:
            dequantized.update((ids // ROW_SPAN).unique().tolist())
    for index in sorted(dequantized):
        info = file.tensors[index]
        if not can_dequantize(info.type_name):
            raise ValueError(f"{file.path.name}: tensor {info.name} is quantized as {info.type_name}, which has "
                             "no kernel on this CPU and which the gguf package cannot dequantize")


def _check_memory(file: GgufFile, model: nn.Module, plans: list[MatmulPlan], dtype: torch.dtype,
                  reserve_bytes: int) -> None:
    """Refuse, before allocating, a model that does not fit in the memory left (MemAvailable)."""
    kept = sum(plan.block_bytes(file) for plan in plans if plan.keeps_blocks)
    dense = sum(len(plan.row_ids) * plan.in_features * dtype.itemsize for plan in plans if not plan.keeps_blocks)
    rest = sum(p.numel() * p.element_size() for p in model.parameters())  # the weights left on the model
    needed = kept + dense + rest + reserve_bytes
    available = available_memory_bytes()
    if needed > available:
        raise ValueError(
            f"{file.path.name} ({file.num_bytes / GB:.2f} GB) needs {needed / GB:.2f} GB of memory: "
            f"{kept / GB:.2f} GB of blocks kept as they are, {(dense + rest) / GB:.2f} GB dequantized to "
            f"{str(dtype).removeprefix('torch.')}, {reserve_bytes / GB:.2f} GB of KV pool; only "
            f"{available / GB:.2f} GB is available (MemAvailable)")


def _log_summary(file: GgufFile, plans: list[MatmulPlan], dtype: torch.dtype) -> None:
    kept = Counter("+".join(sorted(set(plan.type_names(file)))) for plan in plans if plan.keeps_blocks)
    dense = sum(not plan.keeps_blocks for plan in plans)
    logger.info("%s: %d matmuls in the file's blocks (%s), %d dequantized to %s", file.path.name,
                sum(kept.values()), ", ".join(f"{t} ×{n}" for t, n in sorted(kept.items())) or "no kernels",
                dense, str(dtype).removeprefix("torch."))
