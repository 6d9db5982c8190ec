"""A step's exact prefill and decode counts (SchedulerOutput.counts, sent to the dashboard as
EngineOutputs.step_counts): from the scheduler's own batch, and only while a dashboard watches."""

from __future__ import annotations

import pytest

from engine.core.scheduler import SampledToken
from engine.core.scheduler_output import ScheduledRequest, SchedulerOutput
from ipc.messages import StepCounts
from tests.helpers.scheduler import make_request, make_scheduler, next_output_token


def counted_step(scheduler) -> tuple[SchedulerOutput, StepCounts]:
    output = scheduler.schedule()
    counts = output.counts()  # before update advances the computed counts
    sampled = {s.request.request_id: SampledToken(next_output_token(s.request))
               for s in output.scheduled if s.is_sampling}
    scheduler.update(output, sampled)
    return output, counts


def test_prompt_chunks_are_prefill_and_single_tokens_after_outputs_are_decode():
    scheduler = make_scheduler(max_num_batched_tokens=8)
    scheduler.add_request(make_request("a", 4, max_tokens=3))
    scheduler.add_request(make_request("b", 10, max_tokens=3))
    # a's whole prompt, b's first chunk
    assert counted_step(scheduler)[1] == StepCounts(8, 0, 2, 0)
    # a decodes; b's last chunk (its first token comes out of it, still a prefill)
    assert counted_step(scheduler)[1] == StepCounts(6, 1, 1, 1)
    assert counted_step(scheduler)[1] == StepCounts(0, 2, 0, 2)


def test_a_one_token_prompt_is_a_prefill_not_a_decode():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 1, max_tokens=2))
    assert counted_step(scheduler)[1] == StepCounts(1, 0, 1, 0)
    assert counted_step(scheduler)[1] == StepCounts(0, 1, 0, 1)


def test_a_preempted_requests_recompute_is_prefill():
    scheduler = make_scheduler(num_blocks=6, block_size=4, max_num_batched_tokens=64)
    for i in range(3):
        scheduler.add_request(make_request(str(i), 6, max_tokens=8, ignore_eos=True))
    recomputed = []
    while scheduler.has_unfinished_requests():
        output, counts = counted_step(scheduler)
        assert counts.num_prefill_tokens + counts.num_decode_tokens == output.num_tokens
        assert counts.num_prefill_requests + counts.num_decode_requests == len(output.scheduled)
        recomputed += [s for s in output.scheduled if s.request.num_output_tokens and s.num_new_tokens > 1]
    assert scheduler.num_preemptions > 0 and recomputed
    assert counts == StepCounts(0, 1, 0, 1)  # the last step: one request decoding alone


def test_proposed_tokens_count_with_their_decode():
    request = make_request("a", 4)
    request.append_token(100)
    request.num_computed_tokens = 4  # the prompt computed, its first output not yet
    output = SchedulerOutput([ScheduledRequest(request, 3, spec_token_ids=[7, 8])])
    assert output.counts() == StepCounts(0, 3, 0, 1)


@pytest.fixture(scope="module")
def tiny_engine(tmp_path_factory):
    from engine.config import EngineConfig
    from engine.loop.engine_core import EngineCore
    from tests.helpers.models import make_tiny_model

    path, _ = make_tiny_model(tmp_path_factory.mktemp("counts"), "LlamaForCausalLM")
    return EngineCore(EngineConfig(model=path, block_size=4, num_kv_blocks=64, dtype="float32"))


def test_the_engine_counts_its_steps_only_while_asked(tiny_engine):
    from ipc.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    tiny_engine.add_request("a", [5, 17, 42, 99, 3], params)
    assert tiny_engine.step().step_counts is None  # no dashboard: nothing counted
    tiny_engine.count_steps = True
    tiny_engine.add_request("b", [5, 17, 42], params)
    assert tiny_engine.step().step_counts == StepCounts(3, 1, 1, 1)  # b's prompt beside a's decode
    tiny_engine.count_steps = False
    tiny_engine.record_step_stats = True  # a benchmark's record has them too, without a dashboard
    assert tiny_engine.step().step_counts is None
    tiny_engine.record_step_stats = False
    stats = tiny_engine.step_stats[-1]
    assert (stats.num_prefill_tokens, stats.num_decode_tokens, stats.num_prefill_requests,
            stats.num_decode_requests) == (0, 2, 0, 2)
    while tiny_engine.has_unfinished_requests():
        assert tiny_engine.step().step_counts is None
