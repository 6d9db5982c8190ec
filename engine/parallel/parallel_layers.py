"""The layers that split a decoder across tensor-parallel ranks (Megatron-LM's scheme).

    hidden ──► qkv_proj, gate_up_proj   column-parallel: each rank computes its own heads'
               │                        (its slice of the intermediate size's) outputs; no talk
               ▼
             attention, SiLU × up       per rank, on that rank's heads
               │
               ▼
             o_proj, down_proj          row-parallel: each rank's partial sum, then an all-reduce
               │
               ▼
             hidden (the same on every rank)

The embedding and the LM head are vocab-parallel: each rank holds ceil(vocab / N)
rows (the last padded with zeros). The embedding zeroes the ids outside its rows
and all-reduces; the LM head's logits are gathered on rank 0, which samples.
KV heads are split like query heads, or replicated when there are fewer KV heads
than ranks (each rank then keeps the one KV head its query heads read). Per-head q/k
norms and MoE routers are replicated; each MoE expert is split like a dense MLP.

Column-parallel layers are plain `nn.Linear`s of the local size, so the CPU
prepacking swaps them like any other; at TP = 1 every factory here returns the
plain module, so that path is exactly the single-process one.

Each rank reads only its shard of each checkpoint tensor (`shard_checkpoint_tensor`,
`shard_rows` for one part of a fused tensor such as Phi-3's qkv_proj, through
safetensors' lazy slices).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from engine.parallel.parallel_state import TensorParallelGroup

if TYPE_CHECKING:  # engine.models imports this module
    from engine.models.config import ModelConfig


def check_tensor_parallel(config: ModelConfig, size: int) -> None:
    """Refuse, before any process starts, a model that does not split `size` ways."""
    if size < 1:
        raise ValueError("tensor_parallel_size must be at least 1")
    problems = []
    if config.num_heads % size:
        problems.append(f"{config.num_heads} attention heads are not divisible by {size}")
    kv = config.num_kv_heads
    if (kv >= size and kv % size) or (kv < size and size % kv):
        problems.append(f"{kv} KV heads neither divide among {size} ranks nor replicate evenly over them")
    if config.intermediate_size % size:
        problems.append(f"intermediate size {config.intermediate_size} is not divisible by {size}")
    if config.moe is not None and config.moe.intermediate_size % size:
        problems.append(f"expert intermediate size {config.moe.intermediate_size} is not divisible by {size}")
    if problems:
        raise ValueError(f"tensor_parallel_size={size} does not fit this model: {'; '.join(problems)}")


def num_local_kv_heads(num_kv_heads: int, size: int) -> int:
    return max(1, num_kv_heads // size)


def vocab_rows_per_rank(vocab_size: int, size: int) -> int:
    return -(-vocab_size // size)


def vocab_parallel_embedding(vocab_size: int, hidden_size: int, tp: TensorParallelGroup) -> nn.Module:
    if tp.size == 1:
        return nn.Embedding(vocab_size, hidden_size)
    return VocabParallelEmbedding(vocab_size, hidden_size, tp)


def row_parallel_linear(local_in_features: int, out_features: int, tp: TensorParallelGroup) -> nn.Module:
    if tp.size == 1:
        return nn.Linear(local_in_features, out_features, bias=False)
    return RowParallelLinear(local_in_features, out_features, tp)


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallelGroup) -> None:
        super().__init__()
        self.tp = tp
        self.num_rows = vocab_rows_per_rank(vocab_size, tp.size)
        self.first_row = tp.rank * self.num_rows
        self.weight = nn.Parameter(torch.empty(self.num_rows, hidden_size))  # this rank's rows, zero-padded

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local_ids = input_ids - self.first_row  # [num_tokens]
        is_elsewhere = (local_ids < 0) | (local_ids >= self.num_rows)
        hidden = F.embedding(local_ids.masked_fill(is_elsewhere, 0), self.weight)  # [num_tokens, hidden_size]
        hidden.masked_fill_(is_elsewhere.unsqueeze(1), 0.0)
        return self.tp.all_reduce(hidden)


class RowParallelLinear(nn.Module):
    """y = x_local @ W_local^T, summed over the ranks; no bias (o_proj and down_proj have none).

    Not an `nn.Linear`, so that CPU prepacking leaves the all-reduce in place: engine/cpu/
    packs the matmul alone (into `packed`)."""

    def __init__(self, local_in_features: int, out_features: int, tp: TensorParallelGroup) -> None:
        super().__init__()
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(out_features, local_in_features))  # [out_features, in_features / N]
        self.packed = None  # a packed or quantized matmul set by engine/cpu/fast_paths.py

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, in_features / N] -> [num_tokens, out_features]
        partial = self.packed(x) if self.packed is not None else F.linear(x, self.weight)
        return self.tp.all_reduce(partial)


ROW_PARTS = ("q", "k", "v", "gate", "up")  # the parts a column-parallel weight's rows hold


def shard_checkpoint_tensor(name: str, tensor, config: ModelConfig, tp: TensorParallelGroup) -> torch.Tensor:
    """This rank's part of the checkpoint tensor `name` (a Hugging Face name, or ours). `tensor` may be
    a safetensors slice, so only the part is read. A fused tensor (qkv_proj, gate_up_proj) holds
    several parts: shard each with `shard_rows`."""
    if "qkv_proj" in name or "gate_up_proj" in name:
        raise ValueError(f"{name} holds several parts; shard each with shard_rows")
    for part in ROW_PARTS:
        if f"{part}_proj" in name:
            return shard_rows(part, tensor, 0, _shape(tensor)[0], config, tp)
    if "o_proj" in name or "down_proj" in name:
        return _chunk(tensor, 1, tp.rank, tp.size)
    if "embed_tokens" in name or "lm_head" in name:
        rows = vocab_rows_per_rank(config.vocab_size, tp.size)
        part = tensor[tp.rank * rows : min((tp.rank + 1) * rows, config.vocab_size)]
        return torch.cat([part, part.new_zeros(rows - part.shape[0], part.shape[1])]) if part.shape[0] < rows else part
    return tensor[:]  # norms, routers: every rank holds them whole


def shard_rows(part: str, tensor, start: int, num_rows: int, config: ModelConfig,
               tp: TensorParallelGroup) -> torch.Tensor:
    """This rank's rows of one part ("q", "k", "v", "gate" or "up") of a column-parallel weight
    (or bias): the part is rows [start, start + num_rows) of `tensor`, which may hold others too
    (Phi-3's fused qkv_proj and gate_up_proj)."""
    rank, size = tp.rank, tp.size
    if part in ("k", "v") and config.num_kv_heads < size:
        head = rank * config.num_kv_heads // size  # the KV head this rank's query heads read
        return tensor[start + head * config.head_dim : start + (head + 1) * config.head_dim]
    length = num_rows // size
    return tensor[start + rank * length : start + (rank + 1) * length]


def _chunk(tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    length = _shape(tensor)[dim] // size
    if dim == 0:
        return tensor[rank * length : (rank + 1) * length]
    return tensor[:, rank * length : (rank + 1) * length]


def _shape(tensor) -> list[int]:
    return list(tensor.shape) if isinstance(tensor, torch.Tensor) else tensor.get_shape()
