"""What one step did, recorded cheaply for benchmarks and occupancy plots (`EngineCore.step_stats`).

Every mode records a StepStats a step; the padded static baseline (engine.baselines.padded_static_scheduler)
records a PaddedStepStats, which adds the pad tokens it computed for nothing. Plain records, no
torch: the benchmarks' scripts read them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StepStats:
    start_time: float
    end_time: float
    num_seqs: int
    num_tokens: int
    num_prefill_tokens: int  # the scheduler's exact counts (SchedulerOutput.counts)
    num_decode_tokens: int  # proposed tokens included
    num_kv_blocks_used: int
    num_prefill_requests: int = 0
    num_decode_requests: int = 0


@dataclass
class PaddedStepStats(StepStats):
    """A padded static step's record: its pad tokens too, computed for nothing."""

    num_padding_tokens: int = 0  # rows' left padding
    num_finished_row_tokens: int = 0  # finished rows' pad-token decodes


def padding_of(stats: StepStats) -> tuple[int, int]:
    """A step's (left padding, finished rows' decodes) tokens; none but a padded static step's."""
    if isinstance(stats, PaddedStepStats):
        return stats.num_padding_tokens, stats.num_finished_row_tokens
    return 0, 0
