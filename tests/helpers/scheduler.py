"""Scheduler test helpers with no tensors and no model (STYLE.md item 12): request and
scheduler factories and a fake model step.

The fake step feeds `Scheduler.update` one SampledToken for each scheduled request
that reached the end of its sequence (`is_sampling`). By default the token is 100 +
the request's output index, so outputs are distinct and a recomputation after
preemption that re-sampled or lost tokens would show.
"""

from __future__ import annotations

from typing import Callable

from engine.core.block_manager import BlockManager
from engine.core.request import Request
from engine.core.scheduler import SampledToken, Scheduler, SchedulerOutput
from engine.baselines.static_scheduler import StaticScheduler
from ipc.messages import RequestOutput
from ipc.sampling_params import SamplingParams

EOS = 0
PROMPT_TOKEN = 5


def make_request(
    request_id: str,
    num_prompt_tokens: int,
    max_tokens: int = 16,
    min_tokens: int = 0,
    ignore_eos: bool = False,
    stop_token_ids: list[int] | None = None,
) -> Request:
    params = SamplingParams(
        temperature=0.0,
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        ignore_eos=ignore_eos,
        stop_token_ids=list(stop_token_ids or []),
    )
    return Request(request_id, [PROMPT_TOKEN] * num_prompt_tokens, params, max_tokens=max_tokens, arrival_time=0.0)


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    max_model_len: int | None = None,
    static: bool = False,
) -> Scheduler:
    scheduler_class = StaticScheduler if static else Scheduler
    return scheduler_class(
        BlockManager(num_blocks, block_size),
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len or num_blocks * block_size,
        eos_token_ids=[EOS],
    )


def next_output_token(request: Request) -> int:
    return 100 + request.num_output_tokens


def step(
    scheduler: Scheduler, token_for: Callable[[Request], int] = next_output_token
) -> tuple[SchedulerOutput, list[RequestOutput]]:
    """One engine step with a fake model: schedule, sample for every request at its end, update."""
    output = scheduler.schedule()
    # is_sampling reads num_computed_tokens, which update() advances: decide first.
    sampled = {s.request.request_id: SampledToken(token_for(s.request)) for s in output.scheduled if s.is_sampling}
    return output, scheduler.update(output, sampled).outputs


def scheduled(output: SchedulerOutput) -> dict[str, int]:
    return {s.request.request_id: s.num_new_tokens for s in output.scheduled}


def sampling(output: SchedulerOutput) -> set[str]:
    """Ids whose scheduled tokens reach the end of the sequence. Only meaningful before update()."""
    return {s.request.request_id for s in output.scheduled if s.is_sampling}


def run_to_completion(scheduler: Scheduler, max_steps: int = 1000, **step_kwargs) -> int:
    for num_steps in range(1, max_steps + 1):
        step(scheduler, **step_kwargs)
        if not scheduler.has_unfinished_requests():
            return num_steps
    raise AssertionError(f"not finished after {max_steps} steps: {scheduler.running} {list(scheduler.waiting)}")


def assert_pool_free(scheduler: Scheduler) -> None:
    manager = scheduler.block_manager
    assert manager.num_free_blocks == manager.num_blocks
    assert sorted(manager.free_block_ids) == list(range(manager.num_blocks))
    assert not any(manager.ref_counts)


def emit(token_id: int) -> Callable[[Request], int]:
    return lambda request: token_id
