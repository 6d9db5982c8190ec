"""The occupancy strip's columns, read off per-step EngineOutputs (frontend.step_timeline)."""

from __future__ import annotations

from dataclasses import dataclass

from frontend.step_timeline import StepTimeline
from ipc.messages import FinishReason, RequestOutput


@dataclass
class State:
    last_token_time: float | None = None


def out(request_id: str, *token_ids: int, finish: FinishReason | None = None) -> RequestOutput:
    return RequestOutput(request_id, list(token_ids), finish)


def test_first_token_is_prefill_later_tokens_decode_silent_running_prefill():
    timeline = StepTimeline(num_engines=1)
    states = {"a": State(1.0), "b": State(None)}  # a has tokens; b's prompt ends this step
    # Three running after the step: a, b and c (c's chunked prompt still being computed).
    column = timeline.record(0, [out("a", 5), out("b", 7)], num_running=3, states=states)
    assert (column.num_prefill, column.num_decode, column.num_tokens_out) == (2, 1, 2)
    assert timeline.num_tokens_out == [2]


def test_finished_requests_are_cells_of_their_last_step_only():
    timeline = StepTimeline(num_engines=1)
    states = {"a": State(1.0), "b": State(1.0)}
    column = timeline.record(0, [out("a", 5, finish=FinishReason.STOP), out("b", 6)], num_running=1, states=states)
    assert (column.num_prefill, column.num_decode) == (0, 2)


def test_a_request_the_frontend_already_ended_counts_as_decode():
    timeline = StepTimeline(num_engines=1)
    column = timeline.record(0, [out("gone", 5)], num_running=1, states={})
    assert (column.num_prefill, column.num_decode) == (0, 1)


def test_messages_that_are_no_step_are_skipped():
    timeline = StepTimeline(num_engines=1)
    assert timeline.record(0, [], num_running=0, states={}) is None  # idle heartbeat
    abort_reply = [out("a", finish=FinishReason.ABORT)]
    assert timeline.record(0, abort_reply, num_running=2, states={"a": State(1.0)}) is None
    assert timeline.num_steps == [0]
    # A step that only computes prompt chunks sends no outputs, but it is a step.
    column = timeline.record(0, [], num_running=2, states={})
    assert (column.num_prefill, column.num_decode) == (2, 0)


def test_columns_since_is_per_core_and_bounded():
    timeline = StepTimeline(num_engines=2, max_steps=4)
    for i in range(6):
        timeline.record(0, [out("a", i)], num_running=1, states={"a": State(1.0)})
    timeline.record(1, [], num_running=3, states={})
    assert timeline.num_steps == [6, 1]
    assert [c.step_index for c in timeline.columns_since(0, 0, limit=100)] == [2, 3, 4, 5]  # the ring kept 4
    assert [c.step_index for c in timeline.columns_since(0, 4, limit=100)] == [4, 5]
    assert [c.step_index for c in timeline.columns_since(0, 0, limit=1)] == [5]
    assert timeline.columns_since(0, 6, limit=100) == []
    assert [(c.num_prefill, c.num_decode) for c in timeline.columns_since(1, 0, limit=100)] == [(3, 0)]
