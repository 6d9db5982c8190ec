"""The capacity simulator's arithmetic on hand-made steps: model shape, step price,
profiles, the calibration fit and the SLO statistics."""

from __future__ import annotations

import json

import pytest

from engine.simulator.calibration import fit_server, fit_steps, nonnegative_least_squares
from engine.simulator.capacity import parse_slo, poisson_arrivals, statistic
from engine.simulator.hardware_profile import PROFILES_DIR, HardwareProfile, load_profile
from engine.simulator.model_shape import load_model_shape
from engine.simulator.step_cost import PeakTimes, StepCostModel, StepShape
from scripts.lib.bench_metrics import percentile
from scripts.lib.make_model_config import write_model_config
from tests.helpers.scheduler import make_request, make_scheduler

SMOLLM2_LAYER_PARAMS = 3_538_944  # qkv 576*960 + o 576*576 + gate/up/down 3*576*1536


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    return load_model_shape(str(write_model_config("smollm2", tmp_path_factory.mktemp("smollm2"))), "bfloat16")


def profile(**overrides) -> HardwareProfile:
    fields = dict(name="hand", source="test", matmul_flops_per_s={"bfloat16": 100e12},
                  memory_bandwidth_bytes_per_s=1e12, overlap=False)
    return HardwareProfile(**{**fields, **overrides})


def test_model_shape_counts_smollm2(smollm2):
    assert smollm2.cost.weight_bytes == 2 * (30 * SMOLLM2_LAYER_PARAMS + 49152 * 576)
    assert smollm2.cost.body_flops_per_token == 2 * 30 * SMOLLM2_LAYER_PARAMS
    assert smollm2.kv_bytes_per_token == 2 * 30 * 3 * 64 * 2  # K and V, layers, KV heads, head_dim, bf16
    assert smollm2.attention_flops_per_pair == 4 * 30 * 9 * 64


def test_step_shape_reads_chunks_and_decodes():
    scheduler = make_scheduler(block_size=4, max_num_batched_tokens=10)
    scheduler.add_request(make_request("a", 3, ignore_eos=True))
    scheduler.add_request(make_request("b", 12, ignore_eos=True))
    output = scheduler.schedule()  # a: 3 (whole prompt, sampled), b: 7 of 12
    shape = StepShape.of(output)
    assert (shape.num_seqs, shape.num_tokens, shape.num_sampled) == (2, 10, 1)
    assert shape.num_context_tokens == 3 + 7
    assert shape.num_attention_pairs == 3 * 4 // 2 + 7 * 8 // 2


def test_price_of_a_hand_made_step(smollm2):
    """One decode of 4 sequences at context 100 plus a 60-token chunk after 40 computed."""
    step = StepShape(num_seqs=5, num_tokens=64, num_sampled=4, num_context_tokens=4 * 100 + 100,
                     num_attention_pairs=4 * 100 + 60 * 40 + 60 * 61 // 2)
    p = profile(matmul_efficiency=0.5, bandwidth_efficiency=0.8, kv_read_efficiency=0.5, attention_efficiency=0.25,
                step_overhead_s=1e-3, seq_overhead_s=1e-5)
    cost = StepCostModel(smollm2, p).price(step)
    weights = smollm2.cost.weight_bytes / (1e12 * 0.8)
    matmuls = (64 * smollm2.cost.body_flops_per_token + 4 * smollm2.cost.head_flops_per_token) / (100e12 * 0.5)
    kv = (500 + 64) * smollm2.kv_bytes_per_token / (1e12 * 0.5)
    attention = step.num_attention_pairs * smollm2.attention_flops_per_pair / (100e12 * 0.25)
    assert cost.overhead_s == pytest.approx(1e-3 + 5e-5)
    assert cost.linear_s == pytest.approx(weights + matmuls)
    assert cost.attention_s == pytest.approx(kv + attention)  # KV reads and FLOPs add, overlap or not
    assert cost.allreduce_s == 0
    assert cost.total_s == pytest.approx(1e-3 + 5e-5 + weights + matmuls + kv + attention)
    overlapped = StepCostModel(smollm2, profile(overlap=True)).price(step)
    assert overlapped.linear_s == pytest.approx(max(smollm2.cost.weight_bytes / 1e12, matmuls * 0.5))


def test_tensor_parallel_splits_the_work_and_adds_a_ring_all_reduce(smollm2):
    step = StepShape(num_seqs=8, num_tokens=8, num_sampled=8, num_context_tokens=800, num_attention_pairs=800)
    p = profile(link_bandwidth_bytes_per_s=100e9, link_latency_s=1e-5)
    one, two = StepCostModel(smollm2, p).price(step), StepCostModel(smollm2, p, tensor_parallel_size=2).price(step)
    assert two.linear_s == pytest.approx(one.linear_s / 2)
    assert two.attention_s == pytest.approx(one.attention_s / 2)
    num_bytes = 8 * (2 * 30 + 1) * 576 * 2  # tokens, two per layer and the embedding's, hidden, bf16
    assert two.allreduce_s == pytest.approx(2 * 1 / 2 * num_bytes / 100e9 + 61 * 1e-5)


def test_pipeline_parallel_keeps_the_compute_and_adds_its_hand_offs(smollm2):
    p = profile(link_bandwidth_bytes_per_s=1e9, link_latency_s=1e-5)
    step = StepShape(num_seqs=4, num_tokens=100, num_sampled=4, num_context_tokens=400, num_attention_pairs=5000)
    one, three = StepCostModel(smollm2, p).price(step), StepCostModel(smollm2, p, pipeline_parallel_size=3).price(step)
    # Stages run one after another: the same compute as one device, plus 2 hand-offs of
    # (hidden, residual) and the 4 sampled rows' logits back to rank 0.
    assert (three.linear_s, three.attention_s, three.allreduce_s) == (one.linear_s, one.attention_s, 0.0)
    num_bytes = 2 * (2 * 100 * 576 * 2) + 4 * 49152 * 2
    assert three.pipeline_s == pytest.approx(num_bytes / 1e9 + 3 * 1e-5)
    assert one.pipeline_s == 0.0


def test_shipped_profiles_cite_their_spec_sheets():
    names = sorted(p.stem for p in PROFILES_DIR.glob("*.json"))
    assert names == ["a100-80gb", "h100-sxm", "h200"]
    for name in names:
        p = load_profile(name)
        assert "datasheet" in p.source and p.memory_bytes > 0 and p.link_bandwidth_bytes_per_s > 0
        assert p.peak_flops("bfloat16") >= 312e12
    h100 = load_profile("h100-sxm")
    assert (h100.peak_flops("bfloat16"), h100.memory_bandwidth_bytes_per_s) == (989.5e12, 3.35e12)


def test_a_profile_round_trips_through_json(tmp_path):
    p = profile(fit={"num_steps": 3}, cpu_model=None)
    assert load_profile(str(p.save(tmp_path / "p.json"))) == p
    with pytest.raises(ValueError, match="unknown profile fields"):
        HardwareProfile.from_dict({**json.loads(p.to_json()), "bogus": 1})


def test_kv_pool_is_what_the_weights_leave():
    p = profile(memory_bytes=80 * 10**9, memory_utilization=0.9)
    assert p.kv_pool_bytes(14 * 10**9) == 72 * 10**9 - 14 * 10**9
    assert profile(kv_cache_memory_bytes=1 << 30).kv_pool_bytes(10**9) == 1 << 30
    with pytest.raises(ValueError, match="no KV pool"):
        p.kv_pool_bytes(75 * 10**9)


def test_nonnegative_least_squares_recovers_coefficients_and_drops_negative_ones():
    rows = [[1.0, x, x * x] for x in range(1, 20)]
    coefficients, sse = nonnegative_least_squares(rows, [2 + 3 * x for _, x, _ in rows])
    assert coefficients == pytest.approx([2, 3, 0], abs=1e-9) and sse == pytest.approx(0, abs=1e-12)
    # the unconstrained fit of y = 5 - x would give x a negative weight: it is dropped
    assert nonnegative_least_squares([[1.0, x] for x in range(5)], [5.0 - x for x in range(5)])[0][1] == 0


def test_the_fit_finds_a_roofline_and_its_parameters():
    """Steps made by a known roofline: small ones cost the weight read, big ones their matmuls."""
    times = [PeakTimes(weights_s=0.004, matmuls_s=0.0005 * n, kv_s=0.0001 * n * (1 + n % 3), attention_s=0.0)
             for n in range(1, 80)]
    periods = [0.01 + 2e-5 * n + max(0.006, 2 * t.matmuls_s) + 1.5 * t.kv_s for n, t in zip(range(1, 80), times)]
    fit = fit_steps(times, list(range(1, 80)), periods)
    assert fit.overlap
    assert (fit.read_s, fit.k_matmul, fit.k_kv) == pytest.approx((0.006, 2.0, 1.5), rel=0.02)
    assert (fit.step_overhead_s, fit.seq_overhead_s) == pytest.approx((0.01, 2e-5), rel=0.1, abs=2e-4)


def test_the_fit_finds_an_additive_cost_and_its_parameters():
    """Steps made by the additive form: every term adds, the read merges with the fixed overhead."""
    # matmuls not proportional to num_seqs: every seventh step is a prefill of 300 tokens
    times = [PeakTimes(weights_s=0.004, matmuls_s=0.0005 * (300 if n % 7 == 0 else n),
                       kv_s=0.0001 * n * (1 + n % 3), attention_s=1e-4 * (n % 5)) for n in range(1, 80)]
    periods = [0.01 + 2e-5 * n + 0.006 + 2 * t.matmuls_s + 1.5 * t.kv_s + 3 * t.attention_s
               for n, t in zip(range(1, 80), times)]
    fit = fit_steps(times, list(range(1, 80)), periods)
    assert not fit.overlap
    assert (fit.step_overhead_s, fit.k_matmul, fit.k_kv, fit.k_attention) == pytest.approx((0.016, 2, 1.5, 3), rel=1e-6)


def test_the_server_fit_scales_steps_to_tpot_then_adds_latency_to_ttft():
    def simulate(factor):  # TPOT grows a little faster than the factor: slower steps batch more
        return 0.1 * factor, 0.02 * factor ** 1.2

    factor, latency = fit_server(simulate, measured_ttft_p50_s=0.2, measured_tpot_p50_s=0.03)
    assert simulate(factor)[1] == pytest.approx(0.03, rel=1e-3)
    assert latency == pytest.approx(0.2 - simulate(factor)[0])
    assert fit_server(simulate, 0.01, 0.02)[1] == 0  # never a negative latency


def test_slo_parsing_and_statistics_match_the_benchmarks():
    assert parse_slo("ttft_p99=1000, tpot_p50=50") == {"ttft_p99": 1.0, "tpot_p50": 0.05}
    for bad in ("ttft=1", "speed_p50=1", "ttft_p99", ""):
        with pytest.raises(ValueError):
            parse_slo(bad)
    values = [0.3, 0.1, 0.7, 0.2, 0.9, 0.4]
    for q in (50, 90, 99):
        assert statistic(values, f"p{q}") == pytest.approx(percentile(values, q))


def test_poisson_arrivals_are_bench_servings():
    import random

    rng = random.Random(3)
    expected = [0.0]
    for _ in range(4):
        expected.append(expected[-1] + rng.expovariate(2.0))
    assert poisson_arrivals(5, 2.0, 3) == pytest.approx(expected)
    assert poisson_arrivals(3, float("inf"), 3) == [0.0, 0.0, 0.0]
