"""static-padded (engine/baselines/padded_static_scheduler.py): the scheduler without tensors, then the
model: padding and finished rows really computed, real outputs those of the other modes."""

from __future__ import annotations

import pytest
import torch

from engine.core.block_manager import BlockManager
from engine.baselines.padded_static_scheduler import PaddedStaticScheduler, reservation_blocks, scratch_blocks
from engine.core.step_stats import PaddedStepStats
from tests.helpers.scheduler import EOS, assert_pool_free, make_request, run_to_completion, scheduled, step


def make_padded(num_blocks: int = 64, block_size: int = 4, max_num_seqs: int = 4,
                max_num_batched_tokens: int = 64) -> PaddedStaticScheduler:
    return PaddedStaticScheduler(BlockManager(num_blocks, block_size), max_num_seqs=max_num_seqs,
                                 max_num_batched_tokens=max_num_batched_tokens, max_model_len=num_blocks * block_size,
                                 eos_token_ids=[EOS])


def padding_of(output) -> list[tuple[int, int, bool]]:
    return [(p.start, p.num_tokens, p.is_sampling) for p in output.padding]


def test_a_batch_reserves_prompt_plus_max_tokens_and_its_padding_up_front():
    scheduler = make_padded()
    a, b = make_request("a", 3, max_tokens=2, ignore_eos=True), make_request("b", 9, max_tokens=6, ignore_eos=True)
    scheduler.add_request(a)
    scheduler.add_request(b)
    output, _ = step(scheduler)
    # a: 3 + 2 tokens -> 2 blocks; b: 9 + 6 -> 4 blocks; scratch: 6 pad tokens of a (2 blocks),
    # a's pad decodes up to position 3 + 6 - 2 = 7 need 2 blocks, a holds 2 of them
    assert (len(a.block_ids), len(b.block_ids)) == (2, 4)
    assert reservation_blocks(a, 4) == 2 and scratch_blocks([a, b], 4) == 2
    assert scheduler.block_manager.num_used_blocks == 2 + 4 + 2
    # prefill padded to the longest prompt: a's 6 pad tokens beside its own 3
    assert scheduled(output) == {"a": 3, "b": 9}
    assert padding_of(output) == [(0, 6, False)]
    assert output.padding[0].block_ids == scheduler.batch.scratch_block_ids


def test_finished_rows_compute_pad_decodes_until_the_last_row_ends():
    scheduler = make_padded()
    a, b = make_request("a", 3, max_tokens=2, ignore_eos=True), make_request("b", 9, max_tokens=6, ignore_eos=True)
    c = make_request("c", 2, max_tokens=1, ignore_eos=True)
    for r in (a, b, c):
        scheduler.add_request(r)
    scheduler.max_num_seqs = 2
    first, _ = step(scheduler)
    a_blocks, scratch = list(a.block_ids), list(scheduler.batch.scratch_block_ids)
    second, _ = step(scheduler)
    assert scheduled(second) == {"a": 1, "b": 1} and second.padding == []
    assert a.is_finished and a.output_token_ids == [100, 101]
    for number in range(4):  # b's last 4 decodes: a is done, yet its row goes on
        output, _ = step(scheduler)
        assert scheduled(output) == {"b": 1}
        [row] = output.padding
        assert (row.start, row.num_tokens, row.is_sampling) == (4 + number, 1, True)
        assert row.block_ids == a_blocks + scratch  # its own reservation first, then the batch's scratch
    assert b.num_output_tokens == 6 and scheduler.batch is None
    assert c.status.name == "WAITING"  # it waited for the whole batch, though a's slot sat idle for 4 steps
    output, _ = step(scheduler)
    assert scheduled(output) == {"c": 2} and output.padding == []
    run_to_completion(scheduler)
    assert_pool_free(scheduler)


def test_a_finished_rows_pad_decodes_stay_inside_its_reservation_and_the_scratch():
    block_size = 4
    scheduler = make_padded(block_size=block_size)
    lens = [(3, 1), (13, 2), (1, 11), (7, 5)]
    requests = [make_request(str(i), p, max_tokens=m, ignore_eos=True) for i, (p, m) in enumerate(lens)]
    for r in requests:
        scheduler.add_request(r)
    held = {r.request_id: None for r in requests}
    while scheduler.has_unfinished_requests():
        output, _ = step(scheduler)
        for row in output.padding:
            end = row.start + row.num_tokens
            assert end <= len(row.block_ids) * block_size  # every pad token has a slot of its own table
        for row in scheduler.batch.rows if scheduler.batch else []:
            held[row.request.request_id] = row.block_ids
        if scheduler.batch is not None:
            used = {b for row in scheduler.batch.rows for b in row.block_ids}
            assert not used & set(scheduler.batch.scratch_block_ids)  # padding never lands in a real row's KV
    assert_pool_free(scheduler)


def test_the_pool_bounds_the_batch_size():
    # each request reserves 8 + 8 tokens = 4 blocks (equal rows: no scratch); 15 blocks hold 3 rows, not 4
    scheduler = make_padded(num_blocks=15, max_num_seqs=16)
    for i in range(6):
        scheduler.add_request(make_request(str(i), 8, max_tokens=8, ignore_eos=True))
    output, _ = step(scheduler)
    assert len(output.scheduled) == 3 and len(scheduler.running) == 3
    assert scheduler.block_manager.num_used_blocks == 3 * 4 and scheduler.batch.scratch_block_ids == []
    run_to_completion(scheduler)
    assert scheduler.num_preemptions == 0
    assert_pool_free(scheduler)


def test_rows_are_prefilled_whole_as_many_a_step_as_the_budget_takes():
    scheduler = make_padded(max_num_batched_tokens=20)
    for i, n in enumerate((9, 3, 5, 2)):
        scheduler.add_request(make_request(str(i), n, max_tokens=3, ignore_eos=True))
    first, _ = step(scheduler)
    second, _ = step(scheduler)
    third, _ = step(scheduler)
    assert scheduled(first) == {"0": 9, "1": 3} and padding_of(first) == [(0, 6, False)]
    assert scheduled(second) == {"2": 5, "3": 2} and padding_of(second) == [(0, 4, False), (0, 7, False)]
    assert scheduled(third) == {"0": 1, "1": 1, "2": 1, "3": 1}  # decodes start once every row is prefilled


def test_an_aborted_row_keeps_computing_and_an_aborted_waiting_request_just_leaves():
    scheduler = make_padded(max_num_seqs=2)
    for i, (p, m) in enumerate(((4, 6), (4, 6), (4, 6))):
        scheduler.add_request(make_request(str(i), p, max_tokens=m, ignore_eos=True))
    step(scheduler)
    scheduler.abort_requests(["0", "2"])
    output, _ = step(scheduler)
    assert scheduled(output) == {"1": 1} and padding_of(output) == [(4, 1, True)]
    run_to_completion(scheduler)
    assert_pool_free(scheduler)


# ---- on the model ----


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from tests.helpers.models import make_tiny_model

    path, _ = make_tiny_model(tmp_path_factory.mktemp("padded"), "LlamaForCausalLM")
    return path


def test_fp32_greedy_tokens_are_identical_in_every_mode(tiny_llama):
    from engine import LLM, SamplingParams

    generator = torch.Generator().manual_seed(3)
    lens = [(1, 30), (5, 3), (17, 12), (40, 1), (133, 25), (9, 30), (60, 7)]
    prompts = [torch.randint(0, 512, (p,), generator=generator).tolist() for p, _ in lens]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for _, m in lens]
    tokens, engines = {}, {}
    for mode in ("continuous", "static", "static-padded"):
        llm = LLM(tiny_llama, skip_tokenizer_init=True, dtype="float32", block_size=4, batching=mode,
                  max_num_seqs=4, max_num_batched_tokens=256)
        llm.engine.record_step_stats = True
        tokens[mode] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        engines[mode] = llm.engine
        assert llm.engine.block_manager.num_free_blocks == llm.engine.num_kv_blocks
    assert tokens["static-padded"] == tokens["static"] == tokens["continuous"]
    assert [len(t) for t in tokens["continuous"]] == [m for _, m in lens]
    steps = engines["static-padded"].step_stats
    # batches [0..3] and [4..6]: prompts padded to 40 and 133, every row decoding to 30 outputs
    assert sum(s.num_padding_tokens for s in steps) == (4 * 40 - 63) + (3 * 133 - 202)
    assert sum(s.num_finished_row_tokens for s in steps) == (29 * 4 - (29 + 2 + 11 + 0)) + (29 * 3 - (24 + 29 + 6))
    # the other modes' steps carry no padding fields at all
    assert not any(isinstance(s, PaddedStepStats) for mode in ("static", "continuous") for s in engines[mode].step_stats)
    assert all(isinstance(s, PaddedStepStats) for s in steps)
