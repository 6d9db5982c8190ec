"""The scheduler with structured-output requests, on plain objects: a request whose grammar
compiles waits and keeps its place while the others step; a failed or overdue compile and
a rejected token fail that request alone; a terminated grammar finishes with stop."""

from __future__ import annotations

from concurrent.futures import Future

from engine.core.request import RequestStatus
from engine.core.scheduler import CONTRADICTION_MESSAGE, SampledToken
from engine.structured_output import RequestGrammar
from ipc.messages import FinishReason
from tests.helpers.scheduler import make_request, make_scheduler, scheduled, step


class FakeMatcher:
    """Accepts the tokens in `allowed` and terminates after `num_tokens` of them."""

    def __init__(self, num_tokens: int, allowed=range(100, 200)):
        self.num_tokens = num_tokens
        self.allowed = set(allowed)
        self.num_accepted = 0

    def accept_token(self, token_id: int) -> bool:
        if token_id not in self.allowed:
            return False
        self.num_accepted += 1
        return True

    def is_terminated(self) -> bool:
        return self.num_accepted >= self.num_tokens


def grammar_request(request_id: str, future: Future, matcher: FakeMatcher | None = None, timeout_s: float = 30.0):
    request = make_request(request_id, 4)
    request.grammar = RequestGrammar(future, timeout_s)
    if matcher is not None:
        request.grammar.matcher = matcher
    return request


def test_a_compiling_request_waits_in_place_while_others_step():
    scheduler = make_scheduler()
    future = Future()
    scheduler.add_request(grammar_request("g", future))
    scheduler.add_request(make_request("a", 4))
    assert scheduler.has_schedulable_requests()
    output, _ = step(scheduler)
    assert scheduled(output) == {"a": 4}  # "g" passed over, "a" runs
    assert [r.request_id for r in scheduler.waiting] == ["g"]
    scheduler.add_request(make_request("b", 4))
    assert scheduled(step(scheduler)[0]) == {"a": 1, "b": 4}
    future.set_result("compiled")  # RequestGrammar builds its matcher from the result: give it one directly
    scheduler.waiting[0].grammar.matcher = FakeMatcher(3)
    assert scheduled(step(scheduler)[0]) == {"a": 1, "b": 1, "g": 4}


def test_only_compiling_requests_means_nothing_schedulable():
    scheduler = make_scheduler()
    scheduler.add_request(grammar_request("g", Future()))
    assert scheduler.has_unfinished_requests() and not scheduler.has_schedulable_requests()
    assert step(scheduler)[0].is_empty


def test_a_failed_or_overdue_compile_fails_that_request_alone():
    scheduler = make_scheduler()
    failed = Future()
    failed.set_exception(RuntimeError("Unsupported type"))
    scheduler.add_request(grammar_request("bad", failed))
    scheduler.add_request(grammar_request("slow", Future(), timeout_s=0.0))
    scheduler.add_request(make_request("a", 4))
    failed = scheduler.take_grammar_failures()
    reasons = dict(failed.errors)
    assert set(reasons) == {"bad", "slow"} == {output.request_id for output in failed.outputs}
    assert "Unsupported type" in reasons["bad"] and "did not compile within" in reasons["slow"]
    assert all(output.finish_reason == FinishReason.ERROR for output in failed.outputs)
    assert scheduled(step(scheduler)[0]) == {"a": 4}
    assert not scheduler.compiling and scheduler.block_manager.num_used_blocks == 1


def test_a_rejected_token_fails_the_request_and_termination_stops_it():
    scheduler = make_scheduler()
    done = Future()
    done.set_result(None)
    scheduler.add_request(grammar_request("ends", done, FakeMatcher(2)))
    scheduler.add_request(grammar_request("rejects", done, FakeMatcher(5, allowed=[100])))
    _, outputs = step(scheduler)  # prefill: tokens 100 for both
    assert all(o.finish_reason is None for o in outputs)
    output = scheduler.schedule()  # token 101: "ends" terminates, "rejects" refuses it
    results = scheduler.update(output, {s.request.request_id: SampledToken(101) for s in output.scheduled})
    reasons = {o.request_id: o.finish_reason for o in results.outputs}
    assert reasons == {"ends": FinishReason.STOP, "rejects": FinishReason.ERROR}
    assert results.errors == [("rejects", CONTRADICTION_MESSAGE)]  # returned with the step, the reason for its client
    assert not scheduler.has_unfinished_requests() and scheduler.block_manager.num_used_blocks == 0


def test_matcher_state_survives_preemption():
    """Preemption recomputes the KV but appends no token, so the matcher is not advanced again."""
    scheduler = make_scheduler(num_blocks=4, block_size=4, max_num_batched_tokens=16)
    done = Future()
    done.set_result(None)
    matcher = FakeMatcher(100)
    request = grammar_request("g", done, matcher)
    scheduler.add_request(request)
    scheduler.add_request(make_request("a", 8))
    while scheduler.has_unfinished_requests():
        step(scheduler)
    assert scheduler.num_preemptions > 0
    assert matcher.num_accepted == request.num_output_tokens == 12  # up to the 16-token context
    assert request.status == RequestStatus.FINISHED_LENGTH


def test_static_batching_passes_over_a_compiling_request_too():
    scheduler = make_scheduler(static=True)
    future = Future()
    scheduler.add_request(grammar_request("g", future))
    scheduler.add_request(make_request("a", 4))
    assert scheduled(step(scheduler)[0]) == {"a": 4}
    assert [r.request_id for r in scheduler.waiting] == ["g"]
