"""Scheduler tests with no tensors and no model (STYLE.md item 12): the token budget,
chunked prefill, continuous vs static admission and preemption. Factories and the
fake model step: tests/helpers/scheduler.py.
"""

from __future__ import annotations

from engine.core.request import RequestStatus
from engine.core.scheduler import SampledToken
from ipc.messages import FinishReason, RequestOutput
from tests.helpers.scheduler import (
    make_request, make_scheduler, step, scheduled, sampling, run_to_completion, assert_pool_free,
)

# ---- token budget, chunked prefill, mixed steps, max_num_seqs ----


def test_chunked_prefill_over_several_steps_samples_only_at_the_end():
    scheduler = make_scheduler(block_size=4, max_num_batched_tokens=8)
    a = make_request("a", num_prompt_tokens=20, max_tokens=2)
    scheduler.add_request(a)

    output = scheduler.schedule()
    assert scheduled(output) == {"a": 8} and sampling(output) == set()
    assert a.block_ids == [0, 1]
    assert scheduler.update(output, {}).outputs == []  # a chunk, no token
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
    assert outputs == [RequestOutput("a", [101], FinishReason.LENGTH)]
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
