"""bf16 linears on slabs (engine/cpu/csrc/small_batch_linear.cpp) against torch's
matmul, and the plan that decides which steps take them (engine/cpu/packing.py)."""

import pytest
import torch

from engine.cpu.host import CpuFeatures
from engine.cpu.packing import (
    SMALL_BATCH_MAX_TOKENS, PackedLinear, gather_slabs_on_huge_pages, pack_slabs, plan_slabs,
)
from tests.helpers.prefetch_switch import outputs_both_ways

try:
    from engine.cpu.extension import load_cpu_kernels

    KERNELS = load_cpu_kernels()
except Exception as exc:  # the build needs a C++ compiler
    pytest.skip(f"CPU kernels cannot be built here: {exc}", allow_module_level=True)

HAS_SLABS = KERNELS.has_small_batch_linear()
# The kernel exists only where the CPU has AVX512_BF16 (the build is -march=native); elsewhere
# the plan keeps oneDNN, which the rest of the suite covers.
needs_slabs = pytest.mark.skipif(not HAS_SLABS, reason="the CPU has no AVX512_BF16")
NO_AMX = CpuFeatures(has_amx_bf16=False, has_avx512_bf16=True)
AMX = CpuFeatures(has_amx_bf16=True, has_avx512_bf16=True)


def reference(x, weight, bias):
    out = x.float() @ weight.float().t()  # [num_tokens, out_features], fp32 sums of exact products
    return out if bias is None else out + bias.float()


def test_slabs_hold_each_features_pairs():
    weight = torch.arange(32 * 6, dtype=torch.float32).reshape(32, 6).bfloat16()
    slabs = pack_slabs(weight)
    assert slabs.shape == (2, 3, 16) and slabs.dtype == torch.int32
    pair = slabs[1, 2, 5].reshape(1).view(torch.bfloat16)  # feature 16 + 5, elements 4 and 5
    assert pair.tolist() == weight[21, 4:6].tolist()


@needs_slabs
@pytest.mark.parametrize("num_tokens", [1, 3, 8, 9, 17, 64])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_an_fp32_matmul_rounded_once(num_tokens, with_bias):
    gen = torch.Generator().manual_seed(num_tokens)
    weight = torch.randn(48, 96, generator=gen).bfloat16()
    bias = torch.randn(48, generator=gen).bfloat16() if with_bias else None
    x = torch.randn(num_tokens, 96, generator=gen).bfloat16()
    slab_bias = bias if with_bias else torch.empty(0, dtype=torch.bfloat16)
    out = KERNELS.small_batch_linear(x, pack_slabs(weight), slab_bias, False)
    assert out.shape == (num_tokens, 48) and out.dtype == torch.bfloat16
    expected = reference(x, weight, bias)
    # One bf16 rounding of an fp32 sum: within half a bf16 ulp of the value, plus the fp32 order.
    torch.testing.assert_close(out.float(), expected, atol=1e-3, rtol=2**-8)
    # Unrounded (logits): the fp32 sums, equal to fp32 products summed in another order.
    out = KERNELS.small_batch_linear(x, pack_slabs(weight), slab_bias, True)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-5)


@needs_slabs
@pytest.mark.parametrize("num_tokens,in_features", [(2, 98), (12, 98), (13, 98), (25, 98), (37, 2), (512, 2048), (300, 8192)])
def test_a_tokens_output_is_the_same_bits_whatever_the_step(num_tokens, in_features):
    """The passes split a step's tokens and interleave each pass's rows (odd pair counts, one
    pair, a large step's copy split over the threads, a 300-token step of 8,192 inputs in two
    chunks of rows): a token's sums must not depend on which pass or chunk it lands in, or a
    sequence would answer differently alone and in a batch."""
    gen = torch.Generator().manual_seed(num_tokens)
    weight, x = torch.randn(32, in_features, generator=gen).bfloat16(), torch.randn(num_tokens, in_features, generator=gen).bfloat16()
    slabs, no_bias = pack_slabs(weight), torch.empty(0, dtype=torch.bfloat16)
    together = KERNELS.small_batch_linear(x, slabs, no_bias, True)
    for i in {0, num_tokens // 2, num_tokens - 1}:
        assert torch.equal(together[i], KERNELS.small_batch_linear(x[i:i + 1], slabs, no_bias, True)[0]), i
    # fp32 sums in another order than the reference's: the error grows with the number of inputs.
    torch.testing.assert_close(together, reference(x, weight, None), atol=1e-5 * in_features**0.5, rtol=1e-5)


@needs_slabs
@pytest.mark.parametrize("num_threads", [1, 2, 3, 4])
def test_every_slab_is_computed_once_whatever_the_share_out(num_threads):
    # 65 slabs: each thread's own part (32 and 33 slabs with 2 threads, 16 or 17 with 4) in
    # chunks of 4, 2 or 2 that leave a remainder; with more threads than the machine has
    # cores, threads that finish early take chunks from the back of the others' parts.
    gen = torch.Generator().manual_seed(num_threads)
    weight = torch.randn(65 * 16, 64, generator=gen).bfloat16()
    x = torch.randn(5, 64, generator=gen).bfloat16()
    before = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        out = KERNELS.small_batch_linear(x, pack_slabs(weight), torch.empty(0, dtype=torch.bfloat16), True)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(out, reference(x, weight, None), atol=1e-4, rtol=1e-5)


@needs_slabs
def test_no_output_features_gives_an_empty_result():
    slabs = torch.empty(0, 4, 16, dtype=torch.int32)
    out = KERNELS.small_batch_linear(torch.randn(3, 8).bfloat16(), slabs, torch.empty(0, dtype=torch.bfloat16), False)
    assert out.shape == (3, 0)


@needs_slabs
def test_rejects_mismatched_shapes():
    slabs = pack_slabs(torch.randn(16, 8).bfloat16())
    empty = torch.empty(0, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="features disagree"):
        KERNELS.small_batch_linear(torch.randn(2, 10).bfloat16(), slabs, empty, False)
    with pytest.raises(RuntimeError, match="bf16"):
        KERNELS.small_batch_linear(torch.randn(2, 8), slabs, empty, False)
    with pytest.raises(RuntimeError, match="bias"):
        KERNELS.small_batch_linear(torch.randn(2, 8).bfloat16(), slabs, torch.zeros(15, dtype=torch.bfloat16), False)


@needs_slabs
def test_plan_without_amx_takes_slabs_for_every_step_and_drops_onednns_copy():
    plan = plan_slabs(torch.bfloat16, 1 << 20, NO_AMX)
    assert plan is not None and plan.max_tokens is None
    weight, bias = torch.randn(32, 64).bfloat16(), torch.randn(32).bfloat16()
    linear = PackedLinear(weight, bias, 8, plan)
    assert linear.packed_weight is None and linear.slabs is not None
    for num_tokens in (1, 100):
        x = torch.randn(num_tokens, 64).bfloat16()
        torch.testing.assert_close(linear(x).float(), reference(x, weight, bias), atol=1e-3, rtol=2**-8)


@needs_slabs
def test_plan_with_amx_keeps_onednn_for_big_steps():
    plan = plan_slabs(torch.bfloat16, 1 << 20, AMX)
    assert plan is not None and plan.max_tokens == SMALL_BATCH_MAX_TOKENS
    linear = PackedLinear(torch.randn(32, 64).bfloat16(), None, 8, plan)
    assert linear.packed_weight is not None and linear.slabs is not None
    calls = []
    real = plan.kernels

    class Spy:
        def small_batch_linear(self, *args):
            calls.append(args[0].shape[0])
            return real.small_batch_linear(*args)

    linear.slab_plan = type(plan)(Spy(), plan.max_tokens)
    linear(torch.randn(SMALL_BATCH_MAX_TOKENS, 64).bfloat16())
    linear(torch.randn(SMALL_BATCH_MAX_TOKENS + 1, 64).bfloat16())
    assert calls == [SMALL_BATCH_MAX_TOKENS]
    assert plan_slabs(torch.bfloat16, 5 << 30, AMX) is None  # too big to copy


def test_no_slabs_for_fp32_or_shapes_that_do_not_fit():
    assert plan_slabs(torch.float32, 1 << 20, NO_AMX) is None
    if HAS_SLABS:
        plan = plan_slabs(torch.bfloat16, 1 << 20, NO_AMX)
        odd = PackedLinear(torch.randn(40, 64).bfloat16(), None, 8, plan)  # 40 features: no whole slabs
        assert odd.slabs is None and odd.packed_weight is not None


@needs_slabs
def test_gathering_slabs_onto_huge_pages_keeps_every_output(monkeypatch):
    plan = plan_slabs(torch.bfloat16, 1 << 20, NO_AMX)
    generator = torch.Generator().manual_seed(0)
    model = torch.nn.ModuleList(
        PackedLinear(torch.randn(n, k, generator=generator).bfloat16(), None, 8, plan) for n, k in [(32, 64), (48, 32), (4096, 64)]
    )
    inputs = [torch.randn(5, linear.in_features, generator=generator).bfloat16() for linear in model]
    before = [linear(x) for linear, x in zip(model, inputs)]
    old_slabs = [linear.slabs.clone() for linear in model]
    monkeypatch.setattr("engine.cpu.huge_pages.huge_pages_on_request", lambda: True)
    moved = gather_slabs_on_huge_pages(model)
    assert moved == sum(s.numel() * 4 for s in old_slabs)
    storage = model[0].slabs.untyped_storage().data_ptr()
    for linear, old, x, out in zip(model, old_slabs, inputs, before):
        assert linear.slabs.untyped_storage().data_ptr() == storage  # one tensor: one run of huge pages
        assert torch.equal(linear.slabs, old)
        assert torch.equal(linear(x), out)
    monkeypatch.setattr("engine.cpu.huge_pages.huge_pages_on_request", lambda: False)
    assert gather_slabs_on_huge_pages(model) == 0  # where Linux will not give them, nothing moves


@needs_slabs
def test_one_tokens_prefetch_switch_leaves_the_bits():
    """set_one_token_prefetch (engine/cpu/prefetch_tuner.py steers it) moves no data the kernel
    computes with: one token's sums are the same bits either way, a chunk of rows past the first
    (the next slab's lines prefetched meanwhile) too."""
    gen = torch.Generator().manual_seed(5)
    weight, x = torch.randn(4096, 512, generator=gen).bfloat16(), torch.randn(1, 512, generator=gen).bfloat16()
    slabs, no_bias = pack_slabs(weight), torch.empty(0, dtype=torch.bfloat16)
    outputs = outputs_both_ways(KERNELS, lambda rows: KERNELS.small_batch_linear(rows, slabs, no_bias, True), x)
    assert torch.equal(*outputs)
    torch.testing.assert_close(outputs[0], reference(x, weight, None), atol=1e-4, rtol=1e-5)
