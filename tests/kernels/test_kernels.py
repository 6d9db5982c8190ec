"""Triton kernels against short pure-torch references (STYLE.md item 9).

Without CUDA the kernels run under Triton's interpreter (numpy on the CPU), so
the same tests run on a laptop and on a GPU; sizes are kept small for it.
"""

import math
import os

import torch

# The interpreter must be on before any kernel is defined: @triton.jit reads
# TRITON_INTERPRET when it decorates, i.e. when engine.kernels.* is first
# imported, and the safe rule across Triton versions is "before triton is first
# imported". So this sits above every triton/engine import, and no module
# collected earlier in the session (nor a conftest) may import triton or the
# kernels first; if one does, the guard below skips this module rather than
# failing with a confusing device error.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from engine.attention.metadata import AttentionMetadata  # noqa: E402
from engine.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from engine.kernels.decode_attention import choose_num_splits, paged_decode_attention  # noqa: E402
from engine.kernels.prefill_attention import paged_prefill_attention  # noqa: E402
from engine.kernels.store_kv import store_kv, store_kv_kernel  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and type(store_kv_kernel).__name__ != "InterpretedFunction":
    pytest.skip("engine.kernels was imported before TRITON_INTERPRET=1 was set; "
                "run this file alone or set it in the environment", allow_module_level=True)

TOLERANCES = {torch.float32: 2e-4, torch.bfloat16: 3e-2, torch.float16: 5e-3}
# Triton 3.9's interpreter runs tl.dot on bf16's raw uint16 storage (numpy has no
# bf16), returning garbage, so bf16 attention is only checked on a GPU; fp16 and
# bf16 copies (store_kv) work under the interpreter.
BF16_DOT = pytest.param(torch.bfloat16, id="bf16", marks=pytest.mark.skipif(
    DEVICE == "cpu", reason="interpreter tl.dot multiplies bf16 bit patterns as integers"))
LOW_PRECISION = [pytest.param(torch.float16, id="fp16"), BF16_DOT]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def make_batch(seq_lens, query_lens, block_size, num_kv_heads, queries_per_kv, head_dim,
               dtype=torch.float32, seed=0):
    """Random query, per-sequence context K/V, and metadata with shuffled block tables.

    The caches hold only each sequence's cached prefix (positions < seq_len -
    query_len); the new tokens' K/V come back as a flat [num_tokens, ...] pair to
    pass through store_kv. Every other slot is NaN, block 0 is never allocated,
    and block-table padding points at it: a kernel reading past a context then
    poisons its output instead of passing by luck.
    """
    gen = torch.Generator().manual_seed(seed)
    num_seq_blocks = [cdiv(n, block_size) for n in seq_lens]
    num_blocks = 1 + sum(num_seq_blocks) + 2
    block_ids = (1 + torch.randperm(num_blocks - 1, generator=gen)).tolist()
    block_tables = torch.zeros(len(seq_lens), max(num_seq_blocks) + 1, dtype=torch.int32)
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(cache_shape, float("nan"), dtype=dtype)
    v_cache = torch.full(cache_shape, float("nan"), dtype=dtype)
    k_ctx, v_ctx, new_slots = [], [], []
    for i, (seq_len, query_len) in enumerate(zip(seq_lens, query_lens)):
        blocks = [block_ids.pop() for _ in range(num_seq_blocks[i])]
        block_tables[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        positions = torch.arange(seq_len)
        slots = torch.tensor(blocks)[positions // block_size] * block_size + positions % block_size
        k = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        num_cached = seq_len - query_len
        k_cache.view(-1, num_kv_heads, head_dim)[slots[:num_cached]] = k[:num_cached]
        v_cache.view(-1, num_kv_heads, head_dim)[slots[:num_cached]] = v[:num_cached]
        k_ctx.append(k)
        v_ctx.append(v)
        new_slots.append(slots[num_cached:])
    num_tokens = sum(query_lens)
    query = torch.randn(num_tokens, num_kv_heads * queries_per_kv, head_dim, generator=gen).to(dtype)
    metadata = AttentionMetadata(
        slot_mapping=torch.cat(new_slots).to(DEVICE),
        query_start_loc=torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        block_tables=block_tables.to(DEVICE),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_lens_cpu=list(query_lens),
        seq_lens_cpu=list(seq_lens),
    )
    new_k = torch.cat([k[n - q:] for k, n, q in zip(k_ctx, seq_lens, query_lens)])
    new_v = torch.cat([v[n - q:] for v, n, q in zip(v_ctx, seq_lens, query_lens)])
    return (query.to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE), new_k.to(DEVICE), new_v.to(DEVICE),
            k_ctx, v_ctx, metadata)


def fill_new_tokens(k_cache, v_cache, new_k, new_v, metadata):
    """Write the new tokens with plain torch indexing (the kernels' tests must not depend on store_kv)."""
    k_cache.view(-1, *k_cache.shape[2:])[metadata.slot_mapping] = new_k
    v_cache.view(-1, *v_cache.shape[2:])[metadata.slot_mapping] = new_v


def gather_context(cache, block_tables, seq_idx, seq_len):
    """One sequence's [seq_len, num_kv_heads, head_dim] read back through its block table."""
    block_size = cache.shape[1]
    blocks = block_tables[seq_idx, : cdiv(seq_len, block_size)].long()
    return cache[blocks].flatten(0, 1)[:seq_len]


def reference_attention(query, k_ctx, v_ctx, query_lens, scale, window=0):
    """Causal SDPA per sequence, in fp32, queries offset to the end of their context (with a
    window, a query at position p sees keys p - window < k <= p)."""
    outs, start = [], 0
    for k, v, query_len in zip(k_ctx, v_ctx, query_lens):
        seq_len = k.shape[0]
        q = query[start : start + query_len].float().transpose(0, 1).cpu()  # [num_heads, query_len, head_dim]
        queries_per_kv = q.shape[0] // k.shape[1]
        k = k.float().cpu().repeat_interleave(queries_per_kv, 1).transpose(0, 1)  # [num_heads, seq_len, head_dim]
        v = v.float().cpu().repeat_interleave(queries_per_kv, 1).transpose(0, 1)
        positions = seq_len - query_len + torch.arange(query_len)
        mask = torch.arange(seq_len)[None, :] <= positions[:, None]  # [query_len, seq_len]
        if window > 0:
            mask &= torch.arange(seq_len)[None, :] > positions[:, None] - window
        outs.append(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale).transpose(0, 1))
        start += query_len
    return torch.cat(outs)  # [num_tokens, num_heads, head_dim]


def reference_from_cache(query, k_cache, v_cache, metadata, scale, window=0):
    block_tables = metadata.block_tables.cpu()
    k_ctx = [gather_context(k_cache.cpu(), block_tables, i, n) for i, n in enumerate(metadata.seq_lens_cpu)]
    v_ctx = [gather_context(v_cache.cpu(), block_tables, i, n) for i, n in enumerate(metadata.seq_lens_cpu)]
    return reference_attention(query, k_ctx, v_ctx, metadata.query_lens_cpu, scale, window)


def assert_close(actual, expected, dtype):
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(actual.float().cpu(), expected, atol=tol, rtol=tol)


# Context lengths: one token, ends mid-block, exactly one or two blocks, past a
# block size of 32 by one (block sizes 16 and 32 both see partial last blocks).
DECODE_SEQ_LENS = [1, 7, 16, 33, 64, 45]
# (block_size, num_kv_heads, queries_per_kv, head_dim): GQA 1, 3, 4; heads 64, 128.
DECODE_SHAPES = [(16, 2, 1, 64), (32, 1, 3, 128), (16, 1, 4, 128), (32, 2, 4, 64)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("block_size", [16, 32])
def test_store_kv(block_size, dtype):
    num_kv_heads, head_dim, num_tokens = 2, 64, 9
    gen = torch.Generator().manual_seed(1)
    k_cache = torch.randn(4, block_size, num_kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    v_cache = torch.randn(4, block_size, num_kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    # K and V as strided views into one fused tensor, as the model slices them out.
    kv = torch.randn(num_tokens, 2, num_kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    key, value = kv[:, 0], kv[:, 1]
    slots = torch.randperm(4 * block_size, generator=gen)[:num_tokens]
    slots[[2, 5]] = -1  # padding tokens are skipped
    slot_mapping = slots.to(DEVICE)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    written = slots >= 0
    expected_k.view(-1, num_kv_heads, head_dim)[slots[written]] = key.cpu()[written].to(DEVICE)
    expected_v.view(-1, num_kv_heads, head_dim)[slots[written]] = value.cpu()[written].to(DEVICE)
    store_kv(key, value, k_cache, v_cache, slot_mapping)
    assert torch.equal(k_cache, expected_k)
    assert torch.equal(v_cache, expected_v)


@pytest.mark.parametrize("num_splits", [1, 3, None])
@pytest.mark.parametrize("shape", DECODE_SHAPES, ids=lambda s: "bs{}-kv{}-gqa{}-d{}".format(*s))
def test_decode_attention(shape, num_splits):
    block_size, num_kv_heads, queries_per_kv, head_dim = shape
    seq_lens = DECODE_SEQ_LENS
    query, k_cache, v_cache, new_k, new_v, _, _, md = make_batch(
        seq_lens, [1] * len(seq_lens), block_size, num_kv_heads, queries_per_kv, head_dim)
    fill_new_tokens(k_cache, v_cache, new_k, new_v, md)
    scale = head_dim ** -0.5
    out = paged_decode_attention(query, k_cache, v_cache, md.block_tables, md.seq_lens,
                                 md.max_seq_len, scale, num_splits=num_splits)
    assert_close(out, reference_from_cache(query, k_cache, v_cache, md, scale), torch.float32)


@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_decode_attention_low_precision(dtype, num_splits):
    query, k_cache, v_cache, new_k, new_v, _, _, md = make_batch(
        [9, 40, 100], [1, 1, 1], 16, 2, 4, 64, dtype=dtype)
    fill_new_tokens(k_cache, v_cache, new_k, new_v, md)
    out = paged_decode_attention(query, k_cache, v_cache, md.block_tables, md.seq_lens,
                                 md.max_seq_len, 0.125, num_splits=num_splits)
    assert out.dtype == dtype
    assert_close(out, reference_from_cache(query, k_cache, v_cache, md, 0.125), dtype)


def test_decode_split_k_more_splits_than_blocks():
    # 8 splits of a 2-block context: most chunks are empty and must weigh zero.
    query, k_cache, v_cache, new_k, new_v, _, _, md = make_batch([3, 20], [1, 1], 16, 1, 3, 64)
    fill_new_tokens(k_cache, v_cache, new_k, new_v, md)
    out = paged_decode_attention(query, k_cache, v_cache, md.block_tables, md.seq_lens,
                                 md.max_seq_len, 0.125, num_splits=8)
    assert_close(out, reference_from_cache(query, k_cache, v_cache, md, 0.125), torch.float32)


def test_choose_num_splits():
    assert choose_num_splits(num_seqs=1, num_kv_heads=8, max_seq_len=8192) > 1  # long context, idle GPU
    assert choose_num_splits(num_seqs=256, num_kv_heads=8, max_seq_len=8192) == 1  # batch fills the GPU
    assert choose_num_splits(num_seqs=1, num_kv_heads=8, max_seq_len=100) == 1  # too short to pay off
    n = choose_num_splits(num_seqs=3, num_kv_heads=2, max_seq_len=1 << 20)
    assert n & (n - 1) == 0 and n <= 32


# (seq_len, query_len): whole prompt; chunk after a prefix ending mid-block;
# decodes mixed in; a one-token prompt; a chunk spanning two 64-row query tiles.
PREFILL_BATCH = [(20, 20), (50, 13), (33, 1), (1, 1), (90, 70), (17, 1)]
PREFILL_SHAPES = [(16, 2, 1, 64), (32, 1, 3, 128), (16, 1, 4, 128), (32, 1, 4, 64)]


@pytest.mark.parametrize("shape", PREFILL_SHAPES, ids=lambda s: "bs{}-kv{}-gqa{}-d{}".format(*s))
def test_prefill_attention(shape):
    block_size, num_kv_heads, queries_per_kv, head_dim = shape
    seq_lens, query_lens = zip(*PREFILL_BATCH)
    query, k_cache, v_cache, new_k, new_v, _, _, md = make_batch(
        seq_lens, query_lens, block_size, num_kv_heads, queries_per_kv, head_dim)
    fill_new_tokens(k_cache, v_cache, new_k, new_v, md)
    scale = head_dim ** -0.5
    out = paged_prefill_attention(query, k_cache, v_cache, md.block_tables, md.query_start_loc,
                                  md.seq_lens, md.max_query_len, scale)
    assert_close(out, reference_from_cache(query, k_cache, v_cache, md, scale), torch.float32)


@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_prefill_attention_low_precision(dtype):
    query, k_cache, v_cache, new_k, new_v, _, _, md = make_batch(
        [24, 40, 9], [24, 7, 1], 16, 1, 3, 64, dtype=dtype)
    fill_new_tokens(k_cache, v_cache, new_k, new_v, md)
    out = paged_prefill_attention(query, k_cache, v_cache, md.block_tables, md.query_start_loc,
                                  md.seq_lens, md.max_query_len, 0.125)
    assert out.dtype == dtype
    assert_close(out, reference_from_cache(query, k_cache, v_cache, md, 0.125), dtype)


@pytest.mark.parametrize("head_dim", [80])
def test_padded_head_dim(head_dim):
    # Not a power of two: loads and stores mask the padding up to 128.
    query, k_cache, v_cache, new_k, new_v, _, _, md = make_batch([18, 5], [6, 5], 16, 1, 2, head_dim)
    fill_new_tokens(k_cache, v_cache, new_k, new_v, md)
    scale = head_dim ** -0.5
    out = paged_prefill_attention(query, k_cache, v_cache, md.block_tables, md.query_start_loc,
                                  md.seq_lens, md.max_query_len, scale)
    assert_close(out, reference_from_cache(query, k_cache, v_cache, md, scale), torch.float32)
    decode_query = query[[5, 10]]  # each sequence's last token, as a decode step
    out = paged_decode_attention(decode_query, k_cache, v_cache, md.block_tables, md.seq_lens,
                                 md.max_seq_len, scale, num_splits=2)
    assert_close(out, reference_from_cache(query, k_cache, v_cache, md, scale)[[5, 10]], torch.float32)


@pytest.mark.parametrize(
    "seq_lens,query_lens",
    [([40, 17, 1], [1, 1, 1]), ([40, 17, 30], [9, 1, 30])],
    ids=["decode_only", "mixed"],
)
@pytest.mark.parametrize("num_splits", [1, 2])
def test_backend_store_then_forward(seq_lens, query_lens, num_splits):
    """The model's order: store_kv the step's new K/V, then forward reads them back."""
    query, k_cache, v_cache, new_k, new_v, k_ctx, v_ctx, md = make_batch(
        seq_lens, query_lens, 16, 2, 3, 64, seed=3)
    backend = TritonAttentionBackend(num_splits=num_splits)
    assert backend.name == "triton"
    backend.prepare(md)
    backend.store_kv(new_k, new_v, (k_cache, v_cache))
    out = backend.forward(query, None, None, (k_cache, v_cache), scale=0.125)
    assert out.shape == query.shape
    # Compared with the original K/V, not the cache, so store_kv is checked too.
    assert_close(out, reference_attention(query, k_ctx, v_ctx, query_lens, 0.125), torch.float32)


def test_reference_matches_naive_softmax():
    # Pins the reference itself (SDPA's boolean mask: True means attend).
    q = torch.randn(3, 2, 8)
    k, v = torch.randn(5, 1, 8), torch.randn(5, 1, 8)
    out = reference_attention(q, [k], [v], [3], scale=1 / math.sqrt(8))
    scores = torch.einsum("qhd,kd->hqk", q, k[:, 0]) / math.sqrt(8)
    scores = scores.masked_fill(torch.arange(5)[None, :] > torch.arange(2, 5)[:, None], float("-inf"))
    expected = torch.einsum("hqk,kd->qhd", scores.softmax(-1), v[:, 0])
    torch.testing.assert_close(out, expected)


def poison_before_windows(k_cache, v_cache, md, window):
    """NaN into the blocks wholly before every query's window: the kernels must skip them."""
    block_size = k_cache.shape[1]
    for i, (seq_len, query_len) in enumerate(zip(md.seq_lens_cpu, md.query_lens_cpu)):
        first_block = max(0, seq_len - query_len - window + 1) // block_size
        blocks = md.block_tables[i, :first_block].long()
        k_cache[blocks] = float("nan")
        v_cache[blocks] = float("nan")


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("window", [1, 8, 20, 1000])  # one token, mid-block starts, longer than every context
def test_decode_attention_with_window(window, num_splits):
    seq_lens = [1, 7, 16, 33, 64, 45]
    query, k_cache, v_cache, new_k, new_v, _, _, md = make_batch(seq_lens, [1] * len(seq_lens), 16, 1, 2, 32)
    fill_new_tokens(k_cache, v_cache, new_k, new_v, md)
    expected = reference_from_cache(query, k_cache, v_cache, md, 0.125, window)
    poison_before_windows(k_cache, v_cache, md, window)
    out = paged_decode_attention(query, k_cache, v_cache, md.block_tables, md.seq_lens,
                                 md.max_seq_len, 0.125, num_splits=num_splits, window=window)
    assert_close(out, expected, torch.float32)


@pytest.mark.parametrize("window", [1, 8, 20, 1000])
def test_prefill_attention_with_window(window):
    # A fresh prompt spanning two query tiles, a chunk after context, decodes mixed in.
    seq_lens, query_lens = [80, 50, 33, 5], [80, 13, 1, 5]
    query, k_cache, v_cache, new_k, new_v, _, _, md = make_batch(seq_lens, query_lens, 16, 1, 2, 32, seed=4)
    fill_new_tokens(k_cache, v_cache, new_k, new_v, md)
    expected = reference_from_cache(query, k_cache, v_cache, md, 0.125, window)
    poison_before_windows(k_cache, v_cache, md, window)
    out = paged_prefill_attention(query, k_cache, v_cache, md.block_tables, md.query_start_loc,
                                  md.seq_lens, md.max_query_len, 0.125, window=window)
    assert_close(out, expected, torch.float32)


def test_head_dim_256_with_window():
    """Gemma 3 1B's heads: 256 wide, both kernels."""
    query, k_cache, v_cache, new_k, new_v, _, _, md = make_batch([40, 20], [10, 20], 16, 1, 2, 256, seed=5)
    fill_new_tokens(k_cache, v_cache, new_k, new_v, md)
    out = paged_prefill_attention(query, k_cache, v_cache, md.block_tables, md.query_start_loc,
                                  md.seq_lens, md.max_query_len, 0.0625, window=12)
    expected = reference_from_cache(query, k_cache, v_cache, md, 0.0625, 12)
    assert_close(out, expected, torch.float32)
    decode_query = query[[9, 29]]  # each sequence's last token, as a decode step
    out = paged_decode_attention(decode_query, k_cache, v_cache, md.block_tables, md.seq_lens,
                                 md.max_seq_len, 0.0625, num_splits=2, window=12)
    assert_close(out, expected[[9, 29]], torch.float32)
