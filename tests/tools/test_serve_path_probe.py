"""scripts/bench/probes/serve_path: a traced step split into its parts, and the medians over a request."""

from __future__ import annotations

import pytest

from scripts.bench.probes.serve_path import median_parts, step_parts


def traced_step(t0: float) -> dict:
    """A step's trace line (engine/loop/step_trace.py), in seconds, its parts 1, 2, 20, 3, 4 and 5 ms long."""
    marks = [t0, t0 + 0.001, t0 + 0.003, t0 + 0.023, t0 + 0.026, t0 + 0.030, t0 + 0.035]
    return dict(zip(["t0", "prep0", "fwd0", "fwd1", "sampled", "t1", "sent"], marks), rows=1)


def test_a_step_splits_into_its_parts_and_the_gap_to_the_next():
    parts = step_parts(traced_step(10.0), next_t0=10.036)
    expected = dict(schedule=1, prepare=2, forward=20, sample=3, update=4, send=5, gap=1, total=36)
    assert parts == pytest.approx(expected)
    assert step_parts(traced_step(10.0), None)["gap"] is None  # the request's last step
    assert step_parts({**traced_step(10.0), "prep0": None}, 10.036) is None  # a step without a forward's times
    assert step_parts({**traced_step(10.0), "fwd0": None, "fwd1": None}, 10.036) is None


def test_medians_leave_out_the_last_step_and_long_gaps():
    steps = [traced_step(10.0), traced_step(10.036), traced_step(10.072), traced_step(11.0)]  # a 0.9 s pause
    result = median_parts(steps)
    assert result["num_steps"] == 2  # the pause's gap and the last step (no next one) are not a token's
    assert result["forward"] == pytest.approx(20) and result["total"] == pytest.approx(36)
    assert result["outside_forward"] == pytest.approx(16)
    assert median_parts([traced_step(10.0)]) == {}
