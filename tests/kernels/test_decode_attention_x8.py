"""paged_decode_attention's vector passes against torch SDPA on the gathered K and V.

On an AVX2 build these are the eight-keys-at-once passes (decode_attention_x8.h): the
lengths put keys in whole groups of eight, in a group's tail (1, 7, 9, 255, 1000 keys) and
in blocks whose size is not a multiple of eight; head sizes whose vectors do not fill a
whole tile (32, 96) take the tiles' one-vector remainder. On an AVX-512 build the same
cases check that host's path, and test_path_matches_the_cpu that each host builds its own.
"""

import random

import pytest
import torch
import torch.nn.functional as F

from engine.cpu.host import cpu_flags

try:
    from engine.cpu.extension import load_cpu_kernels

    KERNELS = load_cpu_kernels()
except Exception as exc:  # the build needs a C++ compiler
    pytest.skip(f"CPU kernels cannot be built here: {exc}", allow_module_level=True)


def make_cache(seq_len, block_size, num_kv_heads, head_dim, dtype, seed):
    """K/V caches with 2 spare blocks and a shuffled one-row block table for one sequence."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = -(-seq_len // block_size)
    table = list(range(num_blocks + 2))
    random.Random(seed).shuffle(table)
    shape = (num_blocks + 2, num_kv_heads, block_size, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)  # [num_blocks, num_kv_heads, block_size, head_dim]
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    return k_cache, v_cache, torch.tensor([table[:num_blocks]], dtype=torch.int32)


def sdpa_reference(query, k_cache, v_cache, block_table, seq_len, scale, window=0):
    """torch SDPA in fp64 on the sequence's gathered K and V (its last `window` keys with a window)."""
    num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[3]
    blocks = block_table[0, : -(-seq_len // k_cache.shape[2])].long()
    k = k_cache[blocks].transpose(0, 1).reshape(num_kv_heads, -1, head_dim)[:, :seq_len].double()
    v = v_cache[blocks].transpose(0, 1).reshape(num_kv_heads, -1, head_dim)[:, :seq_len].double()
    if window > 0:
        k, v = k[:, -window:], v[:, -window:]
    q = query[0].double().view(num_kv_heads, -1, head_dim)  # [num_kv_heads, group, head_dim]
    return F.scaled_dot_product_attention(q, k, v, scale=scale).reshape(1, -1, head_dim)


TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 1e-2}  # bf16: the output's own rounding


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("seq_len", [1, 7, 8, 9, 255, 256, 1000])
def test_decode_matches_sdpa(seq_len, head_dim, group, dtype):
    num_kv_heads = 2
    k_cache, v_cache, table = make_cache(seq_len, 16, num_kv_heads, head_dim, dtype, seed=seq_len)
    query = torch.randn(1, num_kv_heads * group, head_dim, generator=torch.Generator().manual_seed(1)).to(dtype)
    scale = head_dim**-0.5
    out = KERNELS.paged_decode_attention(query, k_cache, v_cache, table, torch.tensor([seq_len], dtype=torch.int32),
                                         scale, 0)
    expected = sdpa_reference(query, k_cache, v_cache, table, seq_len, scale)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize(
    "seq_len, block_size, group, head_dim, window",
    [
        (100, 12, 4, 64, 0),  # blocks of 12: one group of eight and a tail of four each
        (37, 1, 4, 64, 0),  # one key per block: tails only
        (300, 16, 1, 96, 0),  # one head: tiles of eight vectors and four single ones
        (300, 16, 2, 96, 0),  # two heads: tiles of four vectors
        (300, 16, 3, 32, 0),  # three heads: tiles of two; head of four vectors
        (301, 16, 5, 64, 0),  # a group of five: a tile of four heads and one of one
        (255, 16, 4, 64, 100),  # a window starting 11 rows into a block
        (1000, 8, 7, 64, 333),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_matches_sdpa_in_tails_and_windows(seq_len, block_size, group, head_dim, window, dtype):
    num_kv_heads = 2
    k_cache, v_cache, table = make_cache(seq_len, block_size, num_kv_heads, head_dim, dtype, seed=block_size)
    query = torch.randn(1, num_kv_heads * group, head_dim, generator=torch.Generator().manual_seed(2)).to(dtype)
    scale = head_dim**-0.5
    out = KERNELS.paged_decode_attention(query, k_cache, v_cache, table, torch.tensor([seq_len], dtype=torch.int32),
                                         scale, window)
    expected = sdpa_reference(query, k_cache, v_cache, table, seq_len, scale, window)
    torch.testing.assert_close(out.double(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def test_path_matches_the_cpu():
    """The build is -march=native: an AVX-512 host keeps its own passes, an AVX2 one takes the x8 ones."""
    flags = cpu_flags()
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        expected = "avx512_bf16" if "avx512_bf16" in flags else "avx512"
    elif {"avx2", "fma"} <= flags:
        expected = "avx2_x8"
    else:
        expected = "default"
    assert KERNELS.paged_decode_attention_path() == expected
