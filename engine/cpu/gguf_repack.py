"""Q4_K rows repacked eight to a group for the kernel (engine/cpu/csrc/gguf/gguf_dot_x8.h has
the layout and why), and back.

The repacking only moves bits: each group holds the very bits of its eight rows (the d and
dmin bytes, the 6-bit scales and mins, the nibbles), so `unpack_q4_k_x8` gives the file's
bytes back exactly and dequantizing those is the file's values bit for bit.
"""

from __future__ import annotations

import numpy as np
import torch

GROUP_ROWS = 8
BLOCK_BYTES = 144  # a Q4_K super-block: d, dmin, 12 scale bytes, 128 code bytes


def _scales_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[..., 12] scale bytes -> (scales, mins) [..., 8] uint8, 6 bits each (gguf's Q4_K.get_scale_min)."""
    d, m, m_d = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scales = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mins = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return scales, mins


def _pack_scales_mins(scales: np.ndarray, mins: np.ndarray) -> np.ndarray:
    """The inverse of _scales_mins: every bit of the 12 bytes is a bit of a scale or a min."""
    return np.concatenate([(scales[..., :4] & 0x3F) | ((scales[..., 4:] >> 4) << 6),
                           (mins[..., :4] & 0x3F) | ((mins[..., 4:] >> 4) << 6),
                           (scales[..., 4:] & 0x0F) | ((mins[..., 4:] & 0x0F) << 4)], axis=-1).astype(np.uint8)


def pack_q4_k_x8(rows: torch.Tensor) -> torch.Tensor:
    """uint8 [8 g, bytes per row] Q4_K rows -> [g, 8 x bytes per row], the kernel's groups."""
    num_rows, row_bytes = rows.shape
    assert num_rows % GROUP_ROWS == 0 and row_bytes % BLOCK_BYTES == 0
    groups, blocks = num_rows // GROUP_ROWS, row_bytes // BLOCK_BYTES
    b = rows.numpy().reshape(groups, GROUP_ROWS, blocks, BLOCK_BYTES).transpose(0, 2, 1, 3)  # [g, nb, 8, 144]
    out = np.empty((groups, blocks, GROUP_ROWS * BLOCK_BYTES), dtype=np.uint8)
    out[..., 0:16] = b[..., 0:2].reshape(groups, blocks, 16)  # the rows' d
    out[..., 16:32] = b[..., 2:4].reshape(groups, blocks, 16)  # their dmin
    scales, mins = _scales_mins(b[..., 4:16])  # [g, nb, 8 rows, 8]
    u = np.concatenate([scales.transpose(0, 1, 3, 2).reshape(groups, blocks, 64),  # [s][r]
                        mins.reshape(groups, blocks, GROUP_ROWS, 4, 2).transpose(0, 1, 3, 2, 4)
                        .reshape(groups, blocks, 64)], axis=-1)  # [p][r][e]
    out[..., 32:96] = (u[..., :64] & 0x0F) | ((u[..., 64:] & 0x0F) << 4)
    out[..., 96:128] = ((u[..., 0:32] >> 4) | ((u[..., 32:64] >> 4) << 2) | ((u[..., 64:96] >> 4) << 4)
                        | ((u[..., 96:128] >> 4) << 6))
    codes = b[..., 16:].reshape(groups, blocks, GROUP_ROWS, 4, 8, 4)  # [g, nb, r, j, l, c]
    out[..., 128:] = codes.transpose(0, 1, 3, 4, 2, 5).reshape(groups, blocks, 1024)  # [j][l][r][c]
    return torch.from_numpy(out.reshape(groups, blocks * GROUP_ROWS * BLOCK_BYTES))


def unpack_q4_k_x8(groups: torch.Tensor) -> torch.Tensor:
    """The kernel's groups [g, 8 x bytes per row] -> the file's Q4_K rows [8 g, bytes per row]."""
    num_groups = groups.shape[0]
    blocks = groups.shape[1] // (GROUP_ROWS * BLOCK_BYTES)
    g = groups.contiguous().numpy().reshape(num_groups, blocks, GROUP_ROWS * BLOCK_BYTES)
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
    b[..., 4:16] = _pack_scales_mins(scales, mins)
    codes = g[..., 128:].reshape(num_groups, blocks, 4, 8, GROUP_ROWS, 4)  # [g, nb, j, l, r, c]
    b[..., 16:] = codes.transpose(0, 1, 4, 2, 3, 5).reshape(num_groups, blocks, GROUP_ROWS, 128)
    return torch.from_numpy(b.transpose(0, 2, 1, 3).reshape(num_groups * GROUP_ROWS, blocks * BLOCK_BYTES))
