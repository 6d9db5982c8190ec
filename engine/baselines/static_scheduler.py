"""Static batching: the baseline continuous batching must beat, on the same model code.

A batch of up to `max_num_seqs` requests is formed only when the previous one
has completely finished; finished sequences leave the step (our flat batches
carry no padding) but nobody takes their place until the last one ends. That
head-of-line blocking is the one difference from `Scheduler`, so a comparison
of the two isolates scheduling.
"""

from __future__ import annotations

from engine.core.scheduler import Scheduler, is_compiling
from engine.core.scheduler_output import SchedulerOutput


class StaticScheduler(Scheduler):
    def _admit_waiting(self, output: SchedulerOutput, budget: int) -> None:
        if self.running:
            return  # the current batch runs until its last sequence ends
        # Form the whole batch now; its prompts are prefilled over as many
        # steps as the token budget needs, through the running path.
        # Cached prefixes are taken now; the rest is allocated as it is scheduled.
        num_compiling = 0  # requests passed over while their grammar compiles: they keep their place
        while len(self.waiting) > num_compiling and len(self.running) < self.max_num_seqs:
            request = self.waiting[num_compiling]
            if is_compiling(request):
                num_compiling += 1
                continue
            del self.waiting[num_compiling]
            cached_block_ids, _ = self._lookup(request)
            self._start(request, self.block_manager.allocate(0, cached_block_ids), len(cached_block_ids))
            self.running.append(request)
        self._schedule_running(output, budget)
