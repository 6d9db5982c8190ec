"""Prefix caching in the block manager and the scheduler, without tensors.

Unit tests pin the verbs (lookup, allocate with hits, register, LRU eviction,
reset); a property test drives the scheduler with random prompts drawn from a
few shared prefixes and checks, after every schedule and update, that no free
block is referenced, that ref counts equal the holders, that every cached
block's contents match its hash chain, and that a request starting from
cached blocks finds exactly its own tokens there. A shadow KV (block id ->
tokens written) stands in for the model runner's cache.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.core.block_manager import ROOT_HASH, BlockManager, hash_block, num_blocks_for
from engine.core.request import Request
from engine.core.scheduler import SampledToken, Scheduler
from engine.baselines.static_scheduler import StaticScheduler
from ipc.sampling_params import SamplingParams


def chain(token_ids: list[int], block_size: int) -> list[bytes]:
    hashes, parent = [], ROOT_HASH
    for i in range(len(token_ids) // block_size):
        parent = hash_block(parent, token_ids[i * block_size : (i + 1) * block_size])
        hashes.append(parent)
    return hashes


# ---- the verbs ----


def test_hash_covers_the_whole_prefix():
    a, b = chain([1, 2, 3, 4, 5, 6], 2), chain([9, 2, 3, 4, 5, 6], 2)
    assert a[0] != b[0] and a[1] != b[1]  # same tokens in block 1, different parents
    assert chain([1, 2, 3, 4], 2) == a[:2]


def test_freed_blocks_stay_findable_until_handed_out_again():
    manager = BlockManager(num_blocks=4, block_size=2)
    hashes = chain([1, 2, 3, 4], 2)
    block_ids = manager.allocate(2)
    for block_id, block_hash in zip(block_ids, hashes):
        manager.register(block_id, block_hash)
    manager.free(block_ids)
    assert manager.num_used_blocks == 0 and manager.num_cached_blocks == 2
    assert manager.lookup(hashes) == [0, 1]
    assert manager.lookup(chain([1, 2, 9, 9], 2)) == [0]
    # A hit on a free block takes it off the free list; then plain blocks go first in line.
    assert not manager.can_allocate(3, [0, 1]) and manager.can_allocate(2, [0, 1])
    assert manager.allocate(1, [0]) == [0, 2]
    assert manager.ref_counts == [1, 0, 1, 0] and list(manager.free_block_ids) == [3, 1]
    # Allocating block 1 as a fresh block evicts it: its hash is forgotten.
    assert manager.allocate(2) == [3, 1]
    assert manager.lookup(hashes) == [0] and manager.num_cached_blocks == 1


def test_eviction_is_least_recently_freed_first_and_tails_first():
    manager = BlockManager(num_blocks=4, block_size=1)
    a, b = manager.allocate(2), manager.allocate(2)
    for block_id, block_hash in zip(a + b, chain([1, 2], 1) + chain([3, 4], 1)):
        manager.register(block_id, block_hash)
    manager.free(a)
    manager.free(b)
    assert list(manager.free_block_ids) == [1, 0, 3, 2]  # a before b; each one's tail first


def test_a_shared_block_is_held_until_its_last_holder_frees_it():
    manager = BlockManager(num_blocks=4, block_size=2)
    (block_id,) = manager.allocate(1)
    manager.register(block_id, chain([1, 2], 2)[0])
    assert manager.allocate(0, [block_id]) == [block_id]
    assert manager.ref_counts[block_id] == 2
    manager.free([block_id])
    assert block_id not in manager.free_block_ids
    manager.free([block_id])
    assert block_id in manager.free_block_ids and manager.num_cached_blocks == 1


def test_a_second_copy_of_a_prefix_stays_plain():
    manager = BlockManager(num_blocks=4, block_size=2)
    (block_hash,) = chain([1, 2], 2)
    first, second = manager.allocate(2)
    manager.register(first, block_hash)
    manager.register(second, block_hash)
    assert manager.cached_block_ids == {block_hash: first} and manager.block_hashes[second] is None
    with pytest.raises(RuntimeError, match="free"):
        manager.register(3, block_hash)


def test_reset_drops_only_free_cached_blocks():
    manager = BlockManager(num_blocks=4, block_size=2)
    hashes = chain([1, 2, 3, 4], 2)
    held, freed = manager.allocate(1), manager.allocate(1)
    manager.register(held[0], hashes[0])
    manager.register(freed[0], hashes[1])
    manager.free(freed)
    assert manager.reset_prefix_cache() == 1
    assert manager.cached_block_ids == {hashes[0]: held[0]}
    assert manager.num_free_blocks == 3


# ---- property test: the scheduler with caching on ----

BLOCK_SIZE_CHOICES = [1, 2, 4]


class ShadowModel:
    """Writes each computed token into a shadow KV, after checking the context it reads is right."""

    def __init__(self) -> None:
        self.kv: dict[tuple[int, int], int] = {}  # (block id, slot) -> token id

    def step(self, scheduler: Scheduler) -> None:
        block_size = scheduler.block_manager.block_size
        output = scheduler.schedule()
        check_pool(scheduler)
        sampled = {}
        for s in output.scheduled:
            request = s.request
            start, end = request.num_computed_tokens, request.num_computed_tokens + s.num_new_tokens
            assert len(request.block_ids) == num_blocks_for(end, block_size)
            for p in range(start):  # cached or earlier-computed context: exactly this request's tokens
                assert self.kv.get((request.block_ids[p // block_size], p % block_size)) == request.all_token_ids[p]
            for p in range(start, end):
                block_id = request.block_ids[p // block_size]
                assert scheduler.block_manager.ref_counts[block_id] == 1, "writing into a shared block"
                self.kv[(block_id, p % block_size)] = request.all_token_ids[p]
            if s.is_sampling:
                sampled[request.request_id] = SampledToken(1 + request.num_output_tokens % 2)  # outputs repeat
        scheduler.update(output, sampled)
        check_pool(scheduler)
        self.check_cached_blocks(scheduler)

    def check_cached_blocks(self, scheduler: Scheduler) -> None:
        manager = scheduler.block_manager
        for block_hash, block_id in manager.cached_block_ids.items():
            assert manager.block_hashes[block_id] == block_hash
            tokens = [self.kv.get((block_id, slot)) for slot in range(manager.block_size)]
            assert None not in tokens, "a block is cached before it is full"
            assert PREFIX_OF[block_hash][-manager.block_size :] == tokens
        assert sum(h is not None for h in manager.block_hashes) == manager.num_cached_blocks


# hash -> the whole token prefix it stands for, filled as requests are made; a hash
# collision here (two prefixes, one hash) would be a failure of its own.
PREFIX_OF: dict[bytes, list[int]] = {}


def remember_prefixes(token_ids: list[int], block_size: int) -> None:
    for i, block_hash in enumerate(chain(token_ids, block_size)):
        prefix = token_ids[: (i + 1) * block_size]
        assert PREFIX_OF.setdefault(block_hash, prefix) == prefix


def check_pool(scheduler: Scheduler) -> None:
    manager = scheduler.block_manager
    holders = Counter(b for r in scheduler.running for b in r.block_ids)
    for block_id in range(manager.num_blocks):
        assert manager.ref_counts[block_id] == holders[block_id]
        assert (block_id in manager.free_block_ids) == (holders[block_id] == 0), "a free block is referenced"
    for request in scheduler.waiting:
        assert request.block_ids == [] and request.num_computed_tokens == 0


@st.composite
def workloads(draw):
    block_size = draw(st.sampled_from(BLOCK_SIZE_CHOICES))
    num_blocks = draw(st.integers(4, 24))
    max_model_len = num_blocks * block_size
    system_prompts = [draw(st.lists(st.integers(1, 3), min_size=0, max_size=12)) for _ in range(2)]
    requests = []
    for _ in range(draw(st.integers(1, 10))):
        prompt = draw(st.sampled_from(system_prompts)) + draw(st.lists(st.integers(1, 3), min_size=1, max_size=6))
        prompt = prompt[: max_model_len - 1]
        max_tokens = draw(st.integers(1, min(max_model_len - len(prompt), 12)))
        arrival_step = draw(st.integers(0, 10))
        abort_step = draw(st.one_of(st.none(), st.integers(arrival_step, arrival_step + 10)))
        requests.append((arrival_step, prompt, max_tokens, abort_step))
    return dict(
        block_size=block_size,
        num_blocks=num_blocks,
        max_num_seqs=draw(st.integers(1, 6)),
        max_num_batched_tokens=draw(st.integers(1, 24)),
        static=draw(st.booleans()),
        requests=requests,
    )


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_cache_invariants_under_random_workloads(workload):
    block_size = workload["block_size"]
    scheduler = (StaticScheduler if workload["static"] else Scheduler)(
        BlockManager(workload["num_blocks"], block_size),
        max_num_seqs=workload["max_num_seqs"],
        max_num_batched_tokens=workload["max_num_batched_tokens"],
        max_model_len=workload["num_blocks"] * block_size,
        eos_token_ids=[0],
        enable_prefix_caching=True,
    )
    model = ShadowModel()
    pending = list(enumerate(workload["requests"]))
    max_steps = 30 + sum(len(p) + m for _, p, m, _ in workload["requests"])
    for step_index in range(max_steps):
        for i, (arrival_step, prompt, max_tokens, abort_step) in pending:
            if arrival_step == step_index:
                params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
                request = Request(str(i), prompt, params, max_tokens=max_tokens, arrival_time=0.0)
                remember_prefixes(prompt + [1, 2] * max_tokens, block_size)  # covers every output too
                scheduler.add_request(request)
            if abort_step == step_index:
                scheduler.abort_requests([str(i)])
                check_pool(scheduler)
        if scheduler.has_unfinished_requests():
            model.step(scheduler)
        elif step_index > max(a for a, *_ in workload["requests"]):
            break
    assert not scheduler.has_unfinished_requests(), "requests left after the step bound"
    manager = scheduler.block_manager
    assert manager.num_used_blocks == 0 and not any(manager.ref_counts)
    assert manager.num_free_blocks == manager.num_blocks
    assert scheduler.num_prefix_cache_hits <= scheduler.num_prefix_cache_queries
