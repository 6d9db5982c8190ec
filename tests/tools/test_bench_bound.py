"""The roofline arithmetic behind scripts/bench/probes/bound.py, on numbers worked by hand."""

from __future__ import annotations

import json

import pytest

from scripts.bench.probes.bound import MachineBalance, ideal_run_s, ideal_step_s, model_cost


def smollm2_cost(element_size: int = 4):
    return model_cost(hidden=576, intermediate=1536, num_layers=30, num_heads=9, num_kv_heads=3,
                      head_dim=64, vocab_size=49152, tied_embeddings=True, element_size=element_size)


def test_model_cost_counts_smollm2_parameters():
    cost = smollm2_cost()
    # per layer: qkv 576*960 + o 576*576 + gate/up/down 3*576*1536 = 3,538,944; 30 layers + tied embedding
    assert cost.weight_bytes == 4 * (30 * 3_538_944 + 49152 * 576)
    assert cost.body_flops_per_token == 2 * 30 * 3_538_944
    assert cost.head_flops_per_token == 2 * 49152 * 576
    untied = model_cost(576, 1536, 30, 9, 3, 64, 49152, tied_embeddings=False, element_size=2)
    assert untied.weight_bytes == 2 * (30 * 3_538_944 + 2 * 49152 * 576)


def test_small_steps_are_bound_by_the_weight_read_large_ones_by_arithmetic():
    cost = smollm2_cost()
    machine = MachineBalance(read_bytes_per_s=50e9, matmul_flops_per_s=500e9)
    read_s = cost.weight_bytes / 50e9
    assert ideal_step_s(1, 1, cost, machine) == pytest.approx(read_s)
    big = ideal_step_s(1000, 64, cost, machine)
    assert big == pytest.approx((1000 * cost.body_flops_per_token + 64 * cost.head_flops_per_token) / 500e9)
    assert big > read_s
    assert ideal_step_s(1000, 64, cost, machine, overlap=False) == pytest.approx(big + read_s)


def test_fewer_fuller_steps_are_cheaper_for_the_same_tokens():
    cost = smollm2_cost()
    machine = MachineBalance(read_bytes_per_s=50e9, matmul_flops_per_s=500e9)
    # 64 decode tokens as one step of 64 or as four steps of 16
    continuous = {"num_tokens": [64], "num_seqs": [64]}
    static = {"num_tokens": [16] * 4, "num_seqs": [16] * 4}
    assert ideal_run_s(static, cost, machine) == pytest.approx(4 * ideal_step_s(16, 16, cost, machine))
    ratio = ideal_run_s(static, cost, machine) / ideal_run_s(continuous, cost, machine)
    assert 1.0 < ratio < 4.0


@pytest.mark.slow
def test_main_prices_a_bench_run_on_this_machine(tmp_path, default_model_path):
    from scripts.bench.probes.bound import main

    # Two modes doing the same 64 decode tokens: one step of 64, or four steps of 16.
    bench = {
        "config": {"model": default_model_path, "dtype": None},
        "machine": {"cuda": False},
        "results": {
            "continuous": {"elapsed_s": 1.0, "step_stats": {"num_tokens": [64], "num_seqs": [64]}},
            "static": {"elapsed_s": 3.0, "step_stats": {"num_tokens": [16] * 4, "num_seqs": [16] * 4}},
        },
    }
    bench_path = tmp_path / "bench.json"
    bench_path.write_text(json.dumps(bench))
    out_path = tmp_path / "bound.json"
    result = main(["--bench", str(bench_path), "--json", str(out_path)])
    assert json.loads(out_path.read_text()) == result
    assert result["device"] == "cpu" and result["dtype"] == "float32"
    assert result["machine"]["read_gb_per_s"] > 0 and result["machine"]["matmul_gflop_per_s"] > 0
    assert result["measured_ratio"] == pytest.approx(3.0)
    # More steps for the same tokens never cost less (equal when every step is bound by its
    # matmuls); one after the other, the three extra weight reads always show.
    assert 1.0 - 1e-9 <= result["ideal_ratio"] <= 4.0
    assert 1.0 < result["ideal_ratio_no_overlap"] <= 4.0
