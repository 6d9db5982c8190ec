"""Speculative decoding's cumulative counters per method, as `SchedulerStats.spec_decode` carries them."""

from __future__ import annotations

from ipc.messages import SpecDecodeStats, SpecMethod


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
