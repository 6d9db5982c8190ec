"""A model runner that does no math: it prices the step and hands every sequence that
reached its end one token.

The token is a fixed id that is no EOS, so a request ends exactly as in the benchmarks
(`ignore_eos` with `max_tokens`): by length, after its requested number of tokens.
"""

from __future__ import annotations

from engine.core.scheduler_output import SampledToken, SchedulerOutput
from engine.simulator.step_cost import StepCost, StepCostModel, StepShape

FIRST_SAFE_TOKEN_ID = 100  # as scripts/lib/workload.py: clear of the special tokens


class SimulatedRunner:
    def __init__(self, cost_model: StepCostModel) -> None:
        self.cost_model = cost_model
        eos_ids = set(cost_model.shape.eos_token_ids)
        self.token = SampledToken(next(t for t in range(FIRST_SAFE_TOKEN_ID, cost_model.shape.vocab_size)
                                       if t not in eos_ids))

    def execute(self, scheduler_output: SchedulerOutput) -> tuple[dict[str, SampledToken], StepShape, StepCost]:
        """The step's sampled tokens, its shape and its price; call before `Scheduler.update`,
        as the real runner (both read the computed counts that update advances)."""
        shape = StepShape.of(scheduler_output)
        sampled = {s.request.request_id: self.token for s in scheduler_output.scheduled if s.is_sampling}
        return sampled, shape, self.cost_model.price(shape)
