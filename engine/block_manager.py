"""Owner of the KV pool's block ids: a free list and reference counts, never tensors.

Blocks are handed out as a sequence grows and returned the moment it finishes;
nothing is reserved for a request's maximum length. Reference counts let a
block be shared (prefix sharing) and return to the free list only when its
last holder lets go.
"""

from __future__ import annotations

from collections import deque


def num_blocks_for(num_tokens: int, block_size: int) -> int:
    return (num_tokens + block_size - 1) // block_size


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self.free_block_ids: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_block_ids)

    def num_new_blocks(self, num_held_blocks: int, num_tokens: int) -> int:
        """Blocks to add so that `num_tokens` fit beside the ones already held."""
        return max(0, num_blocks_for(num_tokens, self.block_size) - num_held_blocks)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self.free_block_ids)

    def allocate(self, num_blocks: int) -> list[int]:
        if num_blocks > len(self.free_block_ids):
            raise RuntimeError(f"asked for {num_blocks} blocks, {len(self.free_block_ids)} free")
        block_ids = [self.free_block_ids.popleft() for _ in range(num_blocks)]
        for block_id in block_ids:
            self.ref_counts[block_id] = 1
        return block_ids

    def share(self, block_ids: list[int]) -> None:
        """Another holder takes these blocks (prefix sharing)."""
        for block_id in block_ids:
            if self.ref_counts[block_id] < 1:
                raise RuntimeError(f"block {block_id} is free, cannot be shared")
            self.ref_counts[block_id] += 1

    def free(self, block_ids: list[int]) -> None:
        # Checked whole before anything changes, so a bad call leaves the pool as it was.
        for block_id in set(block_ids):
            if self.ref_counts[block_id] < block_ids.count(block_id):
                raise RuntimeError(f"block {block_id} freed twice: more often than it is held")
        # Freed in reverse so a sequence's tail blocks, the least likely to be
        # shared, are reused last: cheap locality for prefix caching later.
        for block_id in reversed(block_ids):
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                self.free_block_ids.append(block_id)
