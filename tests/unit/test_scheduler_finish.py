"""Scheduler tests: finish reasons (EOS, stop tokens, min/max tokens, model length),
aborts and the request status order; no tensors, no model (tests/helpers/scheduler.py).
"""

from __future__ import annotations

import pytest

from engine.core.request import RequestStatus
from ipc.messages import FinishReason, RequestOutput
from tests.helpers.scheduler import (
    EOS, make_request, make_scheduler, step, scheduled, run_to_completion, assert_pool_free, emit,
)

# ---- finish reasons ----


def test_eos_stops():
    scheduler = make_scheduler()
    request = make_request("r", 3, max_tokens=10)
    scheduler.add_request(request)
    step(scheduler, token_for=emit(7))
    output, outputs = step(scheduler, token_for=emit(EOS))
    assert outputs == [RequestOutput("r", [EOS], FinishReason.STOP, None, stop_token_id=EOS)]
    assert request.status == RequestStatus.FINISHED_STOPPED and request.output_token_ids == [7, EOS]
    assert_pool_free(scheduler)


def test_ignore_eos_runs_to_max_tokens():
    scheduler = make_scheduler()
    request = make_request("r", 3, max_tokens=5, ignore_eos=True)
    scheduler.add_request(request)
    run_to_completion(scheduler, token_for=emit(EOS))
    assert request.status == RequestStatus.FINISHED_LENGTH and request.output_token_ids == [EOS] * 5
    assert request.stop_token_id is None


def test_stop_token_ids_stop_even_with_ignore_eos():
    scheduler = make_scheduler()
    request = make_request("r", 3, max_tokens=10, ignore_eos=True, stop_token_ids=[42, 43])
    scheduler.add_request(request)
    step(scheduler, token_for=emit(EOS))
    _, outputs = step(scheduler, token_for=emit(43))
    assert outputs[0].finish_reason == FinishReason.STOP and outputs[0].stop_token_id == 43
    assert request.output_token_ids == [EOS, 43]


@pytest.mark.parametrize("stop_token", [EOS, 42])
def test_min_tokens_defers_the_stop(stop_token):
    scheduler = make_scheduler()
    request = make_request("r", 3, max_tokens=10, min_tokens=3, stop_token_ids=[42])
    scheduler.add_request(request)
    run_to_completion(scheduler, token_for=emit(stop_token))
    # As in vLLM's check_stop: a stop counts once the outputs, itself included, reach min_tokens.
    # (The model runner also bans stop tokens while fewer than min_tokens are out.)
    assert request.output_token_ids == [stop_token] * 3
    assert request.status == RequestStatus.FINISHED_STOPPED and request.stop_token_id == stop_token


def test_max_tokens_finishes_with_length():
    scheduler = make_scheduler()
    request = make_request("r", 3, max_tokens=4)
    scheduler.add_request(request)
    finish_reasons = []
    while scheduler.has_unfinished_requests():
        _, outputs = step(scheduler)
        finish_reasons += [o.finish_reason for o in outputs]
    assert finish_reasons == [None, None, None, FinishReason.LENGTH]
    assert request.output_token_ids == [100, 101, 102, 103]


def test_model_length_finishes_with_length():
    scheduler = make_scheduler(max_model_len=10)
    request = make_request("r", 6, max_tokens=100)
    scheduler.add_request(request)
    run_to_completion(scheduler)
    assert request.status == RequestStatus.FINISHED_LENGTH
    assert request.num_tokens == 10 and request.num_output_tokens == 4


def test_stop_wins_over_length_on_the_last_token():
    scheduler = make_scheduler()
    request = make_request("r", 3, max_tokens=2)
    scheduler.add_request(request)
    step(scheduler, token_for=emit(7))
    step(scheduler, token_for=emit(EOS))
    assert request.status == RequestStatus.FINISHED_STOPPED


# ---- abort ----


def test_abort_waiting_and_running_requests_frees_their_blocks():
    scheduler = make_scheduler(max_num_seqs=2, block_size=4)
    a, b, c = make_request("a", 6), make_request("b", 9), make_request("c", 3)
    for request in (a, b, c):
        scheduler.add_request(request)
    step(scheduler)
    assert a.block_ids == [0, 1] and b.block_ids == [2, 3, 4] and c.status == RequestStatus.WAITING

    outputs = scheduler.abort_requests(["b", "c", "unknown"])
    assert outputs == [
        RequestOutput("b", [], FinishReason.ABORT),
        RequestOutput("c", [], FinishReason.ABORT),
    ]
    assert b.status == c.status == RequestStatus.FINISHED_ABORTED
    assert b.block_ids == [] and scheduler.running == [a] and not scheduler.waiting
    assert scheduler.block_manager.num_free_blocks == 64 - 2
    assert scheduler.abort_requests(["b"]) == []  # already gone
    scheduler.abort_requests(["a"])
    assert not scheduler.has_unfinished_requests()
    assert_pool_free(scheduler)


def test_abort_mid_chunked_prefill_and_after_preemption():
    scheduler = make_scheduler(num_blocks=6, block_size=2, max_num_batched_tokens=4)
    a, b = make_request("a", 3, max_tokens=8), make_request("b", 7, max_tokens=4)
    scheduler.add_request(a)
    scheduler.add_request(b)
    output, _ = step(scheduler)
    assert scheduled(output) == {"a": 3, "b": 1}
    assert a.block_ids == [0, 1] and b.block_ids == [2]
    output, _ = step(scheduler)
    assert scheduled(output) == {"a": 1, "b": 3} and b.block_ids == [2, 3]
    output, _ = step(scheduler)  # a takes block 4; b's next chunk needs two, one is free
    assert scheduled(output) == {"a": 1} and output.num_preempted == 1
    assert b.status == RequestStatus.PREEMPTED and list(scheduler.waiting) == [b]
    outputs = scheduler.abort_requests(["b"])
    assert outputs[0].finish_reason == FinishReason.ABORT
    assert b.status == RequestStatus.FINISHED_ABORTED and not scheduler.waiting
    run_to_completion(scheduler)
    assert a.num_output_tokens == 8
    assert_pool_free(scheduler)


def test_duplicate_request_id_is_refused():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("r", 3))
    with pytest.raises(ValueError, match="already in use"):
        scheduler.add_request(make_request("r", 4))


# ---- request status ----


def test_request_status_order_puts_every_finished_status_after_the_live_ones():
    live = [RequestStatus.WAITING, RequestStatus.RUNNING, RequestStatus.PREEMPTED]
    finished = [s for s in RequestStatus if s not in live]
    assert max(live) < min(finished)
    assert [s.is_finished for s in RequestStatus] == [s in finished for s in RequestStatus]
    assert all(s.finish_reason is None for s in live)
    assert {s: s.finish_reason for s in finished} == {
        RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
        RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
        RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
        RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
    }
