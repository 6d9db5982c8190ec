"""What one engine step returns (vLLM's `EngineCoreOutputs`): the requests' deltas, and the
requests that failed by their own parameters, each with why.

An error travels with the step that found it, as a return value: the scheduler returns it
from `update` (constraints that leave no token) or `take_grammar_failures` (a grammar that
did not compile), `EngineCore.step` returns it, and the core process sends it as that
request's `EngineError`. Nobody keeps a list for another object to clear.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from ipc.messages import RequestOutput, StepCounts


class RequestError(NamedTuple):
    request_id: str
    message: str  # the client's to read: about its own request, never the engine's internals


@dataclass
class StepOutputs:
    outputs: list[RequestOutput] = field(default_factory=list)
    errors: list[RequestError] = field(default_factory=list)  # each also has its output, finish_reason ERROR
    step_counts: StepCounts | None = None  # the batch's prefill and decode shares, while EngineCore.count_steps

    def extend(self, other: StepOutputs) -> None:
        self.outputs.extend(other.outputs)
        self.errors.extend(other.errors)
