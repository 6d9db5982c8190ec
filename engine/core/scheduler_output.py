"""What the scheduler hands the model runner each step, what comes back, and what the step returns.

`SchedulerOutput` is one flat batch of (request, num_new_tokens) pairs (engine.core.scheduler
explains how it is chosen); `SampledToken` is a request's new token from the runner,
with the proposed tokens it accepted before it.

`StepOutputs` is what one engine step returns (vLLM's `EngineCoreOutputs`): the requests'
deltas, and the requests that failed by their own parameters, each with why. An error
travels with the step that found it, as a return value: the scheduler returns it from
`update` (constraints that leave no token) or `take_grammar_failures` (a grammar that did
not compile), `EngineCore.step` returns it, and the core process sends it as that request's
`EngineError`. Nobody keeps a list for another object to clear.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from engine.core.request import Request
from engine.core.step_stats import StepStats
from ipc.messages import RequestOutput, SpecMethod, StepCounts, TokenLogprobs


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # proposed tokens included
    spec_token_ids: list[int] = field(default_factory=list)  # proposed tokens computed after the last one

    @property
    def is_sampling(self) -> bool:
        """True when this step computes the request's last token, so it yields a new one
        (an embedding request's last chunk yields its vector instead: engine.worker.pooler)."""
        num_real_tokens = self.num_new_tokens - len(self.spec_token_ids)  # proposed tokens come after it
        return (self.request.num_computed_tokens + num_real_tokens == self.request.num_tokens
                and self.request.pooling_params is None)

    @property
    def is_decode(self) -> bool:
        """One token after the request's earlier outputs (and any proposed tokens): not a prefill."""
        request = self.request
        return (self.num_new_tokens - len(self.spec_token_ids) == 1 and request.num_output_tokens > 0
                and request.num_computed_tokens + 1 == request.num_tokens)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_preempted: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    def counts(self) -> StepCounts:
        """The step's prefill and decode shares, exact. Read before `Scheduler.update` advances the
        computed counts. A decode computes one token after earlier outputs (and its proposed
        tokens); everything else (prompt chunks, a preempted request's recompute) is prefill."""
        counts = StepCounts()
        for s in self.scheduled:
            if s.is_decode:
                counts.num_decode_requests += 1
                counts.num_decode_tokens += s.num_new_tokens
            else:
                counts.num_prefill_requests += 1
                counts.num_prefill_tokens += s.num_new_tokens
        return counts

    def step_stats(self, **fields) -> StepStats:
        """The step's record (engine.core.step_stats); a baseline's output adds its own fields."""
        return StepStats(**fields)


@dataclass
class SampledToken:
    token_id: int
    logprobs: TokenLogprobs | None = None
    prompt_logprobs: list[TokenLogprobs] | None = None  # with a request's first token, if it asked
    # Speculative decoding: the proposed tokens accepted before this one (which ends the step's tokens)
    accepted: list[SampledToken] = field(default_factory=list)


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


def emitted_tokens(token: SampledToken) -> list[SampledToken]:
    """A step's tokens for one request, in order: the accepted proposed ones, then the sampled one."""
    return [*token.accepted, token] if token.accepted else [token]


def make_output(request: Request, new_tokens: list[SampledToken], prompt_logprobs, num_proposed: int,
                num_accepted: int) -> RequestOutput:
    """The step's delta for `request`: its new tokens and, for a prediction's draft, what was kept of it."""
    output = RequestOutput(
        request_id=request.request_id,
        new_token_ids=[t.token_id for t in new_tokens],
        finish_reason=request.status.finish_reason,
        new_logprobs=[t.logprobs for t in new_tokens] if new_tokens[0].logprobs is not None else None,
        stop_token_id=request.stop_token_id,
        num_cached_tokens=request.num_cached_tokens,
        prompt_logprobs=prompt_logprobs,
    )
    if num_proposed and request.spec_method == SpecMethod.PREDICTION:
        output.num_accepted_prediction_tokens = num_accepted
        output.num_rejected_prediction_tokens = num_proposed - num_accepted
    return output
