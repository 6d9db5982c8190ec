"""Pipeline parallelism: the decoder's layers split into consecutive stages, one step's
activations passed from stage to stage (`--pipeline-parallel-size`).

    ranks    stage s holds ranks s * TP ... (s + 1) * TP - 1, a tensor-parallel group of its own;
             rank 0 (the engine core) is stage 0's first
    stage 0  embed, its layers ──(hidden, residual)──► stage 1 ──► ... ──► last stage
    last     its layers, the final norm, the LM head; its first rank sends the sampled rows'
             logits back to rank 0, which samples

Each rank of a stage sends to the rank of the same TP place in the next stage (after the
all-reduces every TP rank holds the whole hidden state). The sends are gloo's (NCCL's on
CUDA) point-to-point ops on one process group of every rank. Every rank builds the same
StepInputs tensors, so each knows the shapes it receives. Stages run one after another
within a step (no overlap between steps yet): PP saves memory and crosses slow links
with one [num_tokens, hidden] hand-off per stage instead of TP's two all-reduces a layer.

Every stage holds the embedding, the final norm and the LM head (small beside the layers;
a tied head needs the embedding anyway); only its own layers and their KV cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from engine.parallel.peer_wait import run_with_peers

SEND_TAG = 0


@dataclass(frozen=True)
class PipelineStage:
    """This rank's stage. The default is the whole model, one stage: no pipeline."""

    index: int = 0
    size: int = 1
    tp_rank: int = 0  # this rank's place in its stage's tensor-parallel group
    tp_size: int = 1
    process_group: object = None  # every rank's group, for the sends between stages
    check_alive: Callable[[], None] | None = field(default=None, compare=False)  # rank 0's (peer_wait)

    @property
    def is_pipelined(self) -> bool:
        return self.size > 1

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.size - 1

    def layers(self, num_layers: int) -> range:
        """This stage's layers: consecutive, as even a share as the count allows."""
        return range(self.index * num_layers // self.size, (self.index + 1) * num_layers // self.size)

    def holds(self, layer_index: int, num_layers: int) -> bool:
        return layer_index in self.layers(num_layers)

    def rank_of(self, stage_index: int, tp_rank: int | None = None) -> int:
        """The global rank at `tp_rank` (default: this rank's) in stage `stage_index`."""
        return stage_index * self.tp_size + (self.tp_rank if tp_rank is None else tp_rank)

    def send(self, tensors: list[torch.Tensor], rank: int) -> None:
        def transfer() -> None:
            for tensor in tensors:  # one after another: the receiver posts its recvs in this order
                self.process_group.send([tensor.contiguous()], rank, SEND_TAG).wait()

        run_with_peers(transfer, self.check_alive)  # for as long as the next stage takes to receive

    def recv(self, tensors: list[torch.Tensor], rank: int) -> None:
        def transfer() -> None:
            for tensor in tensors:
                self.process_group.recv([tensor], rank, SEND_TAG).wait()

        run_with_peers(transfer, self.check_alive)  # for as long as the previous stages take


WHOLE_MODEL = PipelineStage()


def check_pipeline_parallel(num_layers: int, size: int) -> None:
    if size < 1:
        raise ValueError("pipeline_parallel_size must be at least 1")
    if num_layers < size:
        raise ValueError(f"pipeline_parallel_size={size} does not fit this model: {num_layers} layers "
                         f"cannot make {size} stages")


def forward_stage(model, stage: PipelineStage, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches,
                  backend, sample_rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """This rank's part of one step: receive, run this stage's layers, send on. Rank 0 returns the
    sampled rows' logits [num_sampled, vocab_size] (None when none are sampled); others None."""
    num_tokens, num_sampled = input_ids.shape[0], sample_rows.shape[0]
    carried = None
    if not stage.is_first:
        hidden = torch.empty(num_tokens, model.config.hidden_size, dtype=dtype, device=input_ids.device)
        residual = torch.empty_like(hidden)  # [num_tokens, hidden_size]
        stage.recv([hidden, residual], stage.rank_of(stage.index - 1))
        carried = (hidden, residual)
    every_row = num_sampled in (0, num_tokens)  # as ModelRunner.forward_step: never a zero-row matmul
    out = model(input_ids, positions, kv_caches, backend, None if every_row else sample_rows, carried=carried)
    if not stage.is_last:
        stage.send(list(out), stage.rank_of(stage.index + 1))  # (hidden, residual), [num_tokens, hidden_size]
        out = None
    if num_sampled == 0:
        return None
    is_rank_0 = stage.is_first and stage.tp_rank == 0
    logits = model.compute_logits(out) if stage.is_last else None  # on the last stage's first TP rank
    if stage.is_last and stage.tp_rank == 0 and not is_rank_0:
        stage.send([logits], 0)
    elif is_rank_0 and not stage.is_last:
        logits = torch.empty(num_sampled, model.config.vocab_size, dtype=dtype, device=input_ids.device)
        stage.recv([logits], stage.rank_of(stage.size - 1, tp_rank=0))
    return logits if is_rank_0 else None
