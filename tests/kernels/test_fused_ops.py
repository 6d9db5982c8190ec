"""The fused C++ CPU ops (engine/cpu/csrc/fused_ops.cpp) against the torch code they
replace (engine/models/layers.py, the head-major backends' store_kv): the same bits in
fp32, bf16 and fp16, and a KV store that writes its slots and nothing else."""

from __future__ import annotations

import pytest
import torch

from engine.attention import head_major
from engine.cpu.fused import CpuFusedOps, select_fused_ops
from engine.models.layers import RotaryEmbedding, apply_rotary, rms_norm, silu_and_mul

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
NUM_TOKENS = [1, 7, 64, 300]


@pytest.fixture(scope="module")
def ops() -> CpuFusedOps:
    from engine.cpu.extension import load_cpu_kernels

    try:
        kernels = load_cpu_kernels()
    except Exception as exc:  # no compiler: the engine runs the torch ops instead
        pytest.skip(f"CPU kernels unavailable: {exc}")
    return CpuFusedOps(kernels)


def random(*shape, dtype, scale=1.0, seed=0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=generator) * scale).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
@pytest.mark.parametrize("hidden", [576, 40, 4100])
def test_add_rms_norm_matches_torch_bitwise(ops, dtype, num_tokens, hidden):
    x = random(num_tokens, hidden, dtype=dtype, scale=3, seed=1)  # [num_tokens, hidden]
    residual = random(num_tokens, hidden, dtype=dtype, seed=2)
    weight = random(hidden, dtype=dtype, seed=3)
    expected_residual = residual + x  # the decoder's residual add, then the norm
    expected = rms_norm(expected_residual, weight, 1e-5)
    out, new_residual = ops.add_rms_norm(x, residual, weight, 1e-5)
    assert out.data_ptr() == x.data_ptr() and new_residual.data_ptr() == residual.data_ptr()  # in place
    assert torch.equal(new_residual, expected_residual)
    assert torch.equal(out, expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
@pytest.mark.parametrize("hidden", [576, 40, 7])
def test_rms_norm_matches_torch_bitwise(ops, dtype, num_tokens, hidden):
    x = random(num_tokens, hidden, dtype=dtype, scale=3, seed=4)
    weight = random(hidden, dtype=dtype, seed=5)
    before = x.clone()
    assert torch.equal(ops.rms_norm(x, weight, 1e-6), rms_norm(x, weight, 1e-6))
    assert torch.equal(x, before)  # out of place: the first layer's input is also its residual


def test_rms_norm_probe_found_torch_sum_order(ops):
    """Without the probed width the sum's order, hence some roundings, differ (the test can fail)."""
    x = random(64, 1000, dtype=torch.float32, scale=3, seed=6)
    weight = torch.ones(1000)
    expected = rms_norm(x, weight, 1e-6)
    results = {lanes: torch.equal(ops.kernels.rms_norm(x, weight, 1e-6, lanes), expected) for lanes in (16, 8, 1)}
    assert results[ops.sum_lanes]
    assert not all(results.values())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
@pytest.mark.parametrize("intermediate", [1536, 40, 7])
def test_silu_and_mul_matches_torch_bitwise(ops, dtype, num_tokens, intermediate):
    gate_up = random(num_tokens, 2 * intermediate, dtype=dtype, scale=4, seed=7)  # [num_tokens, 2 * intermediate]
    out = ops.silu_and_mul(gate_up)
    assert out.shape == (num_tokens, intermediate)
    assert torch.equal(out, silu_and_mul(gate_up))


@pytest.mark.parametrize("num_tokens", [1, 64])
def test_silu_and_mul_kernel_gives_torch_fp32_bits_on_vector_cpus(ops, num_tokens):
    """On AVX2 (and AVX-512) hosts the kernel's own fp32 SiLU, SLEEF's expf at ATen's width, is
    torch's bit for bit, so fp32 rows run the kernel, not torch's op in its place (the test can
    fail: before the AVX2 branch no width matched on an AVX2 host, and the scalar expf cost a
    1B model's one-token step 0.5 ms)."""
    from engine.cpu.host import cpu_flags

    if not {"avx2", "avx512f"} & cpu_flags():
        pytest.skip("no AVX2 or AVX-512: the kernel's SiLU is glibc's scalar expf")
    assert ops.is_silu_exact
    gate_up = random(num_tokens, 2 * 1544, dtype=torch.float32, scale=4, seed=9)  # 1544 = 48 * 32 + 8: a tail
    assert torch.equal(ops.kernels.silu_and_mul(gate_up, ops.silu_lanes), silu_and_mul(gate_up))


NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, NUM_BLOCKS, BLOCK_SIZE = 9, 3, 64, 40, 16


def rotary_inputs(num_tokens: int, dtype: torch.dtype, seed: int = 8):
    qkv = random(num_tokens, (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM, dtype=dtype, seed=seed)
    rotary = RotaryEmbedding(HEAD_DIM, 4096, 10000.0, None)
    generator = torch.Generator().manual_seed(seed)
    positions = torch.randint(0, 4096, (num_tokens,), generator=generator)  # [num_tokens]
    cos_sin = rotary.cos_sin(positions, dtype)  # [num_tokens, 1, head_dim] each
    # Scattered slots across the pool, in no order.
    slot_mapping = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, generator=generator)[:num_tokens]
    k_cache = random(NUM_BLOCKS, NUM_KV_HEADS, BLOCK_SIZE, HEAD_DIM, dtype=dtype, seed=seed + 1)
    v_cache = random(NUM_BLOCKS, NUM_KV_HEADS, BLOCK_SIZE, HEAD_DIM, dtype=dtype, seed=seed + 2)
    return qkv, cos_sin, slot_mapping, k_cache, v_cache


def reference_rotary_store(qkv, cos_sin, slot_mapping, k_cache, v_cache):
    """The model's torch path: split, rotate, index_put into the caches (modified in place)."""
    num_tokens = qkv.shape[0]
    q, k, v = qkv.split([NUM_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM], dim=-1)
    q, k = apply_rotary(
        q.view(num_tokens, NUM_HEADS, HEAD_DIM), k.view(num_tokens, NUM_KV_HEADS, HEAD_DIM), cos_sin
    )
    v = v.view(num_tokens, NUM_KV_HEADS, HEAD_DIM)
    head_major.store_kv(k, v, (k_cache, v_cache), head_major.split_slots(slot_mapping, BLOCK_SIZE))
    return q


def rotary_store_kv(ops, qkv, cos_sin, slot_mapping, k_cache, v_cache, num_heads, num_kv_heads):
    """The fused kernel as the head-major backends call it."""
    slots = head_major.split_slots(slot_mapping, BLOCK_SIZE)
    return head_major.rotary_store_kv(ops.kernels, qkv, cos_sin, (k_cache, v_cache), slots, num_heads, num_kv_heads)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
def test_rotary_store_kv_matches_torch_bitwise(ops, dtype, num_tokens):
    qkv, cos_sin, slot_mapping, k_cache, v_cache = rotary_inputs(num_tokens, dtype)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    expected_q = reference_rotary_store(qkv, cos_sin, slot_mapping, expected_k, expected_v)
    q = rotary_store_kv(ops, qkv, cos_sin, slot_mapping, k_cache, v_cache, NUM_HEADS, NUM_KV_HEADS)
    assert q.shape == (num_tokens, NUM_HEADS, HEAD_DIM) and q.is_contiguous()
    assert torch.equal(q, expected_q)
    # The whole pool: the written slots hold the same bits, every other slot is untouched.
    assert torch.equal(k_cache, expected_k)
    assert torch.equal(v_cache, expected_v)
    # Rotated k also replaces k inside qkv, for prompts that attend to their own keys.
    k_rows = qkv[:, NUM_HEADS * HEAD_DIM : (NUM_HEADS + NUM_KV_HEADS) * HEAD_DIM].view(num_tokens, NUM_KV_HEADS, HEAD_DIM)
    blocks, offsets = slot_mapping // BLOCK_SIZE, slot_mapping % BLOCK_SIZE
    assert torch.equal(k_rows, expected_k[blocks, :, offsets])


def test_rotary_store_kv_writes_only_its_slots(ops):
    qkv, cos_sin, slot_mapping, k_cache, v_cache = rotary_inputs(5, torch.float32)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    rotary_store_kv(ops, qkv, cos_sin, slot_mapping, k_cache, v_cache, NUM_HEADS, NUM_KV_HEADS)
    changed = (k_cache != before_k).any(-1).any(1).flatten()  # [num_blocks * block_size] per slot
    assert set(changed.nonzero().flatten().tolist()) == set(slot_mapping.tolist())
    v = qkv[:, (NUM_HEADS + NUM_KV_HEADS) * HEAD_DIM :].view(5, NUM_KV_HEADS, HEAD_DIM)
    blocks, offsets = slot_mapping // BLOCK_SIZE, slot_mapping % BLOCK_SIZE
    assert torch.equal(v_cache[blocks, :, offsets], v)
    untouched = torch.ones(NUM_BLOCKS * BLOCK_SIZE, dtype=torch.bool)
    untouched[slot_mapping] = False
    by_slot = v_cache.transpose(1, 2).reshape(-1, NUM_KV_HEADS, HEAD_DIM)  # [num_slots, num_kv_heads, head_dim]
    before_by_slot = before_v.transpose(1, 2).reshape(-1, NUM_KV_HEADS, HEAD_DIM)
    assert torch.equal(by_slot[untouched], before_by_slot[untouched])


def test_rotary_store_kv_skips_padding_slots(ops):
    qkv, cos_sin, slot_mapping, k_cache, v_cache = rotary_inputs(4, torch.float32)
    slot_mapping[1] = -1  # a padded row (cuda_graphs.PAD_SLOT_ID): rotated q, nothing stored
    keep = slot_mapping >= 0
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    reference_rotary_store(qkv[keep], tuple(c[keep] for c in cos_sin), slot_mapping[keep], expected_k, expected_v)
    q = rotary_store_kv(ops, qkv, cos_sin, slot_mapping, k_cache, v_cache, NUM_HEADS, NUM_KV_HEADS)
    assert torch.equal(q[keep], reference_rotary_store(qkv, cos_sin, slot_mapping.clamp(min=0), k_cache.clone(), v_cache.clone())[keep])
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


@pytest.mark.parametrize("bad_slot", [NUM_BLOCKS * BLOCK_SIZE, NUM_BLOCKS * BLOCK_SIZE * 100])
def test_rotary_store_kv_rejects_slots_outside_the_cache(ops, bad_slot):
    qkv, cos_sin, slot_mapping, k_cache, v_cache = rotary_inputs(3, torch.float32)
    slot_mapping[2] = bad_slot
    before = k_cache.clone()
    with pytest.raises(RuntimeError, match="outside the cache"):
        rotary_store_kv(ops, qkv, cos_sin, slot_mapping, k_cache, v_cache, NUM_HEADS, NUM_KV_HEADS)
    assert torch.equal(k_cache, before)  # checked before anything is written


def test_rotary_store_kv_rejects_mismatched_shapes(ops):
    qkv, cos_sin, slot_mapping, k_cache, v_cache = rotary_inputs(3, torch.float32)
    with pytest.raises(RuntimeError):
        rotary_store_kv(ops, qkv, cos_sin, slot_mapping, k_cache, v_cache, NUM_HEADS + 1, NUM_KV_HEADS)
    with pytest.raises(RuntimeError):
        rotary_store_kv(ops, qkv.bfloat16(), cos_sin, slot_mapping, k_cache, v_cache, NUM_HEADS, NUM_KV_HEADS)


@pytest.mark.parametrize(
    "device, backend_name, is_compiled",
    [("cpu", "triton", False), ("cpu", "cpu", True), ("meta", "cpu", False)],
)
def test_fused_ops_stay_off_where_they_do_not_apply(device, backend_name, is_compiled):
    """Compiled graphs keep the torch ops for inductor; the Triton cache layout is token-major."""
    assert select_fused_ops(torch.device(device), backend_name, is_compiled) is None
