"""Q4_K and Q6_K rows repacked eight to a group for the kernels (engine/cpu/csrc/gguf/
gguf_dot_x8.h and gguf_dot_q6_k_x8.h have the layouts and why), and back.

The repacking only moves bits: each group holds the very bits of its eight rows (the d and
dmin bytes, the scales and mins, the codes' bits), so `unpack_q4_k_x8` and `unpack_q6_k_x8`
give the file's bytes back exactly and dequantizing those is the file's values bit for bit.
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


PACK_CHUNK_GROUPS = 512  # groups repacked at a time: the temporaries stay a few MB, whatever the tensor


def _pack_in_chunks(pack_chunk, rows: torch.Tensor, block_bytes: int) -> torch.Tensor:
    """uint8 [8 g, bytes per row] rows -> [g, 8 x bytes per row], `pack_chunk` run on PACK_CHUNK_GROUPS
    groups at a time, so that an LM head's repack (a Q4_K_M file's biggest tensor) holds the output
    and a few MB beside it, not several copies of the tensor."""
    num_rows, row_bytes = rows.shape
    assert num_rows % GROUP_ROWS == 0 and row_bytes % block_bytes == 0
    out = torch.empty(num_rows // GROUP_ROWS, GROUP_ROWS * row_bytes, dtype=torch.uint8)
    step = PACK_CHUNK_GROUPS * GROUP_ROWS
    for start in range(0, num_rows, step):
        out[start // GROUP_ROWS:(start + step) // GROUP_ROWS] = pack_chunk(rows[start:start + step])
    return out


def _row_blocks(rows: torch.Tensor, block_bytes: int) -> np.ndarray:
    """uint8 [8 g, bytes per row] -> a view [g, blocks, 8 rows, block_bytes]: each super-block's eight rows."""
    num_rows, row_bytes = rows.shape
    return rows.numpy().reshape(num_rows // GROUP_ROWS, GROUP_ROWS, row_bytes // block_bytes, block_bytes) \
        .transpose(0, 2, 1, 3)


def _group_blocks(groups: torch.Tensor, block_bytes: int) -> np.ndarray:
    """The kernel's groups [g, 8 x bytes per row] -> [g, blocks, 8 x block_bytes]: each super-block's group."""
    return groups.contiguous().numpy().reshape(groups.shape[0], -1, GROUP_ROWS * block_bytes)


def _file_rows(b: np.ndarray) -> torch.Tensor:
    """[g, blocks, 8 rows, block_bytes] -> the file's rows, uint8 [8 g, bytes per row]."""
    num_groups, blocks, _, block_bytes = b.shape
    return torch.from_numpy(b.transpose(0, 2, 1, 3).reshape(num_groups * GROUP_ROWS, blocks * block_bytes))


def pack_q4_k_x8(rows: torch.Tensor) -> torch.Tensor:
    """uint8 [8 g, bytes per row] Q4_K rows -> [g, 8 x bytes per row], the kernel's groups."""
    return _pack_in_chunks(_pack_q4_k_x8, rows, BLOCK_BYTES)


def _pack_q4_k_x8(rows: torch.Tensor) -> torch.Tensor:
    b = _row_blocks(rows, BLOCK_BYTES)  # [g, nb, 8, 144]
    groups, blocks = b.shape[:2]
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
    b[..., 4:16] = _pack_scales_mins(scales, mins)
    codes = g[..., 128:].reshape(num_groups, blocks, 4, 8, GROUP_ROWS, 4)  # [g, nb, j, l, r, c]
    b[..., 16:] = codes.transpose(0, 1, 4, 2, 3, 5).reshape(num_groups, blocks, GROUP_ROWS, 128)
    return _file_rows(b)


Q6_K_BLOCK_BYTES = 210  # a Q6_K super-block: 128 bytes ql, 64 qh, 16 int8 scales, fp16 d


def _q6_k_codes(ql: np.ndarray, qh: np.ndarray) -> np.ndarray:
    """[..., 128] ql and [..., 64] qh -> [..., 256] the 6-bit codes q + 32, input order (gguf's Q6_K):
    input 128 h + 32 k + l: ql[64 h + 32 (k % 2) + l]'s low (k < 2) or high nibble, qh[32 h + l]'s bits 2 k."""
    ql4 = ql.reshape(*ql.shape[:-1], 2, 2, 32)  # [h][k % 2][l]
    low = np.concatenate([ql4 & 0x0F, ql4 >> 4], axis=-2)  # [h][k][l]
    shifts = (2 * np.arange(4, dtype=np.uint8)).reshape(4, 1)
    top = (qh.reshape(*qh.shape[:-1], 2, 1, 32) >> shifts) & 0x03  # [h][k][l]
    return (low | (top << 4)).reshape(*ql.shape[:-1], 256)


def _q6_k_bits(codes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The inverse of _q6_k_codes: [..., 256] codes -> ([..., 128] ql, [..., 64] qh)."""
    c = codes.reshape(*codes.shape[:-1], 2, 4, 32)  # [h][k][l]
    low, top = c & 0x0F, c >> 4
    ql = (low[..., 0:2, :] | (low[..., 2:4, :] << 4)).reshape(*codes.shape[:-1], 128)
    qh = (top[..., 0, :] | (top[..., 1, :] << 2) | (top[..., 2, :] << 4) | (top[..., 3, :] << 6))
    return ql.astype(np.uint8), qh.reshape(*codes.shape[:-1], 64).astype(np.uint8)


def pack_q6_k_x8(rows: torch.Tensor) -> torch.Tensor:
    """uint8 [8 g, bytes per row] Q6_K rows -> [g, 8 x bytes per row], the kernel's groups."""
    return _pack_in_chunks(_pack_q6_k_x8, rows, Q6_K_BLOCK_BYTES)


def _pack_q6_k_x8(rows: torch.Tensor) -> torch.Tensor:
    b = _row_blocks(rows, Q6_K_BLOCK_BYTES)  # [g, nb, 8, 210]
    groups, blocks = b.shape[:2]
    out = np.empty((groups, blocks, GROUP_ROWS * Q6_K_BLOCK_BYTES), dtype=np.uint8)
    out[..., 0:16] = b[..., 208:210].reshape(groups, blocks, 16)  # the rows' d
    scales = b[..., 192:208].reshape(groups, blocks, GROUP_ROWS, 8, 2)  # [g, nb, r, p, e]
    out[..., 16:144] = scales.transpose(0, 1, 3, 2, 4).reshape(groups, blocks, 128)  # [p][r][e]
    codes = _q6_k_codes(b[..., 0:128], b[..., 128:192]).reshape(groups, blocks, GROUP_ROWS, 16, 4, 4)
    c = codes.transpose(0, 1, 3, 4, 2, 5)  # [g, nb, s, k, r, c]: word 4 s + k, byte 4 r + c
    # load k < 3: word k's codes, and two bits of word 3's above each
    loads = [c[:, :, :, k] | (((c[:, :, :, 3] >> (2 * k)) & 0x03) << 6) for k in range(3)]
    out[..., 144:] = np.stack(loads, axis=3).reshape(groups, blocks, 16 * 96)  # [s][k][r][c]
    return torch.from_numpy(out.reshape(groups, blocks * GROUP_ROWS * Q6_K_BLOCK_BYTES))


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


# The types whose rows the kernels take eight to a group: (pack, unpack, the kernels' type id's name).
GROUPED = {"Q4_K": (pack_q4_k_x8, unpack_q4_k_x8, "q4_k_x8_type"),
           "Q6_K": (pack_q6_k_x8, unpack_q6_k_x8, "q6_k_x8_type")}
