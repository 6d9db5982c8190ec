"""PrefetchTuner (engine/cpu/prefetch_tuner.py) on the GGUF kernels' real switch: one step in
`explore_every` runs with the other choice, the interval doubling while nothing changes, and the
choice moves only when the explored steps' median says it is faster by more than the margin, back
again if the host changes."""

from __future__ import annotations

import random

import pytest

from engine.cpu.gguf_extension import load_gguf_kernels
from engine.cpu.prefetch_tuner import PrefetchTuner


@pytest.fixture
def kernels():
    module = load_gguf_kernels()
    yield module
    module.set_one_token_prefetch(True)


def run(tuner: PrefetchTuner, kernels, num_steps: int, seconds_with: float, seconds_without: float,
        noise: float = 0.0, rng: random.Random | None = None, until=None) -> list[bool]:
    """Steps whose time is the choice's, with noise (or until `until(tuner)`); returns each step's
    choice, checked against the switch."""
    choices = []
    for _ in range(num_steps):
        choice = tuner.begin_step()
        assert kernels.one_token_prefetch() == choice
        seconds = seconds_with if choice else seconds_without
        tuner.end_step(seconds * (1 + noise * (2 * rng.random() - 1)) if rng else seconds)
        assert kernels.one_token_prefetch() == tuner.prefetch  # back to the current choice between steps
        choices.append(choice)
        if until is not None and until(tuner):
            break
    return choices


def test_one_step_in_explore_every_runs_the_other_choice_and_the_interval_doubles(kernels):
    tuner = PrefetchTuner(kernels.set_one_token_prefetch, explore_every=8, max_explore_every=32, window=9)
    assert kernels.one_token_prefetch()
    choices = run(tuner, kernels, 8 * 9 + 16 * 9 + 32 * 9 + 32 * 4, 0.020, 0.020)
    explored = [i + 1 for i, c in enumerate(choices) if not c]  # 1-based step numbers
    gaps = [b - a for a, b in zip([0, *explored], explored)]
    assert gaps == [8] * 9 + [16] * 9 + [32] * 13
    assert tuner.prefetch and tuner.explore_every == 32


def test_a_faster_choice_takes_over_and_gives_way_when_the_host_changes(kernels):
    tuner = PrefetchTuner(kernels.set_one_token_prefetch, explore_every=8, window=9)
    run(tuner, kernels, 8 * 8, 0.020, 0.017)  # 8 explored steps: not yet a window
    assert tuner.prefetch
    run(tuner, kernels, 8, 0.020, 0.017)
    assert not tuner.prefetch and not kernels.one_token_prefetch()
    assert tuner.explore_every == 8
    choices = run(tuner, kernels, 8 * 9 + 4, 0.020, 0.017)  # the choice holds, exploring the old one
    assert not tuner.prefetch and sum(choices) == 9 and tuner.explore_every == 16
    choices = run(tuner, kernels, 10_000, 0.016, 0.017, until=lambda t: t.prefetch)  # prefetching is now faster
    assert tuner.prefetch and kernels.one_token_prefetch()
    assert len(choices) <= 16 * 9 and tuner.explore_every == 8


def test_noise_within_the_margin_and_a_lone_outlier_move_nothing(kernels):
    tuner = PrefetchTuner(kernels.set_one_token_prefetch, explore_every=8, max_explore_every=64, window=9,
                          margin=0.03)
    choices = run(tuner, kernels, 3000, 0.020, 0.0202, noise=0.02, rng=random.Random(0))
    assert tuner.prefetch and tuner.explore_every == 64
    assert sum(not c for c in choices) == tuner.num_explored >= 3000 // 64
    tuner = PrefetchTuner(kernels.set_one_token_prefetch, explore_every=8, window=9)
    for i in range(8 * 9):
        choice = tuner.begin_step()
        tuner.end_step(0.005 if not choice and i == 7 else 0.020)  # one explored step 4x faster
    assert tuner.prefetch


def test_a_models_tuner_sets_the_switches_of_the_kernels_its_linears_run_on(kernels):
    import torch
    from torch import nn

    from engine.cpu.extension import load_cpu_kernels
    from engine.cpu.gguf_linear import GgufLinear
    from engine.cpu.host import detect_cpu_features
    from engine.cpu.int4_linear import Int4Linear
    from engine.cpu.int8_linear import Int8Linear, QuantizedLinear
    from engine.cpu.packing import PackedLinear, SlabPlan
    from engine.cpu.prefetch_tuner import prefetch_tuner_for
    from engine.cpu.quantized_plan import plan_quantization
    from tests.kernels.test_gguf_linear import make_blocks

    assert prefetch_tuner_for(nn.Sequential(nn.Linear(64, 64))) is None
    gguf = GgufLinear([("Q4_K", make_blocks("Q4_K", 16, 256))], 256)
    cpu = load_cpu_kernels()
    models = [nn.Sequential(gguf)]
    if cpu.has_small_batch_linear():  # AVX512_BF16: the slabs' kernel, and its switch
        slab = PackedLinear(torch.randn(32, 64).bfloat16(), None, 1, SlabPlan(cpu, None))
        models += [nn.Sequential(slab), nn.Sequential(gguf, slab)]
    quantized = None
    if detect_cpu_features().has_avx512_vnni:  # the int8 and int4 panels' kernels, and their one switch
        int8_plan, int4_plan = plan_quantization("cpu", True, "int8"), plan_quantization("cpu", True, "int4")
        quantized = int8_plan.kernels
        models += [nn.Sequential(Int8Linear(torch.randn(32, 64), None, int8_plan)),
                   nn.Sequential(gguf, Int4Linear(torch.randn(32, 64), None, int4_plan))]
    for model in models:
        has_gguf, has_slabs, has_panels = (any(isinstance(m, kind) for m in model)
                                           for kind in (GgufLinear, PackedLinear, QuantizedLinear))
        tuner = prefetch_tuner_for(model)
        try:
            tuner.set_prefetch(False)
            assert kernels.one_token_prefetch() != has_gguf
            assert cpu.one_token_prefetch() != has_slabs
            if quantized is not None:
                assert quantized.one_token_prefetch() != has_panels
        finally:
            kernels.set_one_token_prefetch(True)
            cpu.set_one_token_prefetch(True)
            if quantized is not None:
                quantized.set_one_token_prefetch(True)
