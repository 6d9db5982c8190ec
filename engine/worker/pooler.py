"""Pooling: an embedding request's final hidden states into one vector (the engine side of
ipc.pooling_params).

An embedding request is scheduled exactly like a generation request's prompt: chunked
prefill, mixed into the same steps, through the paged KV cache. It never samples
(`ScheduledRequest.is_sampling` is False for it). Instead, per chunk, the model runner
asks `positions_to_pool` which of the chunk's rows it needs; those rows' final hidden
states (after the final norm, where the LM head would read them) leave the model after
the sampled rows, and `collect` pools them:

    LAST  the last prompt token's state, taken at the last chunk (vLLM's default for
          decoder models: in a causal model only that state has seen the whole text)
    MEAN  every prompt position's state, summed chunk by chunk in fp32, divided at the end;
          such requests skip the prefix cache (Scheduler._lookup) so every position runs

then L2-normalizes the vector (unless asked not to) and leaves it on the request; the
scheduler's update finishes the request in that same step, freeing its blocks. A
preempted request is recomputed from position 0, so a chunk that starts at 0 starts
its sum afresh.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.core.block_manager import num_blocks_for
from engine.core.request import Request
from ipc.engine_config import EngineConfig
from ipc.pooling_params import POOLING_SAMPLING_PARAMS, PoolingParams, PoolingType, needs_every_position
from ipc.sampling_params import SamplingParams


@dataclass
class PoolingRows:
    """One request's share of a step: pooled rows [first_row, first_row + num_rows) are its
    prompt positions start .. start + num_rows - 1."""

    request: Request
    first_row: int
    start: int
    num_rows: int


def positions_to_pool(request: Request, start: int, end: int) -> range:
    """The positions of this chunk [start, end) whose final hidden states the request needs."""
    if needs_every_position(request.pooling_params):
        return range(start, end)
    return range(end - 1, end) if end == request.num_tokens else range(0)


def plan_pooling(scheduled_requests) -> tuple[list[int], list[PoolingRows]]:
    """The step's pooled rows (indices into its flat batch, request by request, as the runner
    lays them out) and one plan per request that has rows among them."""
    rows: list[int] = []
    plans: list[PoolingRows] = []
    first_row_of_request = 0
    for scheduled in scheduled_requests:
        request = scheduled.request
        start = request.num_computed_tokens
        if request.pooling_params is not None:
            positions = positions_to_pool(request, start, start + scheduled.num_new_tokens)
            if positions:
                plans.append(PoolingRows(request, len(rows), positions.start, len(positions)))
                rows.extend(first_row_of_request + p - start for p in positions)
        first_row_of_request += scheduled.num_new_tokens
    return rows, plans


class Pooler:
    """Mean pooling's running sums across chunks, and the pooling itself."""

    def __init__(self) -> None:
        self._sums: dict[str, torch.Tensor] = {}  # request id -> [hidden_size] fp32, positions so far

    def collect(self, hidden: torch.Tensor, plans: list[PoolingRows]) -> None:
        """Pool each plan's rows of `hidden` ([num_pooled_rows, hidden_size]); a request whose
        prompt is now complete gets its vector in `request.embedding`."""
        for plan in plans:
            request = plan.request
            params = request.pooling_params
            rows = hidden[plan.first_row : plan.first_row + plan.num_rows].float()  # [num_rows, hidden_size]
            is_complete = plan.start + plan.num_rows == request.num_tokens
            if params.pooling_type == PoolingType.MEAN:
                total = rows.sum(dim=0)  # [hidden_size]
                earlier = self._sums.pop(request.request_id, None)
                if plan.start > 0:  # a chunk at 0 is the first, or a recomputation after a preemption
                    total += earlier
                if not is_complete:
                    self._sums[request.request_id] = total
                    continue
                vector = total / request.num_tokens  # [hidden_size]
            else:
                vector = rows[-1]  # [hidden_size]
            if params.normalize:
                vector = torch.nn.functional.normalize(vector, dim=0)
            request.embedding = vector.tolist()

    def release(self, request_id: str) -> None:
        self._sums.pop(request_id, None)


def check_pooling_request(config: EngineConfig, pooling_params: PoolingParams | None,
                          sampling_params: SamplingParams) -> SamplingParams:
    """The sampling params an engine with `config` runs the request under; ValueError (naming
    why) for a request this engine cannot serve."""
    if pooling_params is None:
        if config.runner == "pooling":
            raise ValueError("this server runs --runner pooling: it serves embeddings only (/v1/embeddings, "
                             "LLM.embed), not generation")
        return sampling_params
    if config.batching == "static-padded":
        raise ValueError("embeddings are not served with batching static-padded (the padded baseline)")
    if config.pipeline_parallel_size > 1:  # the last stage holds the hidden states; pooling reads them on rank 0
        raise ValueError("embeddings are not served with --pipeline-parallel-size > 1")
    pooling_params.validate()
    return POOLING_SAMPLING_PARAMS


def pooling_num_kv_blocks(config: EngineConfig, max_model_len: int) -> int:
    """`--runner pooling`'s pool: nothing outlives its prompt's step, so enough for one step's
    prefills (max_num_batched_tokens over up to max_num_seqs sequences, each with a partly
    filled last block) and for one longest prompt, whose chunks keep their KV until its last."""
    num_tokens = max(config.max_num_batched_tokens, max_model_len)
    return num_blocks_for(num_tokens, config.block_size) + config.max_num_seqs
