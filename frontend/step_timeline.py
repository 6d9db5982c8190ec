"""The occupancy strip's data: per engine core, the latest steps as (prefill, decode) columns.

Each column is the scheduler's own count of the step's batch (`EngineOutputs.step_counts`):
the requests that prefilled (prompt chunks, a preempted request's recompute) and those that
decoded. The cores count only while a dashboard watches: the first feed to open sends every
core `WatchSteps(True)`, the last to close `WatchSteps(False)` (`AsyncEngineClient.watch_steps`),
so with no dashboard open neither side does any work for the strip.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Sequence

from ipc.messages import RequestOutput, StepCounts

MAX_STEPS_KEPT = 2048  # per core: a few screens of columns, a few tens of KB


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
        self.num_watchers = 0  # open dashboard feeds
        self.resize(num_engines)

    def resize(self, num_engines: int) -> None:
        while len(self.steps) < num_engines:
            self.steps.append(deque(maxlen=self.max_steps))
            self.num_steps.append(0)
            self.num_tokens_out.append(0)

    def watch(self, is_on: bool) -> bool:
        """A dashboard opened (or closed); True when that starts or ends the watching."""
        was_watched = self.is_watched
        self.num_watchers += 1 if is_on else -1
        return self.is_watched != was_watched

    @property
    def is_watched(self) -> bool:
        return self.num_watchers > 0

    def record(self, engine_index: int, counts: StepCounts, outputs: Sequence[RequestOutput]) -> StepColumn:
        """Add the column for one step's `EngineOutputs` (one that carries its counts)."""
        num_tokens = sum(len(output.new_token_ids) for output in outputs)
        column = StepColumn(self.num_steps[engine_index], time.monotonic(), counts.num_prefill_requests,
                            counts.num_decode_requests, num_tokens)
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
