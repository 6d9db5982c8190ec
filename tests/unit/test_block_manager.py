"""BlockManager as a plain object: exact block ids, ref counts, and the arithmetic
the scheduler relies on (STYLE.md item 12). No torch, no model."""

from __future__ import annotations

import random

import pytest

from engine.core.block_manager import BlockManager, num_blocks_for


def assert_consistent(manager: BlockManager, held: list[list[int]]) -> None:
    """Every block is either free (ref count 0, once in the free list) or held (count = number of holders)."""
    counts = [0] * manager.num_blocks
    for block_ids in held:
        for block_id in block_ids:
            counts[block_id] += 1
    assert manager.ref_counts == counts
    free = list(manager.free_block_ids)
    assert len(free) == len(set(free))
    assert set(free) == {b for b in range(manager.num_blocks) if counts[b] == 0}
    assert manager.num_free_blocks + manager.num_used_blocks == manager.num_blocks


def test_fresh_manager_hands_out_ids_in_order():
    manager = BlockManager(num_blocks=8, block_size=4)
    assert manager.num_free_blocks == 8 and manager.num_used_blocks == 0
    assert manager.allocate(3) == [0, 1, 2]
    assert manager.allocate(2) == [3, 4]
    assert manager.allocate(0) == []
    assert manager.num_free_blocks == 3 and manager.num_used_blocks == 5
    assert manager.ref_counts == [1, 1, 1, 1, 1, 0, 0, 0]


def test_freed_blocks_come_back_after_the_never_used_ones():
    manager = BlockManager(num_blocks=8, block_size=4)
    first = manager.allocate(3)  # [0, 1, 2]
    manager.allocate(2)  # [3, 4]
    manager.free(first)
    # Freed in reverse (tail blocks last in line), queued behind 5, 6, 7.
    assert list(manager.free_block_ids) == [5, 6, 7, 2, 1, 0]
    assert manager.allocate(4) == [5, 6, 7, 2]
    assert manager.allocate(2) == [1, 0]
    assert manager.num_free_blocks == 0
    assert_consistent(manager, [[3, 4], [5, 6, 7, 2], [1, 0]])


def test_no_block_owned_twice_across_many_allocations():
    rng = random.Random(0)
    manager = BlockManager(num_blocks=64, block_size=16)
    held: list[list[int]] = []
    for _ in range(2000):
        if held and (rng.random() < 0.45 or not manager.can_allocate(1)):
            manager.free(held.pop(rng.randrange(len(held))))
        else:
            num = rng.randint(0, min(6, manager.num_free_blocks))
            block_ids = manager.allocate(num)
            owned = {b for ids in held for b in ids}
            assert not owned & set(block_ids), "handed out a block that is still owned"
            assert len(set(block_ids)) == len(block_ids)
            held.append(block_ids)
        assert_consistent(manager, held)
    for block_ids in held:
        manager.free(block_ids)
    assert manager.num_free_blocks == 64
    assert sorted(manager.free_block_ids) == list(range(64))


def test_shared_block_is_freed_only_by_its_last_holder():
    manager = BlockManager(num_blocks=4, block_size=4)
    a = manager.allocate(2)  # [0, 1]
    b = manager.allocate(1, cached_block_ids=[0])  # b shares a's first block (a prefix-cache hit): [0, 2]
    assert manager.ref_counts == [2, 1, 1, 0]
    manager.free(a)
    assert manager.ref_counts == [1, 0, 1, 0]
    assert list(manager.free_block_ids) == [3, 1]  # block 0 is still b's
    assert manager.allocate(0, cached_block_ids=[0]) == [0]  # a third holder
    manager.free(b)
    assert manager.ref_counts == [1, 0, 0, 0]
    assert 0 not in manager.free_block_ids
    manager.free([0])
    assert manager.ref_counts == [0, 0, 0, 0]
    assert list(manager.free_block_ids) == [3, 1, 2, 0]


def test_double_free_raises():
    manager = BlockManager(num_blocks=4, block_size=4)
    block_ids = manager.allocate(2)
    manager.free(block_ids)
    before = (list(manager.free_block_ids), list(manager.ref_counts))
    with pytest.raises(RuntimeError, match="freed twice"):
        manager.free(block_ids)
    with pytest.raises(RuntimeError, match="freed twice"):
        manager.free([3])  # never allocated
    assert (list(manager.free_block_ids), list(manager.ref_counts)) == before


def test_over_allocation_raises_and_changes_nothing():
    manager = BlockManager(num_blocks=5, block_size=4)
    manager.allocate(3)
    before = (list(manager.free_block_ids), list(manager.ref_counts))
    assert manager.can_allocate(2) and not manager.can_allocate(3)
    with pytest.raises(RuntimeError, match="asked for 3 blocks, 2 free"):
        manager.allocate(3)
    assert (list(manager.free_block_ids), list(manager.ref_counts)) == before
    assert manager.allocate(2) == [3, 4]


@pytest.mark.parametrize(
    "num_tokens, expected",
    [(0, 0), (1, 1), (3, 1), (4, 1), (5, 2), (8, 2), (9, 3)],
)
def test_num_blocks_for(num_tokens, expected):
    assert num_blocks_for(num_tokens, block_size=4) == expected


@pytest.mark.parametrize(
    "num_held_blocks, num_tokens, expected",
    [
        (0, 1, 1),  # first token of a sequence
        (0, 7, 2),  # a prompt ending mid-block
        (0, 8, 2),  # a prompt ending on a block boundary
        (2, 7, 0),  # decode mid-block: the held tail block has room
        (2, 8, 0),  # decode that fills the tail block exactly
        (2, 9, 1),  # first token past the boundary needs a new block
        (2, 17, 3),  # a chunk spanning several new blocks
        (3, 5, 0),  # holding more than needed never gives a negative count
    ],
)
def test_num_new_blocks(num_held_blocks, num_tokens, expected):
    manager = BlockManager(num_blocks=8, block_size=4)
    assert manager.num_new_blocks(num_held_blocks, num_tokens) == expected
