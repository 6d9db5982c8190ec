"""The occupancy strip's columns (frontend.step_timeline): the cores' exact step counts, kept
only while a dashboard watches."""

from __future__ import annotations

from frontend.step_timeline import StepTimeline
from ipc.messages import FinishReason, RequestOutput, StepCounts


def out(request_id: str, *token_ids: int, finish: FinishReason | None = None) -> RequestOutput:
    return RequestOutput(request_id, list(token_ids), finish)


def test_a_column_is_the_cores_count_and_the_tokens_out():
    timeline = StepTimeline(num_engines=1)
    # a and b decode (b finishes); c's prompt chunk and d's recompute after a preemption prefill
    counts = StepCounts(num_prefill_tokens=300, num_decode_tokens=2, num_prefill_requests=2, num_decode_requests=2)
    column = timeline.record(0, counts, [out("a", 5), out("b", 6, finish=FinishReason.STOP)])
    assert (column.num_prefill, column.num_decode, column.num_tokens_out) == (2, 2, 2)
    # speculative decoding: one decoding request, three tokens out
    column = timeline.record(0, StepCounts(0, 4, 0, 1), [out("a", 7, 8, 9)])
    assert (column.num_prefill, column.num_decode, column.num_tokens_out) == (0, 1, 3)
    assert timeline.num_tokens_out == [5] and timeline.num_steps == [2]


def test_watching_starts_with_the_first_dashboard_and_ends_with_the_last():
    timeline = StepTimeline(num_engines=1)
    assert not timeline.is_watched
    assert timeline.watch(True) and timeline.is_watched  # the first: the cores start counting
    assert not timeline.watch(True)  # a second changes nothing
    assert not timeline.watch(False) and timeline.is_watched
    assert timeline.watch(False) and not timeline.is_watched  # the last closed: the cores stop


def test_columns_since_is_per_core_and_bounded():
    timeline = StepTimeline(num_engines=2, max_steps=4)
    for i in range(6):
        timeline.record(0, StepCounts(0, 1, 0, 1), [out("a", i)])
    timeline.record(1, StepCounts(30, 0, 3, 0), [])
    assert timeline.num_steps == [6, 1]
    assert [c.step_index for c in timeline.columns_since(0, 0, limit=100)] == [2, 3, 4, 5]  # the ring kept 4
    assert [c.step_index for c in timeline.columns_since(0, 4, limit=100)] == [4, 5]
    assert [c.step_index for c in timeline.columns_since(0, 0, limit=1)] == [5]
    assert timeline.columns_since(0, 6, limit=100) == []
    assert [(c.num_prefill, c.num_decode) for c in timeline.columns_since(1, 0, limit=100)] == [(3, 0)]
