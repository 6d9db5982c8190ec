"""Scheduler tests with no tensors and no model (STYLE.md item 12).

A fake model step stands in for the model runner: it feeds `Scheduler.update`
one SampledToken for each scheduled request that reached the end of its
sequence (`is_sampling`). By default the token is 100 + the request's output
index, so outputs are distinct and a recomputation after preemption that
re-sampled or lost tokens would show.
"""

from __future__ import annotations

from typing import Callable

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from engine.block_manager import BlockManager, num_blocks_for
from engine.request import Request, RequestStatus
from engine.scheduler import SampledToken, Scheduler, SchedulerOutput
from engine.static_scheduler import StaticScheduler
from ipc.messages import FinishReason, RequestOutput
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
    return output, scheduler.update(output, sampled)


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


# ---- token budget, chunked prefill, mixed steps, max_num_seqs ----


def test_chunked_prefill_over_several_steps_samples_only_at_the_end():
    scheduler = make_scheduler(block_size=4, max_num_batched_tokens=8)
    a = make_request("a", num_prompt_tokens=20, max_tokens=2)
    scheduler.add_request(a)

    output = scheduler.schedule()
    assert scheduled(output) == {"a": 8} and sampling(output) == set()
    assert a.block_ids == [0, 1]
    assert scheduler.update(output, {}) == []  # a chunk, no token
    assert a.num_computed_tokens == 8 and a.num_output_tokens == 0

    output, outputs = step(scheduler)
    assert scheduled(output) == {"a": 8} and outputs == []
    assert a.block_ids == [0, 1, 2, 3] and a.num_computed_tokens == 16

    output = scheduler.schedule()
    assert scheduled(output) == {"a": 4} and sampling(output) == {"a"}  # the last chunk samples
    scheduler.update(output, {"a": SampledToken(100)})
    assert a.block_ids == [0, 1, 2, 3, 4] and a.output_token_ids == [100]

    output, outputs = step(scheduler)  # the first decode: token 21 needs a sixth block
    assert scheduled(output) == {"a": 1}
    assert outputs == [RequestOutput("a", [101], FinishReason.LENGTH, None, 20)]
    assert a.status == RequestStatus.FINISHED_LENGTH and a.block_ids == []
    assert_pool_free(scheduler)


def test_a_step_mixes_decodes_and_prefill_chunks_under_the_budget():
    scheduler = make_scheduler(block_size=4, max_num_batched_tokens=6)
    a = make_request("a", num_prompt_tokens=3, max_tokens=10)
    b = make_request("b", num_prompt_tokens=10, max_tokens=10)
    scheduler.add_request(a)
    output, _ = step(scheduler)
    assert scheduled(output) == {"a": 3} and a.block_ids == [0]

    scheduler.add_request(b)
    output = scheduler.schedule()
    assert scheduled(output) == {"a": 1, "b": 5}  # a decode and a prefill chunk, one flat batch
    assert sampling(output) == {"a"}
    assert output.num_tokens == 6
    scheduler.update(output, {"a": SampledToken(101)})

    output = scheduler.schedule()
    assert scheduled(output) == {"a": 1, "b": 5} and sampling(output) == {"a", "b"}
    scheduler.update(output, {"a": SampledToken(102), "b": SampledToken(100)})
    # a's fifth token took block 3 before b's third chunk block was handed out
    assert a.block_ids == [0, 3] and b.block_ids == [1, 2, 4]

    output, _ = step(scheduler)
    assert scheduled(output) == {"a": 1, "b": 1}
    run_to_completion(scheduler)
    assert a.output_token_ids == list(range(100, 110)) and b.output_token_ids == list(range(100, 110))
    assert_pool_free(scheduler)


def test_budget_leaves_later_requests_waiting():
    scheduler = make_scheduler(max_num_batched_tokens=10)
    for i, n in enumerate([4, 4, 4]):
        scheduler.add_request(make_request(f"r{i}", n, max_tokens=3))
    output = scheduler.schedule()
    # r2 gets only what is left of the budget: a 2-token chunk
    assert scheduled(output) == {"r0": 4, "r1": 4, "r2": 2}
    assert output.num_tokens == 10
    assert sampling(output) == {"r0", "r1"}


def test_max_num_seqs_caps_the_running_set():
    scheduler = make_scheduler(max_num_seqs=2)
    for i in range(4):
        scheduler.add_request(make_request(f"r{i}", 3, max_tokens=5))
    for _ in range(5):
        output, _ = step(scheduler)
        assert set(scheduled(output)) == {"r0", "r1"}
        assert len(scheduler.running) <= 2
    assert [r.request_id for r in scheduler.waiting] == ["r2", "r3"]
    output, _ = step(scheduler)  # r0 and r1 finished in the last update
    assert scheduled(output) == {"r2": 3, "r3": 3}
    run_to_completion(scheduler)
    assert_pool_free(scheduler)


# ---- continuous vs static admission ----


def admission_setup(static: bool):
    scheduler = make_scheduler(max_num_seqs=2, static=static)
    requests = {
        "a": make_request("a", 4, max_tokens=2),
        "b": make_request("b", 4, max_tokens=10),
        "c": make_request("c", 4, max_tokens=3),
    }
    for request in requests.values():
        scheduler.add_request(request)
    return scheduler, requests


def test_continuous_admits_in_the_step_after_a_slot_frees():
    scheduler, r = admission_setup(static=False)
    output, _ = step(scheduler)
    assert scheduled(output) == {"a": 4, "b": 4}
    output, outputs = step(scheduler)
    assert scheduled(output) == {"a": 1, "b": 1}
    assert [(o.request_id, o.finish_reason) for o in outputs] == [("a", FinishReason.LENGTH), ("b", None)]
    assert r["a"].is_finished and r["c"].status == RequestStatus.WAITING

    # the very next schedule: c takes a's place while b keeps decoding
    output, _ = step(scheduler)
    assert scheduled(output) == {"b": 1, "c": 4}
    assert r["b"].status == RequestStatus.RUNNING
    run_to_completion(scheduler)
    assert r["b"].num_output_tokens == 10 and r["c"].num_output_tokens == 3
    assert_pool_free(scheduler)


def test_static_waits_for_the_whole_batch_before_admitting():
    scheduler, r = admission_setup(static=True)
    output, _ = step(scheduler)
    assert scheduled(output) == {"a": 4, "b": 4}
    output, _ = step(scheduler)
    assert scheduled(output) == {"a": 1, "b": 1} and r["a"].is_finished
    # b decodes alone (steps 3..10) while c waits with a free slot beside it
    for step_index in range(3, 11):
        output, _ = step(scheduler)
        assert scheduled(output) == {"b": 1}, step_index
        assert r["c"].status == RequestStatus.WAITING
    assert r["b"].is_finished
    output, _ = step(scheduler)
    assert scheduled(output) == {"c": 4}
    run_to_completion(scheduler)
    assert_pool_free(scheduler)


def test_static_batch_prefills_through_the_budget_over_several_steps():
    scheduler = make_scheduler(max_num_seqs=3, max_num_batched_tokens=6, static=True)
    for i in range(4):
        scheduler.add_request(make_request(f"r{i}", 4, max_tokens=2))
    output, _ = step(scheduler)
    assert scheduled(output) == {"r0": 4, "r1": 2}
    assert [r.request_id for r in scheduler.running] == ["r0", "r1", "r2"]  # the batch is formed at once
    output, _ = step(scheduler)
    assert scheduled(output) == {"r0": 1, "r1": 2, "r2": 3}
    output, _ = step(scheduler)
    assert scheduled(output) == {"r1": 1, "r2": 1}  # r0 finished; r3 must wait for the batch
    assert [r.request_id for r in scheduler.waiting] == ["r3"]


# ---- preemption ----


def test_preemption_takes_the_most_recently_admitted_and_it_resumes():
    # 6 blocks of 4 tokens; three requests of 4 + 8 tokens need 3 blocks each at the end.
    scheduler = make_scheduler(num_blocks=6, block_size=4)
    a, b, c = (make_request(name, 4, max_tokens=8) for name in "abc")
    for request in (a, b, c):
        scheduler.add_request(request)

    output, _ = step(scheduler)  # step 1: prefill all three
    assert (a.block_ids, b.block_ids, c.block_ids) == ([0], [1], [2])
    output, _ = step(scheduler)  # step 2: position 4 needs a second block each
    assert (a.block_ids, b.block_ids, c.block_ids) == ([0, 3], [1, 4], [2, 5])
    assert scheduler.block_manager.num_free_blocks == 0
    for _ in range(3):  # steps 3-5: positions 5-7 fit in the second blocks
        output, _ = step(scheduler)
        assert scheduled(output) == {"a": 1, "b": 1, "c": 1} and output.num_preempted == 0

    # step 6: position 8 needs a third block and none is free: c, the last admitted, goes
    output, _ = step(scheduler)
    assert output.num_preempted == 1 and scheduled(output) == {"a": 1, "b": 1}
    assert c.status == RequestStatus.PREEMPTED and c.num_computed_tokens == 0 and c.block_ids == []
    assert c.num_preemptions == 1 and scheduler.num_preemptions == 1
    assert list(scheduler.waiting) == [c] and scheduler.running == [a, b]
    assert a.block_ids == [0, 3, 5] and b.block_ids == [1, 4, 2]  # c's blocks, tail first
    assert c.output_token_ids == [100, 101, 102, 103, 104]  # its outputs survive

    output, _ = step(scheduler)  # step 7
    assert scheduled(output) == {"a": 1, "b": 1}
    output, outputs = step(scheduler)  # step 8: a and b reach max_tokens
    assert {o.request_id for o in outputs if o.finish_reason} == {"a", "b"}

    # step 9: c is recomputed in one go (prompt + 5 outputs) and samples its 6th token
    output = scheduler.schedule()
    assert scheduled(output) == {"c": 9} and sampling(output) == {"c"}
    assert c.block_ids == [5, 3, 0]
    scheduler.update(output, {"c": SampledToken(105)})
    run_to_completion(scheduler)
    for request in (a, b, c):
        assert request.output_token_ids == list(range(100, 108))
        assert request.status == RequestStatus.FINISHED_LENGTH
    assert_pool_free(scheduler)


def test_tail_request_preempts_itself_when_nothing_newer_runs():
    scheduler = make_scheduler(num_blocks=5, block_size=4)
    a, b, c = (make_request(name, 4, max_tokens=6) for name in "abc")
    for request in (a, b, c):
        scheduler.add_request(request)
    step(scheduler)
    output, _ = step(scheduler)  # a and b take blocks 3 and 4; c needs one more and is the tail
    assert scheduled(output) == {"a": 1, "b": 1} and output.num_preempted == 1
    assert a.block_ids == [0, 3] and b.block_ids == [1, 4]
    assert c.status == RequestStatus.PREEMPTED and c.block_ids == []
    assert list(scheduler.waiting) == [c] and scheduler.block_manager.num_free_blocks == 1
    # no admission in a step that preempted, even though a block is free
    assert c not in [s.request for s in output.scheduled]
    run_to_completion(scheduler)
    assert [r.num_output_tokens for r in (a, b, c)] == [6, 6, 6]
    assert_pool_free(scheduler)


def test_preempted_requests_queue_oldest_first_ahead_of_new_ones():
    scheduler = make_scheduler(num_blocks=4, block_size=2)
    a = make_request("a", 3, max_tokens=5)
    b, c = make_request("b", 1, max_tokens=5), make_request("c", 1, max_tokens=5)
    for request in (a, b, c):
        scheduler.add_request(request)
    step(scheduler)
    assert (a.block_ids, b.block_ids, c.block_ids) == ([0, 1], [2], [3])
    d = make_request("d", 1, max_tokens=1)
    scheduler.add_request(d)
    output, _ = step(scheduler)  # everyone fits its tail block; no block is left for d
    assert scheduled(output) == {"a": 1, "b": 1, "c": 1} and list(scheduler.waiting) == [d]
    output, _ = step(scheduler)  # a takes c's block; b needs one too and preempts itself
    assert scheduled(output) == {"a": 1} and output.num_preempted == 2
    assert a.block_ids == [0, 1, 3]
    assert list(scheduler.waiting) == [b, c, d]  # preempted ones first, oldest first
    run_to_completion(scheduler)
    assert [r.num_output_tokens for r in (a, b, c, d)] == [5, 5, 5, 1]
    assert_pool_free(scheduler)


def test_the_oldest_running_request_progresses_every_step():
    scheduler = make_scheduler(num_blocks=8, block_size=2, max_num_batched_tokens=5)
    requests = [make_request(f"r{i}", 3 + i, max_tokens=6) for i in range(5)]
    for request in requests:
        scheduler.add_request(request)
    while scheduler.has_unfinished_requests():
        oldest = scheduler.running[0] if scheduler.running else scheduler.waiting[0]
        before = oldest.num_computed_tokens
        output, _ = step(scheduler)
        assert oldest.request_id in scheduled(output)
        assert oldest.is_finished or oldest.num_computed_tokens > before
    assert scheduler.num_preemptions > 0
    assert all(r.output_token_ids == list(range(100, 106)) for r in requests)
    assert_pool_free(scheduler)


# ---- finish reasons ----


def emit(token_id: int) -> Callable[[Request], int]:
    return lambda request: token_id


def test_eos_stops():
    scheduler = make_scheduler()
    request = make_request("r", 3, max_tokens=10)
    scheduler.add_request(request)
    step(scheduler, token_for=emit(7))
    output, outputs = step(scheduler, token_for=emit(EOS))
    assert outputs == [RequestOutput("r", [EOS], FinishReason.STOP, None, 3, stop_token_id=EOS)]
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
        RequestOutput("b", [], FinishReason.ABORT, None, 9),
        RequestOutput("c", [], FinishReason.ABORT, None, 3),
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


# ---- property test: random arrivals, pools, budgets; both schedulers ----


def check_after_schedule(scheduler: Scheduler, output: SchedulerOutput, running_before: list[Request], static: bool):
    manager = scheduler.block_manager
    assert output.num_tokens <= scheduler.max_num_batched_tokens
    assert len(scheduler.running) <= scheduler.max_num_seqs
    ids = [s.request.request_id for s in output.scheduled]
    assert len(ids) == len(set(ids))
    for s in output.scheduled:
        request = s.request
        assert s.num_new_tokens >= 1
        assert request in scheduler.running and request.status == RequestStatus.RUNNING
        assert request.num_computed_tokens + s.num_new_tokens <= request.num_tokens
        # blocks for everything this step will have computed, and not one more
        num_computed_after = request.num_computed_tokens + s.num_new_tokens
        assert len(request.block_ids) == num_blocks_for(num_computed_after, manager.block_size)
    if running_before or not static:
        # Victims are the most recently admitted, and they queue first, oldest first.
        preempted = [r for r in running_before if r.status == RequestStatus.PREEMPTED]
        assert output.num_preempted == len(preempted)
        assert preempted == running_before[len(running_before) - len(preempted) :]
        assert list(scheduler.waiting)[: len(preempted)] == preempted
    # static: only into an empty batch; continuous: only in a step that preempted nobody
    may_admit = not running_before if static else output.num_preempted == 0
    if not may_admit:
        assert set(map(id, scheduler.running)) <= set(map(id, running_before)), "admitted in a step it should not"
    if not static and output.num_preempted == 0 and scheduler.waiting:
        # work-conserving: nothing admissible was left waiting
        budget_left = scheduler.max_num_batched_tokens - output.num_tokens
        if budget_left > 0 and len(scheduler.running) < scheduler.max_num_seqs:
            head = scheduler.waiting[0]
            num_new = min(head.num_tokens - head.num_computed_tokens, budget_left)
            assert not manager.can_allocate(num_blocks_for(num_new, manager.block_size))
    check_blocks(scheduler)


def check_blocks(scheduler: Scheduler) -> None:
    manager = scheduler.block_manager
    held = [b for r in scheduler.running for b in r.block_ids]
    assert len(held) == len(set(held)), "a block is held by two running requests"
    assert not set(held) & set(manager.free_block_ids)
    assert len(held) + manager.num_free_blocks == manager.num_blocks
    assert all(manager.ref_counts[b] == 1 for b in held)
    for request in scheduler.waiting:
        assert request.block_ids == [] and request.num_computed_tokens == 0
        assert request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)


def check_after_update(scheduler: Scheduler) -> None:
    block_size = scheduler.block_manager.block_size
    for request in scheduler.running:
        assert len(request.block_ids) == num_blocks_for(request.num_computed_tokens, block_size)
        assert request.num_computed_tokens < request.num_tokens  # always something left to compute
    check_blocks(scheduler)


@st.composite
def workloads(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 8, 16]))
    num_blocks = draw(st.integers(1, 24))
    max_model_len = num_blocks * block_size  # as EngineCore: a sequence always fits the pool alone
    if max_model_len < 2:
        num_blocks, max_model_len = 2, 2 * block_size
    num_requests = draw(st.integers(1, 10))
    requests = []
    for _ in range(num_requests):
        num_prompt_tokens = draw(st.integers(1, min(max_model_len - 1, 40)))
        max_tokens = draw(st.integers(1, min(max_model_len - num_prompt_tokens, 20)))
        arrival_step = draw(st.integers(0, 15))
        requests.append((arrival_step, num_prompt_tokens, max_tokens))
    return dict(
        num_blocks=num_blocks,
        block_size=block_size,
        max_num_seqs=draw(st.integers(1, 6)),
        max_num_batched_tokens=draw(st.integers(1, 48)),
        max_model_len=max_model_len,
        static=draw(st.booleans()),
        requests=requests,
    )


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_scheduler_invariants_under_random_workloads(workload):
    static = workload["static"]
    scheduler = make_scheduler(
        num_blocks=workload["num_blocks"],
        block_size=workload["block_size"],
        max_num_seqs=workload["max_num_seqs"],
        max_num_batched_tokens=workload["max_num_batched_tokens"],
        max_model_len=workload["max_model_len"],
        static=static,
    )
    arrivals = sorted(enumerate(workload["requests"]), key=lambda item: item[1][0])
    requests = []
    # The oldest running request gains a token every step it exists (it is never
    # preempted), so total work bounds the step count: no deadlock, no livelock.
    max_steps = max(a for a, _, _ in workload["requests"]) + sum(p + m for _, p, m in workload["requests"]) + 1
    step_index = 0
    while arrivals or scheduler.has_unfinished_requests():
        assert step_index <= max_steps, f"no progress: {scheduler.running} {list(scheduler.waiting)}"
        while arrivals and arrivals[0][1][0] <= step_index:
            i, (_, num_prompt_tokens, max_tokens) = arrivals.pop(0)
            request = make_request(f"r{i}", num_prompt_tokens, max_tokens=max_tokens, ignore_eos=True)
            requests.append(request)
            scheduler.add_request(request)
        running_before = list(scheduler.running)
        output = scheduler.schedule()
        check_after_schedule(scheduler, output, running_before, static)
        if scheduler.has_unfinished_requests():
            assert not output.is_empty, "requests are waiting but nothing was scheduled"
        # EOS every token: ignore_eos must carry each request to exactly max_tokens
        sampled = {s.request.request_id: SampledToken(EOS) for s in output.scheduled if s.is_sampling}
        scheduler.update(output, sampled)
        check_after_update(scheduler)
        step_index += 1
    for request in requests:
        assert request.status == RequestStatus.FINISHED_LENGTH
        assert request.num_output_tokens == request.max_tokens
    assert not scheduler.requests
    assert_pool_free(scheduler)
    event("static" if static else "continuous")
    event("preempted" if scheduler.num_preemptions else "no preemption")
