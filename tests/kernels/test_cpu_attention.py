"""The C++ CPU decode and prefill kernels against the torch backend and a dense softmax reference.

Caches are in the torch backend's head-major block layout with shuffled block
tables, so a kernel that read blocks in table order by accident would fail.
"""

import inspect
import random

import pytest
import torch

from engine.attention import head_major
from engine.worker.attention_choice import resolve_attention_backend
from engine.attention.backend import AttentionBackend
from engine.attention.metadata import AttentionMetadata
from engine.attention.torch_backend import TorchAttentionBackend
from engine.cpu.host import CpuFeatures

try:
    from engine.cpu.extension import load_cpu_kernels

    KERNELS = load_cpu_kernels()
except Exception as exc:  # the build needs a C++ compiler
    pytest.skip(f"CPU kernels cannot be built here: {exc}", allow_module_level=True)

from engine.attention.cpu_backend import CpuAttentionBackend  # noqa: E402


def make_batch(seq_lens, query_lens, block_size, num_kv_heads, group, head_dim, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    num_blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(num_blocks_per_seq) + 3  # a few never referenced
    order = list(range(num_blocks))
    random.Random(seed).shuffle(order)
    tables, next_block = [], 0
    for n in num_blocks_per_seq:
        tables.append(order[next_block : next_block + n])
        next_block += n
    width = max(num_blocks_per_seq)
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)  # [num_blocks, num_kv_heads, block_size, head_dim]
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    query = torch.randn(sum(query_lens), num_kv_heads * group, head_dim, generator=gen).to(dtype)
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    metadata = AttentionMetadata(
        slot_mapping=torch.zeros(sum(query_lens), dtype=torch.int64),  # unused: nothing is stored here
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_lens_cpu=list(query_lens),
        seq_lens_cpu=list(seq_lens),
    )
    return query, k_cache, v_cache, metadata


def attend(backend, query, k_cache, v_cache, metadata, scale, key=None, value=None, window=0):
    """One step through `backend`: prepare, as the model runner does, then one layer's forward."""
    backend.prepare(metadata)
    return backend.forward(query, key, value, (k_cache, v_cache), scale, window)


def cpu_backend(k_cache, window=0):
    """The CPU backend for caches shaped like k_cache, planning the full context and `window`."""
    return CpuAttentionBackend(KERNELS, k_cache.shape[2], (0, window))


def torch_backend(k_cache, window=0):
    return TorchAttentionBackend(k_cache.shape[2], (0, window))


def dense_reference(query, k_cache, v_cache, metadata, scale, window=0):
    """Per sequence: gather the context, then a plain causal softmax in fp64 (with a window,
    a query at position p sees keys p - window < k <= p, as transformers' mask does)."""
    block_size, num_kv_heads = k_cache.shape[2], k_cache.shape[1]
    group = query.shape[1] // num_kv_heads
    out = torch.empty(query.shape, dtype=torch.float64)
    starts = metadata.query_start_loc.tolist()
    for i, seq_len in enumerate(metadata.seq_lens_cpu):
        blocks = metadata.block_tables[i, : -(-seq_len // block_size)].long()
        k = k_cache[blocks].transpose(0, 1).reshape(num_kv_heads, -1, k_cache.shape[3])[:, :seq_len].double()
        v = v_cache[blocks].transpose(0, 1).reshape(num_kv_heads, -1, v_cache.shape[3])[:, :seq_len].double()
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)  # [num_heads, seq_len, head_dim]
        q = query[starts[i] : starts[i + 1]].double().transpose(0, 1)  # [num_heads, query_len, head_dim]
        query_len = q.shape[1]
        scores = q @ k.transpose(1, 2) * scale
        positions = torch.arange(seq_len - query_len, seq_len)
        keys = torch.arange(seq_len)[None, :]
        scores.masked_fill_(keys > positions[:, None], float("-inf"))
        if window > 0:
            scores.masked_fill_(keys <= positions[:, None] - window, float("-inf"))
        out[starts[i] : starts[i + 1]] = (scores.softmax(-1) @ v).transpose(0, 1)
    return out


TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "seq_lens, block_size, num_kv_heads, group, head_dim",
    [
        ([1, 5, 16, 17, 300], 16, 3, 3, 64),  # SmolLM2's heads; a block exactly full, one just started
        ([7, 33, 64], 8, 2, 1, 32),  # no grouping
        ([1, 2, 3], 1, 1, 4, 16),  # one token per block
        ([1000], 16, 4, 2, 128),  # one long context
        ([3, 41, 257], 16, 2, 7, 64),  # Qwen2.5-0.5B's group: the bf16 V pass takes 4 heads, then 3
        ([9, 130], 8, 2, 5, 96),  # a head of 64 + 32 dimensions in the bf16 V pass
    ],
)
def test_decode_matches_reference(seq_lens, block_size, num_kv_heads, group, head_dim, dtype):
    query, k_cache, v_cache, metadata = make_batch(
        seq_lens, [1] * len(seq_lens), block_size, num_kv_heads, group, head_dim, dtype
    )
    scale = head_dim**-0.5
    out = attend(cpu_backend(k_cache), query, k_cache, v_cache, metadata, scale)
    assert out.shape == query.shape and out.dtype == dtype
    expected = dense_reference(query, k_cache, v_cache, metadata, scale)
    torch.testing.assert_close(out.double(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    torch_out = attend(torch_backend(k_cache), query, k_cache, v_cache, metadata, scale)
    torch.testing.assert_close(out, torch_out, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def test_decode_of_sequences_sharing_prefix_blocks_matches_reference():
    # Rows 1 and 3 start with row 0's first two blocks, as prefix caching shares them; the
    # kernel then orders its tasks by KV head with the sharers together.
    seq_lens = [40, 45, 20, 33]
    query, k_cache, v_cache, metadata = make_batch(seq_lens, [1] * 4, 16, 3, 3, 64, torch.float32, seed=4)
    metadata.block_tables[1, :2] = metadata.block_tables[0, :2]
    metadata.block_tables[3, :2] = metadata.block_tables[0, :2]
    out = attend(cpu_backend(k_cache), query, k_cache, v_cache, metadata, 0.125)
    expected = dense_reference(query, k_cache, v_cache, metadata, 0.125)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "seq_lens, query_lens, block_size, num_kv_heads, group, head_dim",
    [
        ([40, 70, 1056], [40, 20, 32], 16, 3, 3, 64),  # SmolLM2's heads: a prompt, chunks after context
        ([300], [300], 16, 3, 3, 64),  # one long prompt: many query tiles, each with its own causal extent
        ([37, 50, 2], [37, 49, 2], 8, 2, 2, 24),  # a head size that is no multiple of the vector width
        ([33, 90], [17, 90], 32, 1, 4, 16),  # blocks wider than one vector
        ([200, 5], [199, 5], 5, 2, 1, 12),  # odd block size, no grouping
        ([20, 9], [20, 2], 16, 1, 40, 16),  # a group bigger than the kernel's register chunk of rows
    ],
)
def test_prefill_chunks_match_reference(seq_lens, query_lens, block_size, num_kv_heads, group, head_dim, dtype):
    query, k_cache, v_cache, metadata = make_batch(seq_lens, query_lens, block_size, num_kv_heads, group, head_dim, dtype)
    scale = head_dim**-0.5
    out = attend(cpu_backend(k_cache), query, k_cache, v_cache, metadata, scale)
    assert out.shape == query.shape and out.dtype == dtype
    expected = dense_reference(query, k_cache, v_cache, metadata, scale)
    tolerance = TOLERANCE.get(dtype, 2e-3)
    torch.testing.assert_close(out.double(), expected, atol=tolerance, rtol=tolerance)


def test_prefill_kernel_writes_only_the_chosen_sequences_rows():
    seq_lens, query_lens = [24, 40, 17], [24, 9, 17]
    query, k_cache, v_cache, metadata = make_batch(seq_lens, query_lens, 16, 3, 3, 64, torch.float32, seed=3)
    out = torch.full_like(query, 7.0)
    chosen = torch.tensor([1], dtype=torch.int32)
    KERNELS.paged_prefill_attention(out, query, k_cache, v_cache, metadata.block_tables, metadata.seq_lens,
                                    metadata.query_start_loc, chosen, 0.125, 0)
    expected = dense_reference(query, k_cache, v_cache, metadata, 0.125)
    torch.testing.assert_close(out[24:33].double(), expected[24:33], atol=1e-5, rtol=1e-5)
    assert (out[:24] == 7.0).all() and (out[33:] == 7.0).all()


def test_prefill_kernel_rejects_bad_tables():
    query, k_cache, v_cache, metadata = make_batch([20], [20], 16, 1, 1, 16, torch.float32)
    out, seqs = torch.empty_like(query), torch.tensor([0], dtype=torch.int32)

    def run(block_tables=metadata.block_tables, seq_lens=metadata.seq_lens, seq_indices=seqs):
        KERNELS.paged_prefill_attention(out, query, k_cache, v_cache, block_tables, seq_lens,
                                        metadata.query_start_loc, seq_indices, 1.0, 0)

    with pytest.raises(RuntimeError, match="block table"):
        run(seq_lens=torch.tensor([33], dtype=torch.int32))  # two blocks hold at most 32 tokens
    bad_table = metadata.block_tables.clone()
    bad_table[0, 1] = k_cache.shape[0]
    with pytest.raises(RuntimeError, match="outside the cache"):
        run(block_tables=bad_table)
    with pytest.raises(RuntimeError, match="out of range"):
        run(seq_indices=torch.tensor([1], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="int32"):
        run(block_tables=metadata.block_tables.long())


def test_mixed_batch_decodes_and_prefills_in_their_kernels():
    # A fresh prompt, a chunk after a cached prefix, and decodes, interleaved.
    seq_lens, query_lens = [40, 9, 70, 3, 12], [40, 1, 20, 1, 1]
    query, k_cache, v_cache, metadata = make_batch(seq_lens, query_lens, 16, 3, 3, 64, torch.float32, seed=1)
    out = attend(cpu_backend(k_cache), query, k_cache, v_cache, metadata, 0.125)
    expected = dense_reference(query, k_cache, v_cache, metadata, 0.125)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_kernel_rejects_context_beyond_its_block_table():
    query, k_cache, v_cache, metadata = make_batch([20], [1], 16, 1, 1, 16, torch.float32)
    too_long = torch.tensor([33], dtype=torch.int32)  # two blocks in the table hold at most 32 tokens
    with pytest.raises(RuntimeError, match="block table"):
        KERNELS.paged_decode_attention(query, k_cache, v_cache, metadata.block_tables, too_long, 1.0, 0)
    bad_table = metadata.block_tables.clone()
    bad_table[0, 1] = k_cache.shape[0]
    with pytest.raises(RuntimeError, match="outside the cache"):
        KERNELS.paged_decode_attention(query, k_cache, v_cache, bad_table, metadata.seq_lens, 1.0, 0)
    with pytest.raises(RuntimeError, match="int32"):
        KERNELS.paged_decode_attention(query, k_cache, v_cache, metadata.block_tables.long(), metadata.seq_lens, 1.0, 0)


def test_cpu_is_the_default_backend_on_cpu():
    assert resolve_attention_backend(None, "cpu", torch.float32, CpuFeatures()) == "cpu"
    assert resolve_attention_backend("torch", "cpu", torch.float32, CpuFeatures()) == "torch"


def test_cpu_and_torch_backends_implement_the_interface_side_by_side():
    assert not issubclass(CpuAttentionBackend, TorchAttentionBackend)
    for cls in (CpuAttentionBackend, TorchAttentionBackend):
        for method in ("kv_cache_shape", "prepare", "store_kv", "rotary_store_kv", "forward"):
            want = inspect.signature(getattr(AttentionBackend, method)).parameters
            assert inspect.signature(getattr(cls, method)).parameters.keys() == want.keys(), (cls, method)


def test_torch_backend_fresh_prompts_attend_to_the_steps_own_keys_as_to_the_cache():
    # In the torch backend, fresh prompts (query_len == seq_len) read key/value as given; the chunk
    # after earlier context (9 of 40) still gathers its blocks. Given the cache's own rows, both agree.
    seq_lens, query_lens = [24, 40, 5, 17], [24, 9, 1, 17]
    query, k_cache, v_cache, metadata = make_batch(seq_lens, query_lens, 16, 3, 3, 64, torch.float32, seed=2)
    block_size, starts = 16, metadata.query_start_loc.tolist()
    keys, values = [], []
    for i, (seq_len, query_len) in enumerate(zip(seq_lens, query_lens)):
        blocks = metadata.block_tables[i, : -(-seq_len // block_size)].long()
        k = head_major.gather(k_cache, blocks, seq_len).transpose(0, 1)  # [seq_len, num_kv_heads, head_dim]
        v = head_major.gather(v_cache, blocks, seq_len).transpose(0, 1)
        keys.append(k[seq_len - query_len :])
        values.append(v[seq_len - query_len :])
    key, value = torch.cat(keys), torch.cat(values)  # [num_tokens, num_kv_heads, head_dim]
    assert key.shape[0] == starts[-1]
    given = attend(torch_backend(k_cache), query, k_cache, v_cache, metadata, 0.125, key, value)
    gathered = attend(torch_backend(k_cache), query, k_cache, v_cache, metadata, 0.125)
    torch.testing.assert_close(given, gathered, atol=1e-6, rtol=1e-6)
    # And the given keys are really used: changing a fresh prompt's keys changes its output.
    changed = attend(torch_backend(k_cache), query, k_cache, v_cache, metadata, 0.125, key * 2, value)
    assert not torch.allclose(changed[: starts[1]], gathered[: starts[1]])
    torch.testing.assert_close(changed[starts[1] : starts[2]], gathered[starts[1] : starts[2]])  # the chunk gathers


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("query_len, group, seed", [(19, 2, 5), (1, 4, 6)])  # a prefill, a decode
def test_kernels_ignore_stale_slots_past_the_context(query_len, group, seed, dtype):
    # 19 tokens: the second block holds 3, then stale slots. A NaN there (any earlier
    # request's leftovers) must not reach the output, not even as 0 * NaN; the bf16 decode's V
    # pass pairs the odd last token with zeros, never with the slot after it.
    query, k_cache, v_cache, metadata = make_batch([19], [query_len], 16, 2, group, 64, dtype, seed=seed)
    expected = dense_reference(query, k_cache, v_cache, metadata, 0.125)
    last_block = metadata.block_tables[0, 1]
    k_cache[last_block, :, 3:] = float("nan")
    v_cache[last_block, :, 3:] = float("nan")
    out = attend(cpu_backend(k_cache), query, k_cache, v_cache, metadata, 0.125)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def test_bf16_decode_weights_sum_to_one():
    # Every V row the same: the output is that row, if the weights that reach V sum to one. The
    # bf16 V pass takes each probability as two bf16 parts (its rounding and the rest), divided by
    # the fp32 sum. Here every key but one scores exp(-a / 8) below the top, a value bf16 rounds by
    # about 0.2%, so the rounded part alone would scale the row by that much and round it elsewhere.
    query, k_cache, v_cache, metadata = make_batch([300, 999], [1, 1], 16, 2, 4, 64, torch.bfloat16, seed=7)
    candidates = torch.arange(4, 8, 1 / 32)  # bf16's values in [4, 8)
    p = torch.exp(-candidates / 8)
    a = candidates[((p.to(torch.bfloat16).float() - p).abs() / p).argmax()]
    query.zero_()
    query[:, :, 0] = a
    k_cache.zero_()
    for i in range(2):
        k_cache[metadata.block_tables[i, 0], :, 0, 0] = 1  # the first key of each sequence scores a / 8
    row = torch.randn(64).to(torch.bfloat16)
    v_cache[:] = row
    out = attend(cpu_backend(k_cache), query, k_cache, v_cache, metadata, 0.125)
    assert torch.equal(out, row.expand_as(out))


# Sliding windows: (window, block size) pairs where a window starts mid-block, spans exactly
# one block, is a single token, or is longer than every context (full attention).
def assert_backends_match_windowed_reference(query, k_cache, v_cache, metadata, scale, window, dtype):
    """The CPU kernels and the torch backend both equal the dense windowed reference; returns it."""
    expected = dense_reference(query, k_cache, v_cache, metadata, scale, window)
    for backend in (cpu_backend(k_cache, window), torch_backend(k_cache, window)):
        out = attend(backend, query, k_cache, v_cache, metadata, scale, window=window)
        torch.testing.assert_close(out.double(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    return expected


WINDOW_CASES = [(8, 16), (16, 16), (13, 4), (1, 8), (5000, 16)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window, block_size", WINDOW_CASES)
@pytest.mark.parametrize("head_dim", [64, 256])  # 256: Gemma 3 1B's heads
def test_windowed_decode_matches_reference(window, block_size, head_dim, dtype):
    seq_lens = [1, 7, 16, 17, 40, 301]
    query, k_cache, v_cache, metadata = make_batch(seq_lens, [1] * len(seq_lens), block_size, 2, 4, head_dim, dtype)
    scale = head_dim**-0.5
    expected = assert_backends_match_windowed_reference(query, k_cache, v_cache, metadata, scale, window, dtype)
    if window < max(seq_lens):  # the window changes the answer: the check above has teeth
        full = dense_reference(query, k_cache, v_cache, metadata, scale)
        assert not torch.allclose(full[-1], expected[-1], atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window, block_size", WINDOW_CASES)
@pytest.mark.parametrize("head_dim", [64, 256])
def test_windowed_prefill_matches_reference(window, block_size, head_dim, dtype):
    # A fresh prompt longer than a tile, a chunk after earlier context, a short prompt.
    seq_lens, query_lens = [150, 90, 5], [150, 20, 5]
    query, k_cache, v_cache, metadata = make_batch(seq_lens, query_lens, block_size, 2, 3, head_dim, dtype, seed=6)
    scale = head_dim**-0.5
    assert_backends_match_windowed_reference(query, k_cache, v_cache, metadata, scale, window, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_windowed_kernels_read_only_the_windows_blocks(dtype):
    """Blocks wholly before every query's window are never read: NaN in them, and block ids
    outside the cache in their table slots, change nothing (a decode reads the blocks of its
    last `window` positions; a prefill tile those from its first query's window on)."""
    window, block_size = 12, 8
    seq_lens, query_lens = [60, 45, 70], [1, 1, 10]
    query, k_cache, v_cache, metadata = make_batch(seq_lens, query_lens, block_size, 2, 2, 64, dtype, seed=7)
    expected = dense_reference(query, k_cache, v_cache, metadata, 0.125, window)
    for i, (seq_len, query_len) in enumerate(zip(seq_lens, query_lens)):
        first_block = max(0, seq_len - query_len - window + 1) // block_size
        blocks = metadata.block_tables[i, :first_block].long()
        k_cache[blocks] = float("nan")
        v_cache[blocks] = float("nan")
        metadata.block_tables[i, :first_block] = k_cache.shape[0] + 5  # outside the cache
    out = attend(cpu_backend(k_cache, window), query, k_cache, v_cache, metadata, 0.125, window=window)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def test_windowed_layers_bypass_the_shared_prefix_decode():
    """Decodes sharing prefix blocks go through the shared kernel for full attention, and
    through the decode kernel, windowed, for a windowed layer; both layers in one step."""
    seq_lens, query_lens = [100, 110, 97, 30], [1, 1, 1, 30]
    query, k_cache, v_cache, metadata = make_batch(seq_lens, query_lens, 16, 2, 2, 64, torch.float32, seed=8)
    metadata.block_tables[1, :5] = metadata.block_tables[0, :5]
    metadata.block_tables[2, :5] = metadata.block_tables[0, :5]
    backend = cpu_backend(k_cache, 16)
    full = attend(backend, query, k_cache, v_cache, metadata, 0.125)
    assert backend._shared is not None  # the shared-prefix kernel ran for the full layer
    windowed = backend.forward(query, None, None, (k_cache, v_cache), 0.125, window=16)  # the same step
    torch.testing.assert_close(full.double(), dense_reference(query, k_cache, v_cache, metadata, 0.125),
                               atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(windowed.double(), dense_reference(query, k_cache, v_cache, metadata, 0.125, 16),
                               atol=1e-5, rtol=1e-5)
