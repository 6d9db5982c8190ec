"""The scheduler's side of speculative decoding: proposed tokens in, the rejected tail's blocks out.

A request whose step reaches its last token may carry proposed tokens: the step computes them
after it, at the next positions, so one weight read scores them all.

    tokens   ... t41 t42 | d1 d2 d3          num_computed_tokens = 42 before the step
    step     computes t42 d1 d2 d3  (4 rows of logits)
    verified d1 accepted, d2 rejected: emitted d1, x      (x: the target's own token)
    after    num_computed_tokens = 43 (t42, d1): the KV of d2, d3 is stale and never counted;
             blocks past what 44 tokens need go back to the pool at once

The stale slots lie at positions >= num_computed_tokens, which attention never reads (it stops at
the sequence's computed length) and the next step overwrites before counting them. Prefix caching
registers only full blocks of computed tokens, so a rejected token's KV never enters a cached block.

`SpecStats` keeps the cumulative counters per method, as `SchedulerStats.spec_decode` carries them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.core.block_manager import BlockManager, num_blocks_for
from engine.core.request import Request
from ipc.messages import SpecDecodeStats, SpecMethod

if TYPE_CHECKING:
    from engine.core.scheduler_output import SchedulerOutput


def add_proposals(output: SchedulerOutput, block_manager: BlockManager, budget: int, max_model_len: int) -> None:
    """Extend each scheduled request that reaches its last token with its proposed tokens, cut to the
    token `budget` left after every other request's work, to the free blocks and to the model's length."""
    for scheduled in output.scheduled:
        request = scheduled.request
        if not request.spec_token_ids or budget <= 0 or not scheduled.is_sampling:
            continue
        # The proposed tokens take positions num_tokens.. : the last must stay below max_model_len.
        num_proposed = min(len(request.spec_token_ids), budget, max_model_len - request.num_tokens)
        num_held = len(request.block_ids)
        num_fitting = (num_held + block_manager.num_free_blocks) * block_manager.block_size - request.num_tokens
        num_proposed = min(num_proposed, num_fitting)
        if num_proposed <= 0:
            continue
        num_needed = block_manager.num_new_blocks(num_held, request.num_tokens + num_proposed)
        request.block_ids.extend(block_manager.allocate(num_needed))
        scheduled.spec_token_ids = request.spec_token_ids[:num_proposed]
        scheduled.num_new_tokens += num_proposed
        budget -= num_proposed


def roll_back(block_manager: BlockManager, request: Request) -> None:
    """Give back the blocks past what the request's tokens need (they held only rejected tokens' KV)."""
    num_needed = num_blocks_for(request.num_tokens, block_manager.block_size)
    if len(request.block_ids) > num_needed:
        block_manager.free(request.block_ids[num_needed:])
        del request.block_ids[num_needed:]


EMA_WEIGHT = 0.5  # of the newest draft's accepted count


def record_acceptance(request: Request, num_proposed: int, num_accepted: int) -> None:
    """Fold one verified draft into the request's average accepted count (adaptive k)."""
    if num_proposed:
        request.spec_ema = (1 - EMA_WEIGHT) * request.spec_ema + EMA_WEIGHT * num_accepted


class SpecStats:
    def __init__(self) -> None:
        self.by_method: dict[SpecMethod, SpecDecodeStats] = {}

    def record(self, method: SpecMethod, num_proposed: int, num_accepted: int, num_emitted: int) -> None:
        """One verified row: `num_proposed` tokens proposed, the first `num_accepted` kept, `num_emitted` out."""
        stats = self.by_method.get(method)
        if stats is None:
            stats = self.by_method[method] = SpecDecodeStats(method)
        stats.num_drafts += 1
        stats.num_proposed_tokens += num_proposed
        stats.num_accepted_tokens += num_accepted
        stats.num_emitted_tokens += num_emitted

    def to_wire(self) -> list[SpecDecodeStats]:
        """A copy per method that has proposed anything, in method order."""
        return [SpecDecodeStats(m, s.num_drafts, s.num_proposed_tokens, s.num_accepted_tokens, s.num_emitted_tokens)
                for m, s in sorted(self.by_method.items())]
