"""Owner of the KV pool's block ids: a free list, reference counts and prefix hashes, never tensors.

Blocks are handed out as a sequence grows and returned the moment it finishes;
nothing is reserved for a request's maximum length. Reference counts let a
block be shared and return to the free list only when its last holder lets go.

Automatic prefix caching (after vLLM V1 and nano-vllm): a full block whose KV
is computed can be registered under a hash of its whole prefix (see
`hash_block`). A registered block keeps its hash after it is freed, so a later
request with the same prefix finds it with `lookup` and takes it back instead
of recomputing it. Free blocks are reused least-recently-freed first; a cached
block loses its hash (is evicted) only when it is handed out as a new block.

    free list (least recently freed first):  [7  9  3  4]    9 and 4 cached (hash kept)
    allocate(1, cached_block_ids=[4])  -> [4, 7]   4 is a hit: it leaves the free list
    allocate(2)                        -> [9, 3]   9 is evicted: its hash is dropped

"Used" means held (ref count > 0); a cached block with no holder is free.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import Counter, OrderedDict

# The hash of the (empty) prefix before a sequence's first block.
ROOT_HASH = b""


def num_blocks_for(num_tokens: int, block_size: int) -> int:
    return (num_tokens + block_size - 1) // block_size


def hash_block(parent_hash: bytes, token_ids: list[int], extra: bytes = b"") -> bytes:
    """The key of a full block: SHA-256 over its parent's key and its token ids, and `extra`: the
    content hashes of the images whose tokens the block covers (an image's placeholder tokens are
    the same ids whatever the image, so without them two images would share KV).

    Chaining the parent's key makes a block's key stand for its whole prefix, so
    equal keys mean equal KV. Collisions are handled by making them impractical
    (a 256-bit cryptographic hash, as vLLM's `sha256` option), not by comparing
    tokens on a hit: a hit is trusted."""
    return hashlib.sha256(parent_hash + array("q", token_ids).tobytes() + extra).digest()


def adapter_root_hash(lora_name: str, lora_path: str) -> bytes:
    """The root of the hash chain of a request under a LoRA adapter, in place of ROOT_HASH: every
    block key then stands for the adapter too, so KV computed under one adapter is never found
    for another adapter or for the base (whose chain starts at ROOT_HASH)."""
    return hashlib.sha256(b"lora\0" + lora_name.encode() + b"\0" + lora_path.encode()).digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        # Insertion-ordered: the front is the least recently freed, the next one handed out.
        # Not a deque, so a cached free block can leave from the middle on a hit; and an
        # OrderedDict, not a dict: taking a plain dict's first key scans past every slot
        # deleted before it until the next resize (16 µs a block in a 10,000-request run),
        # where OrderedDict.popitem(last=False) is O(1).
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.block_hashes: list[bytes | None] = [None] * num_blocks
        self.cached_block_ids: dict[bytes, int] = {}  # hash -> the block holding that prefix

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_block_ids)

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached_block_ids)

    def num_new_blocks(self, num_held_blocks: int, num_tokens: int) -> int:
        """Blocks to add so that `num_tokens` fit beside the ones already held."""
        return max(0, num_blocks_for(num_tokens, self.block_size) - num_held_blocks)

    def lookup(self, block_hashes: list[bytes]) -> list[int]:
        """The blocks caching the longest run of `block_hashes` from the start (held or free)."""
        block_ids = []
        for block_hash in block_hashes:
            block_id = self.cached_block_ids.get(block_hash)
            if block_id is None:
                break
            block_ids.append(block_id)
        return block_ids

    def can_allocate(self, num_blocks: int, cached_block_ids: list[int] = ()) -> bool:
        # A cached hit that nobody holds comes out of the free list too.
        num_revived = sum(1 for block_id in cached_block_ids if self.ref_counts[block_id] == 0)
        return num_blocks + num_revived <= len(self.free_block_ids)

    def allocate(self, num_blocks: int, cached_block_ids: list[int] = ()) -> list[int]:
        """Take a reference on `cached_block_ids` (from `lookup`), then `num_blocks` fresh
        blocks; returns them all in that order."""
        if not self.can_allocate(num_blocks, cached_block_ids):
            raise RuntimeError(f"asked for {num_blocks} blocks, {len(self.free_block_ids)} free")
        for block_id in cached_block_ids:
            if self.ref_counts[block_id] == 0:
                del self.free_block_ids[block_id]
            self.ref_counts[block_id] += 1
        new_block_ids = []
        for _ in range(num_blocks):
            block_id, _ = self.free_block_ids.popitem(last=False)
            self._evict(block_id)
            self.ref_counts[block_id] = 1
            new_block_ids.append(block_id)
        return list(cached_block_ids) + new_block_ids

    def register(self, block_id: int, block_hash: bytes) -> None:
        """`block_id` is full and its KV computed: make it findable under `block_hash`.

        When another block already caches that prefix (two requests computed it at
        once), the first keeps the key and this one stays a plain block."""
        if self.ref_counts[block_id] < 1:
            raise RuntimeError(f"block {block_id} is free, cannot be registered")
        if block_hash in self.cached_block_ids or self.block_hashes[block_id] is not None:
            return
        self.block_hashes[block_id] = block_hash
        self.cached_block_ids[block_hash] = block_id

    def free(self, block_ids: list[int]) -> None:
        # Checked whole before anything changes, so a bad call leaves the pool as it was.
        for block_id, num_frees in Counter(block_ids).items():
            if self.ref_counts[block_id] < num_frees:
                raise RuntimeError(f"block {block_id} freed twice: more often than it is held")
        # Freed in reverse so a sequence's tail blocks, the least likely to be shared,
        # are handed out (evicted) before its head blocks, which other requests may reuse.
        for block_id in reversed(block_ids):
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                self.free_block_ids[block_id] = None

    def reset_prefix_cache(self) -> int:
        """Forget the hashes of free blocks (held ones keep theirs); returns how many were dropped."""
        dropped = [block_id for block_id in self.free_block_ids if self.block_hashes[block_id] is not None]
        for block_id in dropped:
            self._evict(block_id)
        return len(dropped)

    def _evict(self, block_id: int) -> None:
        block_hash = self.block_hashes[block_id]
        if block_hash is not None:
            del self.cached_block_ids[block_hash]
            self.block_hashes[block_id] = None
