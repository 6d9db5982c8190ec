"""What the draft's KV pool holds for one request, and how much of it still stands.

The draft's pool is addressed by the target's block tables (the same block ids), so the
draft needs no allocator of its own, but its KV is only as good as the blocks it was written
in and the tokens it was computed for. After a propose, a request's draft KV holds

    positions  0 .. num_real_tokens-1                the request's own tokens
               num_real_tokens .. +len(proposed)-1   the draft's proposals (all but the last,
                                                     whose KV no later step needed)

    e.g. tokens t0..t9, proposals d0 d1 d2 d3:  KV of t0..t9 d0 d1 d2
    verified: d0 d1 accepted, x emitted     ->  t0..t9 d0 d1 x: 12 positions still stand
                                                 (x is new: the next catch-up computes it)

Every position must also lie in one of the request's blocks (not the proposer's scratch
blocks, whose contents the next propose overwrites) and those blocks must still be the
request's: a preemption, or a rollback that freed a block and allocated another, leaves
the KV where it was written, not where the request now reads. Token ids never change once
appended, so the real tokens stand as long as their blocks do.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.core.block_manager import num_blocks_for
from engine.core.request import Request


@dataclass
class DraftKv:
    num_real_tokens: int  # leading positions holding the request's own tokens' KV
    proposed_token_ids: list[int]  # the tokens whose KV follows: the draft's own proposals
    block_ids: list[int]  # the request's blocks the KV was written in (no scratch blocks)
    num_preemptions: int  # the request's count when written: a preemption since frees every block

    def num_valid_tokens(self, request: Request, block_size: int) -> int:
        """Leading positions whose KV the draft can trust for `request` now: at most
        num_tokens - 1, so the last token is always computed again (its logits give the
        first proposal)."""
        if request.num_preemptions != self.num_preemptions:
            return 0
        num_valid = min(self.num_real_tokens, request.num_tokens)
        if num_valid == self.num_real_tokens:  # the proposals that the request's tokens followed
            following = request.all_token_ids[num_valid: num_valid + len(self.proposed_token_ids)]
            for proposed, token_id in zip(self.proposed_token_ids, following):
                if proposed != token_id:
                    break
                num_valid += 1
        num_valid = min(num_valid, request.num_tokens - 1)
        num_blocks = num_blocks_for(num_valid, block_size)
        if request.block_ids[:num_blocks] != self.block_ids[:num_blocks]:
            num_valid = min(num_valid, block_size * _num_common(request.block_ids, self.block_ids))
        return max(num_valid, 0)


def _num_common(first: list[int], second: list[int]) -> int:
    """The number of leading entries that `first` and `second` share."""
    for i, (a, b) in enumerate(zip(first, second)):
        if a != b:
            return i
    return min(len(first), len(second))
