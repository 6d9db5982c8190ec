"""scripts/bench/static_attribution.py: static-padded's loss split into head-of-line waiting,
padding (left padding and finished rows) and the memory reservation's smaller batches."""

from __future__ import annotations

import pytest

from scripts.bench.static_attribution import attribute, format_attribution, left_padding_seconds


def result(elapsed, computed, steps, padding=0, finished=0, rows=4, step_stats=None):
    return {"elapsed_s": elapsed, "num_computed_positions": computed, "num_steps": steps, "num_padding_tokens": padding,
            "num_finished_row_tokens": finished, "max_batch_rows": rows,
            "step_stats": step_stats or {"start_s": [], "end_s": [], "num_tokens": [], "num_padding_tokens": []}}


def test_left_padding_takes_its_token_share_of_the_prefill_steps_only():
    steps = {"start_s": [0.0, 1.0, 1.5], "end_s": [1.0, 1.5, 1.6], "num_tokens": [30, 40, 4],
             "num_padding_tokens": [10, 0, 0]}
    assert left_padding_seconds(steps) == pytest.approx(1.0 * 10 / 40)


def test_the_terms_add_up_to_the_gap():
    padded_steps = {"start_s": [0.0, 2.0], "end_s": [2.0, 9.0], "num_tokens": [100, 4], "num_padding_tokens": [100, 0]}
    continuous = result(4.0, 1000, 50)
    static = result(6.0, 1000, 80)
    padded = result(9.0, 1300, 81, padding=100, finished=200, step_stats=padded_steps)
    a = attribute(continuous, static, padded)
    assert a["head_of_line"] == {"seconds": 2.0, "tokens_computed": 0, "num_extra_steps": 30, "num_idle_row_steps": 200}
    assert a["padding"]["seconds"] == 3.0 and a["padding"]["tokens_computed"] == 300
    assert a["padding"]["left_padding"] == {"seconds": 1.0, "tokens_computed": 100}
    assert a["padding"]["finished_rows"] == {"seconds": 2.0, "tokens_computed": 200}
    assert a["memory"]["seconds"] == 0.0 and a["memory"]["batch_rows"] == 4
    assert a["head_of_line"]["seconds"] + a["padding"]["seconds"] == a["total"]["seconds"] == 5.0
    bounded = result(12.0, 1250, 120, rows=2)
    memory = attribute(continuous, static, padded, padded_bounded=bounded)["memory"]
    assert memory == {"seconds": 3.0, "tokens_computed": -50, "batch_rows": 2, "batch_rows_unbounded": 4}
    rows = format_attribution("reference", attribute(continuous, static, padded, padded_bounded=bounded))
    assert len(rows) == 6 and "batches of 2 instead of 4" in rows[4] and "+5.00" in rows[5]
