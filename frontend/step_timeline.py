"""The occupancy strip's data: per engine core, the latest steps as (prefill, decode) columns.

Read off the `EngineOutputs` each core already sends once per step, so the core does
no work for it. The output pump calls `StepTimeline.record` before the outputs are
processed (while each request's state still says whether it had a token before):

    cell          what the frontend sees in that step's message
    decode        an output with tokens for a request that already had a token
    prefill       an output with the request's first token (its prefill ended here), or a
                  running request without an output: a prompt chunk still being computed

Messages that are no step are skipped: replies to aborts (outputs, none with tokens)
and idle heartbeats (nothing running, no outputs). Known blur: a preempted request's
recompute shows as decode, and a running request that the token budget left out of a
step as prefill. Good enough to watch batching; the exact per-step record is
`engine.engine_core.StepStats`, kept by offline runs.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Mapping, Protocol, Sequence

from ipc.messages import RequestOutput

MAX_STEPS_KEPT = 2048  # per core: a few screens of columns, a few tens of KB


class _HasFirstToken(Protocol):
    last_token_time: float | None  # frontend.request_state.RequestState: None until the first token


@dataclass(slots=True)
class StepColumn:
    step_index: int  # counts this core's recorded steps since the frontend started
    time: float  # time.monotonic() when the step's message arrived
    num_prefill: int
    num_decode: int
    num_tokens_out: int


class StepTimeline:
    """A bounded ring of recent step columns per engine core, and per-core token counts."""

    def __init__(self, num_engines: int = 1, max_steps: int = MAX_STEPS_KEPT):
        self.max_steps = max_steps
        self.steps: list[deque[StepColumn]] = []
        self.num_steps: list[int] = []
        self.num_tokens_out: list[int] = []
        self.resize(num_engines)

    def resize(self, num_engines: int) -> None:
        while len(self.steps) < num_engines:
            self.steps.append(deque(maxlen=self.max_steps))
            self.num_steps.append(0)
            self.num_tokens_out.append(0)

    def record(self, engine_index: int, outputs: Sequence[RequestOutput], num_running: int,
               states: Mapping[str, _HasFirstToken]) -> StepColumn | None:
        """Add the column for one `EngineOutputs`; None when the message was no step."""
        num_prefill = num_decode = num_tokens = num_still_running = 0
        for output in outputs:
            if not output.new_token_ids:
                continue
            num_tokens += len(output.new_token_ids)
            state = states.get(output.request_id)
            # No state: a stop string already ended it here, so it had tokens before.
            if state is None or state.last_token_time is not None:
                num_decode += 1
            else:
                num_prefill += 1
            if output.finish_reason is None:
                num_still_running += 1
        if num_tokens == 0 and (outputs or num_running == 0):
            return None
        num_prefill += max(0, num_running - num_still_running)
        column = StepColumn(self.num_steps[engine_index], time.monotonic(), num_prefill, num_decode, num_tokens)
        self.num_steps[engine_index] += 1
        self.num_tokens_out[engine_index] += num_tokens
        self.steps[engine_index].append(column)
        return column

    def columns_since(self, engine_index: int, step_index: int, limit: int) -> list[StepColumn]:
        """This core's columns from `step_index` on (at most the last `limit` of them)."""
        ring = self.steps[engine_index]
        num_new = min(self.num_steps[engine_index] - step_index, len(ring), limit)
        if num_new <= 0:
            return []
        return [ring[i] for i in range(len(ring) - num_new, len(ring))]
