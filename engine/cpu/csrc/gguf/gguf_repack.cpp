// Q4_K, Q6_K and Q4_1 rows repacked eight to a group for gguf_dot_x8.h, gguf_dot_q6_k_x8.h and
// gguf_dot_q4_1_x8.h (their headers have the layouts and why), at load. It only moves bits, as
// engine/cpu/gguf_repack.py's unpack_q4_k_x8, unpack_q6_k_x8 and unpack_q4_1_x8 read them back.
// In numpy the packs were most of a 1B file's load (docs/cpu-kernels.md has the rates).

#include <ATen/Parallel.h>
#include <torch/types.h>

#include <cstdint>

namespace tokenloom_gguf {
namespace {

constexpr int kRows = 8;  // rows in a group
constexpr int64_t kQ4Bytes = 144;  // a Q4_K super-block: fp16 d and dmin, 12 scale bytes, 128 code bytes
constexpr int64_t kQ6Bytes = 210;  // a Q6_K super-block: 128 bytes ql, 64 qh, 16 int8 scales, fp16 d
constexpr int64_t kQ4_1Bytes = 20;  // a Q4_1 block of 32: fp16 d, fp16 m, 16 bytes of nibbles

// gguf's Q4_K.get_scale_min: sub-block j's 6-bit scale and min from the 12 scale bytes.
inline uint8_t q4k_scale(const uint8_t* s, int j) {
  return j < 4 ? (s[j] & 63) : ((s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4));
}
inline uint8_t q4k_min(const uint8_t* s, int j) {
  return j < 4 ? (s[j + 4] & 63) : ((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
}

// The eight rows' super-block `blocks[r]` -> the group's 8 x 144 bytes: the rows' d [r][2] and dmin
// [r][2]; the scales [s][r] and mins [p][r][2] (u, 128 six-bit values) as low nibbles (u[i] and
// u[64 + i] in byte i) and their top two bits four to a byte (u[i], u[32 + i], u[64 + i], u[96 + i]);
// then the codes [j][l][r][4]: each row's 4 code bytes l of 32-input pair j, rows side by side.
void pack_q4_k_group_block(const uint8_t* const* blocks, uint8_t* out) {
  uint8_t u[128];
  for (int r = 0; r < kRows; ++r) {
    const uint8_t* b = blocks[r];
    for (int e = 0; e < 2; ++e) out[2 * r + e] = b[e], out[16 + 2 * r + e] = b[2 + e];
    for (int j = 0; j < 8; ++j) {
      u[8 * j + r] = q4k_scale(b + 4, j);
      u[64 + 16 * (j / 2) + 2 * r + j % 2] = q4k_min(b + 4, j);
    }
    for (int j = 0; j < 4; ++j)
      for (int l = 0; l < 8; ++l)
        for (int c = 0; c < 4; ++c) out[128 + ((j * 8 + l) * kRows + r) * 4 + c] = b[16 + 32 * j + 4 * l + c];
  }
  for (int i = 0; i < 64; ++i) out[32 + i] = static_cast<uint8_t>((u[i] & 0x0F) | ((u[64 + i] & 0x0F) << 4));
  for (int i = 0; i < 32; ++i)
    out[96 + i] = static_cast<uint8_t>((u[i] >> 4) | ((u[32 + i] >> 4) << 2) | ((u[64 + i] >> 4) << 4) |
                                       ((u[96 + i] >> 4) << 6));
}

// One super-block's 256 codes (q + 32, 6 bits) in input order: input 128 h + 32 k + l is ql[64 h +
// 32 (k % 2) + l]'s low (k < 2) or high nibble, with qh[32 h + l]'s bits 2 k on top (gguf's Q6_K).
inline void q6_codes(const uint8_t* block, uint8_t* codes) {
  const uint8_t* ql = block;
  const uint8_t* qh = block + 128;
  for (int h = 0; h < 2; ++h)
    for (int k = 0; k < 4; ++k)
      for (int l = 0; l < 32; ++l) {
        const uint8_t low = ql[64 * h + 32 * (k % 2) + l];
        const uint8_t top = (qh[32 * h + l] >> (2 * k)) & 0x03;
        codes[128 * h + 32 * k + l] = static_cast<uint8_t>((k < 2 ? low & 0x0F : low >> 4) | (top << 4));
      }
}

// The eight rows' super-block `blocks[r]` -> the group's 8 x 210 bytes: the rows' d [r][2], their
// int8 scales [p][r][2], then each 16 inputs' codes as three 32-byte loads [s][k][r][c]: load k
// holds code 16 s + 4 k + c of row r in its low 6 bits and two bits of code 16 s + 12 + c above.
void pack_q6_k_group_block(const uint8_t* const* blocks, uint8_t* out) {
  uint8_t codes[kRows][256];
  for (int r = 0; r < kRows; ++r) {
    out[2 * r] = blocks[r][208];
    out[2 * r + 1] = blocks[r][209];
    for (int p = 0; p < 8; ++p)
      for (int e = 0; e < 2; ++e) out[16 + 16 * p + 2 * r + e] = blocks[r][192 + 2 * p + e];
    q6_codes(blocks[r], codes[r]);
  }
  uint8_t* loads = out + 144;
  for (int s = 0; s < 16; ++s)
    for (int k = 0; k < 3; ++k)
      for (int r = 0; r < kRows; ++r)
        for (int c = 0; c < 4; ++c) {
          const uint8_t top = (codes[r][16 * s + 12 + c] >> (2 * k)) & 0x03;
          loads[((s * 3 + k) * kRows + r) * 4 + c] = static_cast<uint8_t>(codes[r][16 * s + 4 * k + c] | (top << 6));
        }
}

// The eight rows' block of 32 `blocks[r]` -> the group's 8 x 20 bytes: the rows' d [r][2], their m
// [r][2], then the codes as four loads [l][r][c]: row r's qs[4 l + c] (inputs 4 l + c, 16 + 4 l + c).
void pack_q4_1_group_block(const uint8_t* const* blocks, uint8_t* out) {
  for (int r = 0; r < kRows; ++r) {
    const uint8_t* b = blocks[r];
    for (int e = 0; e < 2; ++e) out[2 * r + e] = b[e], out[16 + 2 * r + e] = b[2 + e];
    for (int l = 0; l < 4; ++l)
      for (int c = 0; c < 4; ++c) out[32 + 32 * l + 4 * r + c] = b[4 + 4 * l + c];
  }
}

// uint8 [8 g, bytes per row] rows -> [g, 8 x bytes per row], each group's super-blocks in turn,
// written straight into the output on every thread (no temporaries beside it).
torch::Tensor pack_x8(const torch::Tensor& rows, int64_t block_bytes,
                      void (*pack_block)(const uint8_t* const*, uint8_t*)) {
  TORCH_CHECK(rows.scalar_type() == at::kByte && rows.dim() == 2, "rows: uint8 [rows, bytes per row]");
  TORCH_CHECK(rows.size(0) % kRows == 0 && rows.size(1) % block_bytes == 0,
              "rows: a multiple of 8 rows of whole ", block_bytes, "-byte super-blocks, not ", rows.sizes());
  const torch::Tensor in = rows.contiguous();
  const int64_t num_groups = in.size(0) / kRows, row_bytes = in.size(1), num_blocks = row_bytes / block_bytes;
  auto out = torch::empty({num_groups, kRows * row_bytes}, in.options());
  const uint8_t* src = in.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, num_groups, 16, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g)
      for (int64_t b = 0; b < num_blocks; ++b) {
        const uint8_t* blocks[kRows];
        for (int r = 0; r < kRows; ++r) blocks[r] = src + (g * kRows + r) * row_bytes + b * block_bytes;
        pack_block(blocks, dst + g * kRows * row_bytes + b * kRows * block_bytes);
      }
  });
  return out;
}

}  // namespace

torch::Tensor pack_q4_k_x8(const torch::Tensor& rows) { return pack_x8(rows, kQ4Bytes, pack_q4_k_group_block); }
torch::Tensor pack_q6_k_x8(const torch::Tensor& rows) { return pack_x8(rows, kQ6Bytes, pack_q6_k_group_block); }
torch::Tensor pack_q4_1_x8(const torch::Tensor& rows) { return pack_x8(rows, kQ4_1Bytes, pack_q4_1_group_block); }

}  // namespace tokenloom_gguf
