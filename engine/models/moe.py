"""The mixture-of-experts MLP (Mixtral, Qwen3-MoE): a router picks each token's top-k of
E SwiGLU experts, and the token's output is their outputs weighted by the router.

    x [T, hidden] ─► router (fp32) ─► softmax ─► top-k ─► (renormalise) ─► weights, ids [T, k]
                                                                             │
    T·k (token, expert) pairs, sorted by expert ◄────────────────────────────┘
      expert 0: its rows ─► gate_up ─► SiLU×up ─► down ─┐
      expert 3: its rows ─► ...                         ├─► × weight, added into its token's row
      (experts no token chose are skipped)              ┘

Each expert runs its matmuls on its own tokens only (a decode step of 64 sequences with
top-2 of 128 experts gives each chosen expert about one token): never a dense loop of
every expert over every token. The experts are plain SwiGLUMLP blocks, so the CPU set-up
(engine/cpu/fast_paths.py) prepacks (or slabs) their linears and fuses their SiLU×up
like any other MLP's. The grouping reads the per-expert counts on the host (one sync a
layer), so a MoE model's steps are not captured in CUDA graphs; compiled, the grouped
experts are one opaque op (`tokenloom::moe_experts`) for the same reason.

Under tensor parallelism every expert is split like a dense MLP (its intermediate size
across the ranks); the block sums its experts' partial outputs and all-reduces once.

References: Mixtral of Experts (Jiang et al., 2024); transformers' Qwen3MoeSparseMoeBlock
and MixtralSparseMoeBlock, whose routing this reproduces.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.parallel.parallel_state import NO_TP, TensorParallelGroup
from engine.models.config import MoEConfig
from engine.models.layers import SwiGLUMLP, silu_and_mul


class Router(nn.Module):
    """Router logits in fp32 from an fp32 weight: near-equal experts are not decided by bf16 rounding."""

    keeps_fp32 = True  # engine.models.load_model leaves this module's weight in fp32 at any serving dtype

    def __init__(self, hidden_size: int, num_experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight.float())  # [num_tokens, num_experts] fp32


class MoEBlock(nn.Module):
    def __init__(self, hidden_size: int, moe: MoEConfig, tp: TensorParallelGroup = NO_TP) -> None:
        super().__init__()
        self.tp = tp
        self.top_k = moe.num_experts_per_tok
        self.norm_topk_prob = moe.norm_topk_prob
        self.router = Router(hidden_size, moe.num_experts)
        # Each expert's down_proj is a plain (local) linear: the block all-reduces their sum once.
        self.experts = nn.ModuleList(SwiGLUMLP(hidden_size, moe.intermediate_size // tp.size)
                                     for _ in range(moe.num_experts))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's experts and their weights: ([num_tokens, top_k] fp32, [num_tokens, top_k] int64)."""
        probs = torch.softmax(self.router(x), dim=-1)  # [num_tokens, num_experts] fp32
        weights, expert_ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, expert_ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, hidden_size] -> [num_tokens, hidden_size]
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("MoE layers group tokens by expert on the host; their steps cannot be CUDA graphs")
        weights, expert_ids = self.route(x)
        if torch.compiler.is_compiling():
            out = torch.ops.tokenloom.moe_experts(
                x, weights, expert_ids,
                [e.gate_up_proj.weight for e in self.experts], [e.down_proj.weight for e in self.experts],
            )
        else:
            out = grouped_experts(x, weights, expert_ids, len(self.experts), lambda e, rows: self.experts[e](rows))
        return out if self.tp.size == 1 else self.tp.all_reduce(out)


def grouped_experts(
    x: torch.Tensor,  # [num_tokens, hidden_size]
    weights: torch.Tensor,  # [num_tokens, top_k] fp32
    expert_ids: torch.Tensor,  # [num_tokens, top_k] int64
    num_experts: int,
    run_expert: Callable[[int, torch.Tensor], torch.Tensor],  # (expert, [n, hidden_size]) -> [n, hidden_size]
) -> torch.Tensor:  # [num_tokens, hidden_size]
    """Sum over each token's experts of weight × expert(token), each expert run once on its own rows.

    Experts are visited in id order and add into the output in that order, as transformers does."""
    top_k = expert_ids.shape[1]
    flat_ids = expert_ids.flatten()  # [num_tokens * top_k]: pair i is token i // top_k
    order = torch.argsort(flat_ids, stable=True)  # the pairs grouped by expert, tokens ascending within each
    counts = torch.bincount(flat_ids, minlength=num_experts).tolist()  # the layer's one host sync
    token_rows = order // top_k  # [num_pairs] each sorted pair's token
    sorted_x = x[token_rows]  # [num_pairs, hidden_size]: one gather; each expert reads a contiguous slice
    sorted_weights = weights.flatten()[order].unsqueeze(1)  # [num_pairs, 1] fp32
    out = torch.zeros_like(x)
    start = 0
    for expert, num_rows in enumerate(counts):
        if num_rows == 0:
            continue
        end = start + num_rows
        expert_out = run_expert(expert, sorted_x[start:end])  # [num_rows, hidden_size]
        out.index_add_(0, token_rows[start:end], (expert_out * sorted_weights[start:end]).to(x.dtype))
        start = end
    return out


@torch.library.custom_op("tokenloom::moe_experts", mutates_args=())
def moe_experts(
    x: torch.Tensor,  # [num_tokens, hidden_size]
    weights: torch.Tensor,  # [num_tokens, top_k] fp32
    expert_ids: torch.Tensor,  # [num_tokens, top_k] int64
    gate_up_weights: list[torch.Tensor],  # per expert [2 * intermediate, hidden_size]
    down_weights: list[torch.Tensor],  # per expert [hidden_size, intermediate]
) -> torch.Tensor:
    """The compiled path's grouped experts: data-dependent shapes stay out of the graph."""
    def run_expert(expert: int, rows: torch.Tensor) -> torch.Tensor:
        return F.linear(silu_and_mul(F.linear(rows, gate_up_weights[expert])), down_weights[expert])

    return grouped_experts(x, weights, expert_ids, len(gate_up_weights), run_expert)


@moe_experts.register_fake
def _(x, weights, expert_ids, gate_up_weights, down_weights):
    return torch.empty_like(x)
