"""The simulator takes the engine's own scheduling decisions: the same workload through
the real EngineCore (a tiny random-weight model) and through the simulator gives the
same steps with the same batch sizes and token counts (padding too), in every batching mode and
through preemption. Also: the JSON carries the benchmarks' fields, and 10,000 requests
simulate in under a minute."""

from __future__ import annotations

import random
import time

import pytest

from engine.simulator.hardware_profile import HardwareProfile, load_profile
from engine.simulator.model_shape import load_model_shape
from engine.simulator.simulator import SimulatedRequest, Simulator, SimulatorConfig
from engine.core.step_stats import padding_of
from scripts.lib.make_model_config import write_model_config

PROFILE = HardwareProfile("test", "test", {"float32": 1e12}, 1e11, overlap=False, step_overhead_s=1e-3)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return write_model_config("tiny", tmp_path_factory.mktemp("tiny"))


def workload(num_requests: int, seed: int = 0) -> list[SimulatedRequest]:
    rng = random.Random(seed)
    requests = []
    for _ in range(num_requests):
        prompt = [rng.randrange(100, 1000) for _ in range(rng.randint(4, 90))]
        requests.append(SimulatedRequest(len(prompt), rng.randint(1, 30), 0.0, prompt))
    return requests


def engine_steps(folder, requests, **config) -> tuple[list[tuple[int, int]], list[int]]:
    from engine.config import EngineConfig
    from engine.loop.engine_core import EngineCore
    from ipc.sampling_params import SamplingParams

    engine = EngineCore(EngineConfig(model=str(folder), load_format="dummy", dtype="float32",
                                     attention_backend="torch", cpu_prepack=False, **config))
    for i, r in enumerate(requests):
        engine.add_request(str(i), r.prompt_token_ids, SamplingParams(temperature=0.0, max_tokens=r.max_tokens,
                                                                      ignore_eos=True))
    engine.record_step_stats = True
    num_outputs = [0] * len(requests)
    while engine.has_unfinished_requests():
        for output in engine.step().outputs:
            num_outputs[int(output.request_id)] += len(output.new_token_ids)
    return [step_record(s) for s in engine.step_stats], num_outputs


def step_record(s) -> tuple[int, int, int, int]:
    return s.num_seqs, s.num_tokens, *padding_of(s)


@pytest.mark.parametrize("batching, max_num_seqs, num_kv_blocks", [
    ("continuous", 8, 256),
    ("static", 6, 256),
    ("static-padded", 6, 256),
    ("static-padded", 6, 40),  # reservations this large admit fewer rows
    ("continuous", 8, 20),  # a pool this small preempts
])
def test_simulator_and_engine_take_the_same_steps(tiny_folder, batching, max_num_seqs, num_kv_blocks):
    requests = workload(24)
    config = dict(batching=batching, max_num_seqs=max_num_seqs, max_num_batched_tokens=128, block_size=8,
                  num_kv_blocks=num_kv_blocks)
    engine, engine_outputs = engine_steps(tiny_folder, requests, **config)
    result = Simulator(load_model_shape(str(tiny_folder), "float32"), PROFILE, SimulatorConfig(**config)).run(requests)
    assert [step_record(s) for s in result.step_stats] == engine
    assert [len(r.token_times) for r in result.requests] == engine_outputs == [r.max_tokens for r in requests]
    if num_kv_blocks == 20:
        assert result.num_preemptions > 0
    if batching == "static-padded":
        assert sum(s.num_padding_tokens for s in result.step_stats) > 0 and result.num_preemptions == 0


def test_time_runs_on_the_price_and_requests_arrive_on_their_timestamps(tiny_folder):
    shape = load_model_shape(str(tiny_folder), "float32")
    simulator = Simulator(shape, PROFILE, SimulatorConfig(num_kv_blocks=256))
    result = simulator.run([SimulatedRequest(10, 3, 0.0), SimulatedRequest(10, 2, 5.0)])
    first, second = result.requests
    steps = result.step_stats
    assert steps[0].start_time == 0 and all(a.end_time <= b.start_time for a, b in zip(steps, steps[1:]))
    assert [s.num_seqs for s in steps] == [1, 1, 1, 1, 1]  # the second arrives long after the first is done
    assert first.token_times == [s.end_time for s in steps[:3]]
    assert steps[3].start_time == 5.0 and second.ttft_s == pytest.approx(steps[3].end_time - 5.0)
    cost = simulator.cost_model.price
    assert all(s.end_time - s.start_time == pytest.approx(cost(shape_).total_s)
               for s, shape_ in zip(steps, result.step_shapes))


def test_the_json_has_the_benchmarks_fields(tmp_path):
    from scripts.lib.bench_metrics import summarize_traces
    from scripts.lib.offline_result import ModeResult
    from scripts.simulate.run import main

    report = main(["--model", "mistral-7b", "--hardware", "h100-sxm", "--num-requests", "20", "--request-rate", "5",
                   "--json", str(tmp_path / "out.json")])
    offline = ModeResult("continuous", 1.0, 1, 1, 1, 1, 1, [0.1], [0.2], [object()]).summary()
    serving = summarize_traces([], 1.0)
    assert set(offline) | set(serving) <= set(report)
    for key in ("ttft_s", "tpot_s", "itl_s", "latency_s"):
        assert set(report[key]) == set(serving[key])
    assert report["num_successful"] == 20 and report["total_tokens_per_s"] > 0
    assert len(report["kv_blocks_used"]["num_blocks"]) == report["num_steps"]


def test_calibrated_profile_is_found_or_named(monkeypatch, tmp_path):
    monkeypatch.setenv("TOKENLOOM_CACHE", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="--calibrate"):
        load_profile("calibrated")
    PROFILE.save(tmp_path / "simulator" / "calibrated.json")
    assert load_profile("calibrated") == PROFILE


@pytest.mark.slow
def test_ten_thousand_requests_in_under_a_minute():
    from scripts.simulate.run import main

    start = time.perf_counter()
    report = main(["--model", "mistral-7b", "--hardware", "h100-sxm", "--num-requests", "10000",
                   "--max-num-seqs", "256"])
    assert time.perf_counter() - start < 60
    assert report["num_successful"] == 10000
