"""Q4_K, Q6_K and Q4_1 rows repacked eight to a group for the kernels (engine/cpu/csrc/gguf/
gguf_dot_x8.h, gguf_dot_q6_k_x8.h and gguf_dot_q4_1_x8.h have the layouts and why), and back.

The repacking only moves bits: each group holds the very bits of its eight rows (the d and
dmin or m bytes, the scales and mins, the codes' bits), so the unpacks (`unpack_q4_k_x8`,
`unpack_q6_k_x8`, `unpack_q4_1_x8`) give the file's bytes back exactly and dequantizing those is the file's values bit for bit.
The packs run at load, in C++ (csrc/gguf/gguf_repack.cpp; numpy's were a tenth of its rate,
docs/cpu-kernels.md); the unpacks, here in numpy, read a model's groups back (a tied embedding's
rows, `dequantize()`) and are the tests' independent reader of the C++ layout.
"""

from __future__ import annotations

import numpy as np
import torch

GROUP_ROWS = 8
BLOCK_BYTES = 144  # a Q4_K super-block: d, dmin, 12 scale bytes, 128 code bytes


def q4_k_scales_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[..., 12] Q4_K (and Q5_K) scale bytes -> (scales, mins) [..., 8] uint8, 6 bits each (gguf's
    Q4_K.get_scale_min). scripts/lib/gguf_writer.py centres its random blocks with the pair."""
    d, m, m_d = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scales = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mins = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return scales, mins


def pack_q4_k_scales_mins(scales: np.ndarray, mins: np.ndarray) -> np.ndarray:
    """The inverse of q4_k_scales_mins: every bit of the 12 bytes is a bit of a scale or a min."""
    return np.concatenate([(scales[..., :4] & 0x3F) | ((scales[..., 4:] >> 4) << 6),
                           (mins[..., :4] & 0x3F) | ((mins[..., 4:] >> 4) << 6),
                           (scales[..., 4:] & 0x0F) | ((mins[..., 4:] & 0x0F) << 4)], axis=-1).astype(np.uint8)


def _kernels():
    from engine.cpu.gguf_extension import load_gguf_kernels  # built on first use, by GgufLinear already

    return load_gguf_kernels()


def _group_blocks(groups: torch.Tensor, block_bytes: int) -> np.ndarray:
    """The kernel's groups [g, 8 x bytes per row] -> [g, blocks, 8 x block_bytes]: each super-block's group."""
    return groups.contiguous().numpy().reshape(groups.shape[0], -1, GROUP_ROWS * block_bytes)


def _file_rows(b: np.ndarray) -> torch.Tensor:
    """[g, blocks, 8 rows, block_bytes] -> the file's rows, uint8 [8 g, bytes per row]."""
    num_groups, blocks, _, block_bytes = b.shape
    return torch.from_numpy(b.transpose(0, 2, 1, 3).reshape(num_groups * GROUP_ROWS, blocks * block_bytes))


def pack_q4_k_x8(rows: torch.Tensor) -> torch.Tensor:
    """uint8 [8 g, bytes per row] Q4_K rows -> [g, 8 x bytes per row], the kernel's groups."""
    return _kernels().pack_q4_k_x8(rows)


def unpack_q4_k_x8(groups: torch.Tensor) -> torch.Tensor:
    """The kernel's groups [g, 8 x bytes per row] -> the file's Q4_K rows [8 g, bytes per row]."""
    g = _group_blocks(groups, BLOCK_BYTES)
    num_groups, blocks = g.shape[:2]
    b = np.empty((num_groups, blocks, GROUP_ROWS, BLOCK_BYTES), dtype=np.uint8)
    b[..., 0:2] = g[..., 0:16].reshape(num_groups, blocks, GROUP_ROWS, 2)
    b[..., 2:4] = g[..., 16:32].reshape(num_groups, blocks, GROUP_ROWS, 2)
    low, high = g[..., 32:96], g[..., 96:128]
    u = np.concatenate([(low[..., :32] & 0x0F) | ((high & 0x03) << 4),
                        (low[..., 32:] & 0x0F) | (((high >> 2) & 0x03) << 4),
                        (low[..., :32] >> 4) | (((high >> 4) & 0x03) << 4),
                        (low[..., 32:] >> 4) | ((high >> 6) << 4)], axis=-1)
    scales = u[..., :64].reshape(num_groups, blocks, 8, GROUP_ROWS).transpose(0, 1, 3, 2)  # [g, nb, r, s]
    mins = u[..., 64:].reshape(num_groups, blocks, 4, GROUP_ROWS, 2).transpose(0, 1, 3, 2, 4) \
        .reshape(num_groups, blocks, GROUP_ROWS, 8)
    b[..., 4:16] = pack_q4_k_scales_mins(scales, mins)
    codes = g[..., 128:].reshape(num_groups, blocks, 4, 8, GROUP_ROWS, 4)  # [g, nb, j, l, r, c]
    b[..., 16:] = codes.transpose(0, 1, 4, 2, 3, 5).reshape(num_groups, blocks, GROUP_ROWS, 128)
    return _file_rows(b)


Q6_K_BLOCK_BYTES = 210  # a Q6_K super-block: 128 bytes ql, 64 qh, 16 int8 scales, fp16 d


def _q6_k_bits(codes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[..., 256] 6-bit codes q + 32 in input order -> ([..., 128] ql, [..., 64] qh), gguf's Q6_K bits:
    input 128 h + 32 k + l is ql[64 h + 32 (k % 2) + l]'s low (k < 2) or high nibble, qh[32 h + l]'s bits 2 k."""
    c = codes.reshape(*codes.shape[:-1], 2, 4, 32)  # [h][k][l]
    low, top = c & 0x0F, c >> 4
    ql = (low[..., 0:2, :] | (low[..., 2:4, :] << 4)).reshape(*codes.shape[:-1], 128)
    qh = (top[..., 0, :] | (top[..., 1, :] << 2) | (top[..., 2, :] << 4) | (top[..., 3, :] << 6))
    return ql.astype(np.uint8), qh.reshape(*codes.shape[:-1], 64).astype(np.uint8)


def pack_q6_k_x8(rows: torch.Tensor) -> torch.Tensor:
    """uint8 [8 g, bytes per row] Q6_K rows -> [g, 8 x bytes per row], the kernel's groups."""
    return _kernels().pack_q6_k_x8(rows)


def unpack_q6_k_x8(groups: torch.Tensor) -> torch.Tensor:
    """The kernel's groups [g, 8 x bytes per row] -> the file's Q6_K rows [8 g, bytes per row]."""
    g = _group_blocks(groups, Q6_K_BLOCK_BYTES)
    num_groups, blocks = g.shape[:2]
    b = np.empty((num_groups, blocks, GROUP_ROWS, Q6_K_BLOCK_BYTES), dtype=np.uint8)
    b[..., 208:210] = g[..., 0:16].reshape(num_groups, blocks, GROUP_ROWS, 2)
    b[..., 192:208] = g[..., 16:144].reshape(num_groups, blocks, 8, GROUP_ROWS, 2).transpose(0, 1, 3, 2, 4) \
        .reshape(num_groups, blocks, GROUP_ROWS, 16)
    loads = g[..., 144:].reshape(num_groups, blocks, 16, 3, GROUP_ROWS, 4)  # [s][k][r][c]
    word3 = (loads[:, :, :, 0] >> 6) | ((loads[:, :, :, 1] >> 6) << 2) | ((loads[:, :, :, 2] >> 6) << 4)
    c = np.concatenate([loads & 0x3F, word3[:, :, :, None]], axis=3)  # [g, nb, s, k, r, c]
    codes = c.transpose(0, 1, 4, 2, 3, 5).reshape(num_groups, blocks, GROUP_ROWS, 256)
    b[..., 0:128], b[..., 128:192] = _q6_k_bits(codes)
    return _file_rows(b)


Q4_1_BLOCK_BYTES = 20  # a Q4_1 block of 32: fp16 d, fp16 m, 16 bytes of nibbles


def pack_q4_1_x8(rows: torch.Tensor) -> torch.Tensor:
    """uint8 [8 g, bytes per row] Q4_1 rows -> [g, 8 x bytes per row], the kernel's groups."""
    return _kernels().pack_q4_1_x8(rows)


def unpack_q4_1_x8(groups: torch.Tensor) -> torch.Tensor:
    """The kernel's groups [g, 8 x bytes per row] -> the file's Q4_1 rows [8 g, bytes per row]."""
    g = _group_blocks(groups, Q4_1_BLOCK_BYTES)
    num_groups, blocks = g.shape[:2]
    b = np.empty((num_groups, blocks, GROUP_ROWS, Q4_1_BLOCK_BYTES), dtype=np.uint8)
    b[..., 0:2] = g[..., 0:16].reshape(num_groups, blocks, GROUP_ROWS, 2)
    b[..., 2:4] = g[..., 16:32].reshape(num_groups, blocks, GROUP_ROWS, 2)
    codes = g[..., 32:].reshape(num_groups, blocks, 4, GROUP_ROWS, 4)  # [g, nb, l, r, c]: qs[4 l + c]
    b[..., 4:] = codes.transpose(0, 1, 3, 2, 4).reshape(num_groups, blocks, GROUP_ROWS, 16)
    return _file_rows(b)


# The types whose rows the kernels take eight to a group: (pack, unpack, the kernels' type id's name).
GROUPED = {"Q4_K": (pack_q4_k_x8, unpack_q4_k_x8, "q4_k_x8_type"),
           "Q6_K": (pack_q6_k_x8, unpack_q6_k_x8, "q6_k_x8_type"),
           "Q4_1": (pack_q4_1_x8, unpack_q4_1_x8, "q4_1_x8_type")}
