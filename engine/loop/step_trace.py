"""A per-step trace of where a served core's step time goes, for diagnosis (issue #58's grammar timeline).

    TOKENLOOM_STEP_TRACE=/tmp/steps.jsonl python -m frontend.api_server ...

With the variable set, the core process appends one JSON line per step: the step's span,
the forward's, the grammar fill's (on its own thread: `fill_overlap` is the share of it
inside the forward), the wait for it and the mask, and the torch threads the step ran
with (the thread governor may lower them). Unset, nothing is timed or written.
`scripts/bench/probes/grammar_timeline.py` reads it beside the threads' CPU times.

    {"t0": .., "t1": .., "sent": .., "prep0": .., "fwd0": .., "fwd1": .., "sampled": .., "fill0": .., "fill1": ..,
     "fill_overlap": 1.0, "wait_ms": 0.0, "apply_ms": 0.1, "rows": 32, "grammar_rows": 32, "fused": true, "threads": 2,
     "others": 0.4, "busy": 0.9}
"""

from __future__ import annotations

import json
import os
import time

TRACE_ENV = "TOKENLOOM_STEP_TRACE"


class StepTrace:
    def __init__(self, path: str) -> None:
        self._file = open(path, "a", buffering=1)  # a line at a time: read while the server runs

    @classmethod
    def from_env(cls) -> StepTrace | None:
        path = os.environ.get(TRACE_ENV)
        return cls(path) if path else None

    def record(self, engine, start: float, governor=None, end: float | None = None) -> None:
        """After a step that began at `start` and ended at `end` (time.perf_counter(); None: now), and
        after its outputs were sent (`sent`, now); `governor`: the core's ThreadGovernor or None."""
        now = time.perf_counter()
        runner = engine.model_runner
        fwd0, fwd1 = getattr(runner, "forward_times", (None, None))
        if fwd1 is None or fwd0 < start:  # no forward this step
            fwd0 = fwd1 = None
        record = {"t0": start, "t1": end or now, "sent": now, "fwd0": fwd0, "fwd1": fwd1,
                  "rows": len(engine.scheduler.running)}
        prepare0, sampled = getattr(runner, "execute_times", None) or (None, None)
        if fwd0 is not None and prepare0 is not None and prepare0 >= start:  # the execute's ends: schedule before, update after
            record.update(prep0=prepare0, sampled=sampled)
        if governor is not None:  # its threads, and the last window's readings that chose them
            record.update(threads=governor.num_threads, others=round(governor.other_cores, 2),
                          busy=round(governor.busy_share, 2))
        bitmask = getattr(getattr(runner, "logits_state", None), "grammar_bitmask", None)
        times = getattr(bitmask, "times", None)
        if times is not None and times.num_rows and fwd0 is not None:
            fill_s = times.end - times.start
            inside = max(0.0, min(times.end, fwd1) - max(times.start, fwd0))
            record.update(fill0=times.start, fill1=times.end, fill_overlap=inside / fill_s if fill_s > 0 else 1.0,
                          wait_ms=times.waited_s * 1e3, apply_ms=times.apply_s * 1e3,
                          grammar_rows=times.num_rows, fused=times.is_fused, overlapped=times.is_overlapped)
            times.num_rows = 0
        self._file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        self._file.close()
