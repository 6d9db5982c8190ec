"""One stretch of a core's step trace (TOKENLOOM_STEP_TRACE, engine/loop/step_trace.py), summarized:
medians of the step, the forward, the rest, the grammar fill and mask, and the governor's threads.
Read by scripts/bench/structured_runs.py (--trace) and scripts/bench/probes/grammar_timeline.py."""

from __future__ import annotations

import json
import statistics
from collections import Counter
from pathlib import Path


def summarize_steps(trace_path: Path, start: float, end: float) -> dict:
    steps = [s for s in map(json.loads, trace_path.read_text().splitlines()) if start <= s["t0"] <= end]
    decode = [s for s in steps if s["fwd0"] is not None]

    def median(values):
        values = [v for v in values if v is not None]
        return round(statistics.median(values), 3) if values else None

    grammar = [s for s in decode if "grammar_rows" in s]
    return {
        "num_steps": len(steps),
        "step_ms": median([(s["t1"] - s["t0"]) * 1e3 for s in decode]),
        "forward_ms": median([(s["fwd1"] - s["fwd0"]) * 1e3 for s in decode]),
        "rest_ms": median([((s["t1"] - s["t0"]) - (s["fwd1"] - s["fwd0"])) * 1e3 for s in decode]),
        "num_grammar_steps": len(grammar),
        "fill_ms": median([(s["fill1"] - s["fill0"]) * 1e3 for s in grammar]),
        "fill_overlap": median([s["fill_overlap"] for s in grammar]),
        "num_fills_outside_forward": sum(s["fill_overlap"] < 0.5 for s in grammar),
        "wait_ms": median([s["wait_ms"] for s in grammar]),
        "apply_ms": median([s["apply_ms"] for s in grammar]),
        "num_fused_applies": sum(bool(s["fused"]) for s in grammar),
        "threads": dict(sorted(Counter(s.get("threads", 0) for s in steps).items())) if steps else {},
        "governor_others_cores": median([s.get("others") for s in steps]),
        "governor_busy_share": median([s.get("busy") for s in steps]),
    }
