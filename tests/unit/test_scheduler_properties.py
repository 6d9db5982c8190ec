"""Scheduler property test: random arrivals, pools and budgets on both schedulers,
with the invariants checked after every schedule and update (tests/helpers/scheduler.py).
"""

from __future__ import annotations

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from engine.core.block_manager import num_blocks_for
from engine.core.request import Request, RequestStatus
from engine.core.scheduler import SampledToken, Scheduler, SchedulerOutput
from tests.helpers.scheduler import EOS, make_request, make_scheduler, step, scheduled, assert_pool_free

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
