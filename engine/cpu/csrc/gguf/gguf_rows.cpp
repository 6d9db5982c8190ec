// Rows of a GgufLinear's blocks read back as fp32, each value computed with the very fp32
// operations, in the same order, as gguf.quants' numpy dequantize_blocks (so bit for bit its
// values): a tied embedding's lookup once a step, where numpy's per-call overhead took ~1 ms.
// No FMA contraction here: d * sc * q - dmin * m must round after each step, as numpy does.
#pragma GCC optimize("fp-contract=off")

#include "gguf_types.h"

#include <torch/types.h>

#include <cstdint>

namespace tokenloom_gguf {
namespace {

inline uint8_t q4k_scale(const uint8_t* s, int j) {  // gguf's Q4_K.get_scale_min, scale j
  return j < 4 ? (s[j] & 63) : ((s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4));
}
inline uint8_t q4k_min(const uint8_t* s, int j) {
  return j < 4 ? (s[j + 4] & 63) : ((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
}

// One row of `type` (the file's layout) into out[0, in_features).
void row_values(int64_t type, const uint8_t* row, int64_t in_features, float* out) {
  switch (type) {
    case kQ5_0:
    case kQ5_1: {
      const bool has_min = type == kQ5_1;
      for (int64_t b = 0; b < in_features / kQ32; ++b) {
        const uint8_t* blk = row + b * q32_block_bytes(type);
        const float d = half_at(blk);
        uint32_t qh;
        std::memcpy(&qh, blk + (has_min ? 4 : 2), 4);
        const uint8_t* qs = blk + (has_min ? 8 : 6);
        for (int l = 0; l < 32; ++l) {
          const int q = (l < 16 ? (qs[l] & 0x0f) : (qs[l - 16] >> 4)) | (((qh >> l) & 1) << 4);
          out[b * kQ32 + l] = has_min ? d * static_cast<float>(q) + half_at(blk + 2) : d * static_cast<float>(q - 16);
        }
      }
      return;
    }
    case kQ4_0:
    case kQ4_1:
    case kQ8_0: {
      const int64_t bytes = q32_block_bytes(type);
      for (int64_t b = 0; b < in_features / kQ32; ++b) {
        const uint8_t* blk = row + b * bytes;
        const float d = half_at(blk);
        float* y = out + b * kQ32;
        if (type == kQ8_0) {
          for (int l = 0; l < 32; ++l) y[l] = static_cast<float>(static_cast<int8_t>(blk[2 + l])) * d;
        } else if (type == kQ4_0) {
          for (int l = 0; l < 16; ++l) {
            y[l] = d * static_cast<float>((blk[2 + l] & 0x0f) - 8);
            y[l + 16] = d * static_cast<float>((blk[2 + l] >> 4) - 8);
          }
        } else {
          const float m = half_at(blk + 2);
          for (int l = 0; l < 16; ++l) {
            y[l] = d * static_cast<float>(blk[4 + l] & 0x0f) + m;
            y[l + 16] = d * static_cast<float>(blk[4 + l] >> 4) + m;
          }
        }
      }
      return;
    }
    case kQ4_K:
    case kQ5_K: {
      const int64_t bytes = type == kQ5_K ? 176 : 144;
      for (int64_t b = 0; b < in_features / kQK; ++b) {
        const uint8_t* blk = row + b * bytes;
        const float d = half_at(blk), dmin = half_at(blk + 2);
        const uint8_t* qh = blk + 16;
        const uint8_t* qs = blk + (type == kQ5_K ? 48 : 16);
        for (int s = 0; s < 8; ++s) {
          const float ds = d * static_cast<float>(q4k_scale(blk + 4, s));
          const float ms = dmin * static_cast<float>(q4k_min(blk + 4, s));
          for (int l = 0; l < 32; ++l) {
            const uint8_t byte = qs[32 * (s / 2) + l];
            int q = s % 2 == 0 ? (byte & 0x0f) : (byte >> 4);
            if (type == kQ5_K) q |= ((qh[l] >> s) & 1) << 4;
            out[b * kQK + 32 * s + l] = ds * static_cast<float>(q) - ms;
          }
        }
      }
      return;
    }
    case kQ6_K: {
      for (int64_t b = 0; b < in_features / kQK; ++b) {
        const uint8_t* blk = row + b * 210;
        const float d = half_at(blk + 208);
        for (int e = 0; e < 256; ++e) {
          const int h = e / 128, k = (e % 128) / 32, l = e % 32;
          const uint8_t low = blk[64 * h + l + (k % 2) * 32];
          const int q = ((k < 2 ? (low & 0x0f) : (low >> 4)) | (((blk[128 + 32 * h + l] >> (2 * k)) & 3) << 4)) - 32;
          const float ds = d * static_cast<float>(static_cast<int8_t>(blk[192 + e / 16]));
          out[b * kQK + e] = ds * static_cast<float>(q);
        }
      }
      return;
    }
  }
  TORCH_CHECK(false, "gguf rows: no dequantizer for ggml type ", type);
}

// Row r (0..7) of a group of 8 repacked Q4_K rows (gguf_dot_x8.h's layout).
void group_row_values(const uint8_t* group, int r, int64_t in_features, float* out) {
  for (int64_t b = 0; b < in_features / kQK; ++b) {
    const uint8_t* blk = group + b * kGroupBlockBytes;
    const float d = half_at(blk + 2 * r), dmin = half_at(blk + 16 + 2 * r);
    const auto u = [&](int i) {  // U[i]: its low nibble from L, its top two bits from H
      const int low = i < 64 ? (blk[32 + i] & 0x0f) : (blk[32 + i - 64] >> 4);
      return low | (((blk[96 + i % 32] >> (2 * (i / 32))) & 3) << 4);
    };
    for (int s = 0; s < 8; ++s) {
      const float ds = d * static_cast<float>(u(8 * s + r));
      const float ms = dmin * static_cast<float>(u(64 + 16 * (s / 2) + 2 * r + s % 2));
      for (int l = 0; l < 32; ++l) {
        const uint8_t byte = blk[128 + 32 * (8 * (s / 2) + l / 4) + 4 * r + l % 4];
        const int q = s % 2 == 0 ? (byte & 0x0f) : (byte >> 4);
        out[b * kQK + 32 * s + l] = ds * static_cast<float>(q) - ms;
      }
    }
  }
}

// Row r (0..7) of a group of 8 repacked Q6_K rows (gguf_dot_q6_k_x8.h's layout).
void q6_group_row_values(const uint8_t* group, int r, int64_t in_features, float* out) {
  for (int64_t b = 0; b < in_features / kQK; ++b) {
    const uint8_t* blk = group + b * kQ6GroupBlockBytes;
    const float d = half_at(blk + 2 * r);
    for (int s = 0; s < 16; ++s) {
      const float ds = d * static_cast<float>(static_cast<int8_t>(blk[16 + 16 * (s / 2) + 2 * r + s % 2]));
      const uint8_t* codes = blk + 144 + 96 * s;
      for (int j = 0; j < 16; ++j) {
        const int k = j / 4, at = 4 * r + j % 4;  // word 4 s + k of the sub-block, byte at in its loads
        const int code = k < 3 ? (codes[32 * k + at] & 0x3f)
                               : (codes[at] >> 6) | ((codes[32 + at] >> 6) << 2) | ((codes[64 + at] >> 6) << 4);
        const int q = code - 32;
        out[b * kQK + 16 * s + j] = ds * static_cast<float>(q);
      }
    }
  }
}

// Row r (0..7) of a group of 8 repacked Q4_1 rows (gguf_dot_q4_1_x8.h's layout).
void q4_1_group_row_values(const uint8_t* group, int r, int64_t in_features, float* out) {
  for (int64_t b = 0; b < in_features / kQ32; ++b) {
    const uint8_t* blk = group + b * kQ4_1GroupBlockBytes;
    const float d = half_at(blk + 2 * r), m = half_at(blk + 16 + 2 * r);
    float* y = out + b * kQ32;
    for (int l = 0; l < 16; ++l) {
      const uint8_t byte = blk[32 + 32 * (l / 4) + 4 * r + l % 4];  // the file's qs[l]
      y[l] = d * static_cast<float>(byte & 0x0f) + m;
      y[l + 16] = d * static_cast<float>(byte >> 4) + m;
    }
  }
}

}  // namespace

// blocks and layout as gguf_linear takes them; rows: int64 [n] -> fp32 [n, in_features].
torch::Tensor gguf_rows(const torch::Tensor& blocks, const torch::Tensor& layout, const torch::Tensor& rows,
                        int64_t in_features) {
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.is_contiguous(), "blocks: uint8, contiguous");
  TORCH_CHECK(layout.scalar_type() == at::kLong && layout.dim() == 2 && layout.size(1) == 3 && layout.is_contiguous(),
              "layout: int64 [num_parts, 3]");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1, "rows: int64 [n]");
  const torch::Tensor ids = rows.contiguous();
  auto out = torch::empty({ids.size(0), in_features}, blocks.options().dtype(at::kFloat));
  const int64_t* entries = layout.data_ptr<int64_t>();
  const int64_t num_parts = layout.size(0);
  for (int64_t i = 0; i < ids.size(0); ++i) {
    int64_t row = ids.data_ptr<int64_t>()[i], first = 0;
    int64_t p = 0;
    while (p < num_parts && row >= first + entries[3 * p + 2]) first += entries[3 * p + 2], ++p;
    TORCH_CHECK(row >= 0 && p < num_parts, "row ", row, " is outside the weight");
    const int64_t type = entries[3 * p], offset = entries[3 * p + 1], local = row - first;
    const TypeInfo& info = type_info(type);
    const int64_t row_bytes = in_features / info.block_inputs * info.block_bytes;
    TORCH_CHECK(offset + (local + 1) * row_bytes <= blocks.numel(), "the layout runs past the blocks");
    float* y = out.data_ptr<float>() + i * in_features;
    const uint8_t* base = blocks.data_ptr<uint8_t>() + offset;
    if (info.is_grouped) {
      const uint8_t* group = base + (local / kGroupRows) * kGroupRows * row_bytes;
      (type == kQ6_Kx8 ? q6_group_row_values : type == kQ4_1x8 ? q4_1_group_row_values : group_row_values)(
          group, static_cast<int>(local % kGroupRows), in_features, y);
    } else {
      row_values(type, base + local * row_bytes, in_features, y);
    }
  }
  return out;
}

}  // namespace tokenloom_gguf
