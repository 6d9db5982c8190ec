"""The scheduling core (vLLM V1's `core/`): the scheduler, the block manager, a request's state and
the records a step passes around (scheduler_output, step_stats), with the scheduler's share
of speculation and its counters (spec_scheduling). Plain objects, no tensors: the
floor everything else stands on; it imports no other room of the engine."""
