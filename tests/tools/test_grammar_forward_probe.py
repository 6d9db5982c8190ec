"""scripts/bench/probes/grammar_forward: free and constrained rounds in one engine, each round's forward
timed over the steps where every request decodes, the constrained ones with their fill beside."""

from __future__ import annotations

import json

import pytest

from scripts.bench.probes import grammar_forward

pytestmark = pytest.mark.slow


def test_pairs_a_free_and_a_constrained_round_and_times_the_fill(tmp_path, default_model_path):
    out = tmp_path / "grammar_forward.json"
    grammar_forward.main(["--model", default_model_path, "--num-requests", "4", "--rounds", "2",
                          "--max-tokens", "12", "--json", str(out)])
    report = json.loads(out.read_text())
    rounds = report["rounds"]
    # F G, then G F: the order alternates so that drift hits both arms
    assert [(r["pair"], r["arm"]) for r in rounds] == [(0, "free"), (0, "grammar"), (1, "grammar"), (1, "free")]
    assert all(r["num_full_steps"] >= 1 and r["forward_ms"] > 0 for r in rounds)
    assert all(r["fill_ms"] > 0 for r in rounds if r["arm"] == "grammar")  # the fill ran on its thread
    assert all(r["fill_ms"] is None for r in rounds if r["arm"] == "free")
    assert len(report["forward_ratio_by_pair"]) == 2 and report["forward_ratio_median"]["grammar"] > 0


def test_the_serial_arm_fills_before_the_forward(tmp_path, default_model_path):
    out = tmp_path / "grammar_forward.json"
    grammar_forward.main(["--model", default_model_path, "--num-requests", "4", "--rounds", "3", "--max-tokens", "12",
                          "--with-serial", "--json", str(out)])
    report = json.loads(out.read_text())
    firsts = [r["arm"] for r in report["rounds"][::3]]
    assert firsts == ["free", "grammar", "grammar_serial"]  # each arm leads one triple
    assert all(set(pair) == {"grammar", "grammar_serial"} for pair in report["forward_ratio_by_pair"])
    assert all(r["fill_ms"] > 0 for r in report["rounds"] if r["arm"] != "free")
