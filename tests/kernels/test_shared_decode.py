"""Decodes that share a cached prefix go through the prefill kernel's tiles together
(engine/attention/cpu_backend.py, paged_shared_decode_attention): against a dense
reference, with the grouping the backend plans and the checks the kernel makes.
"""

import pytest
import torch

from tests.kernels.test_cpu_attention import TOLERANCE, attend, dense_reference, make_batch

try:
    from engine.cpu.extension import load_cpu_kernels

    KERNELS = load_cpu_kernels()
except Exception as exc:  # the build needs a C++ compiler
    pytest.skip(f"CPU kernels cannot be built here: {exc}", allow_module_level=True)

from engine.attention.cpu_backend import MIN_SHARED_TOKENS, CpuAttentionBackend  # noqa: E402


def share_prefix(metadata, owner: int, sharers: list[int], num_blocks: int) -> None:
    """Give `sharers` the first `num_blocks` blocks of `owner`'s table, as prefix caching does."""
    for i in sharers:
        metadata.block_tables[i, :num_blocks] = metadata.block_tables[owner, :num_blocks]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "block_size, num_kv_heads, group, head_dim",
    [(16, 3, 3, 64), (8, 2, 2, 24), (32, 1, 4, 16)],  # SmolLM2's heads; no multiple of the vector width; wide blocks
)
def test_groups_sharing_prefixes_match_reference(block_size, num_kv_heads, group, head_dim, dtype):
    # Two groups with different shared lengths, a lone decode, and a prefill chunk after context.
    long, short = max(8, -(-MIN_SHARED_TOKENS // block_size)), max(5, -(-MIN_SHARED_TOKENS // block_size))
    seq_lens = [long * block_size + 5, long * block_size + 9, long * block_size + 1, 30,
                (short + 1) * block_size + 3, short * block_size + 2, 40]
    query_lens = [1, 1, 1, 1, 1, 1, 12]
    query, k_cache, v_cache, metadata = make_batch(seq_lens, query_lens, block_size, num_kv_heads, group, head_dim,
                                                   dtype, seed=7)
    share_prefix(metadata, 0, [1, 2], long)  # the last's only token of its own is just past them
    share_prefix(metadata, 4, [5], short)
    backend = CpuAttentionBackend(KERNELS, k_cache.shape[2])
    scale = head_dim**-0.5
    out = attend(backend, query, k_cache, v_cache, metadata, scale)
    assert backend._shared is not None
    assert backend._shared.members.tolist() == [0, 1, 2, 4, 5]
    assert backend._shared.shared_blocks.tolist() == [long, short]
    expected = dense_reference(query, k_cache, v_cache, metadata, scale)
    tolerance = TOLERANCE.get(dtype, 2e-3)
    torch.testing.assert_close(out.double(), expected, atol=tolerance, rtol=tolerance)


def test_more_sharers_than_one_tile_holds():
    # 40 decodes x 3 heads = 120 rows: two tiles, each reading the shared blocks.
    seq_lens = [100 + i for i in range(40)]
    query, k_cache, v_cache, metadata = make_batch(seq_lens, [1] * 40, 16, 3, 3, 64, torch.bfloat16, seed=8)
    share_prefix(metadata, 0, list(range(1, 40)), 6)
    backend = CpuAttentionBackend(KERNELS, k_cache.shape[2])
    out = attend(backend, query, k_cache, v_cache, metadata, 0.125)
    assert backend._shared is not None and backend._shared.members.numel() == 40
    expected = dense_reference(query, k_cache, v_cache, metadata, 0.125)
    torch.testing.assert_close(out.double(), expected, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stale_slots_of_a_members_last_block_stay_out(dtype):
    seq_lens = [70, 75]
    query, k_cache, v_cache, metadata = make_batch(seq_lens, [1, 1], 16, 2, 2, 64, dtype, seed=9)
    share_prefix(metadata, 0, [1], 4)
    expected = dense_reference(query, k_cache, v_cache, metadata, 0.125)
    for i, seq_len in enumerate(seq_lens):  # NaN in the slots past each sequence's end
        last = metadata.block_tables[i, seq_len // 16]
        k_cache[last, :, seq_len % 16 :] = float("nan")
        v_cache[last, :, seq_len % 16 :] = float("nan")
    backend = CpuAttentionBackend(KERNELS, k_cache.shape[2])
    out = attend(backend, query, k_cache, v_cache, metadata, 0.125)
    assert backend._shared is not None
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def test_short_shared_prefixes_take_the_decode_kernel():
    blocks = MIN_SHARED_TOKENS // 16 - 1  # one block short of the threshold
    query, k_cache, v_cache, metadata = make_batch([100, 110], [1, 1], 16, 3, 3, 64, torch.float32, seed=10)
    share_prefix(metadata, 0, [1], blocks)
    backend = CpuAttentionBackend(KERNELS, k_cache.shape[2])
    out = attend(backend, query, k_cache, v_cache, metadata, 0.125)
    assert backend._shared is None
    torch.testing.assert_close(out.double(), dense_reference(query, k_cache, v_cache, metadata, 0.125),
                               atol=1e-5, rtol=1e-5)


def test_kernel_rejects_bad_groups():
    query, k_cache, v_cache, metadata = make_batch([40, 41, 20], [1, 1, 5], 16, 1, 1, 16, torch.float32)
    share_prefix(metadata, 0, [1], 2)
    out = torch.empty_like(query)

    def run(members=(0, 1), starts=(0, 2), shared=(2,)):
        KERNELS.paged_shared_decode_attention(
            out, query, k_cache, v_cache, metadata.block_tables, metadata.seq_lens, metadata.query_start_loc,
            torch.tensor(members, dtype=torch.int32), torch.tensor(starts, dtype=torch.int32),
            torch.tensor(shared, dtype=torch.int32), 1.0)

    run()  # the good call
    with pytest.raises(RuntimeError, match="last token"):
        run(shared=(3,))  # 48 tokens: past the 40th
    with pytest.raises(RuntimeError, match="not a decode"):
        run(members=(0, 2))
    with pytest.raises(RuntimeError, match="group_starts"):
        run(starts=(0, 1))
    with pytest.raises(RuntimeError, match="out of range"):
        run(members=(0, 3))
