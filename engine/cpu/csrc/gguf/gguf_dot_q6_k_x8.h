// Q6_K rows eight at a time, repacked at load time (engine/cpu/gguf_repack.py's pack_q6_k_x8),
// as Q4_K's are (gguf_dot_x8.h): one 32-byte load holds the same four inputs of eight rows,
// each output row is a lane, and the tokens' activations come interleaved by 4-byte words.
//
// Why: row by row (gguf_dot.h's dot_q6_k) each 32 inputs cost a token one vpmaddubsw and one
// vpmaddwd (the two 16-input scales), both on the two multiply pipes: 16 multiplies per 256
// products. With rows in lanes, a 6-bit code (0..63) times an int8 input pairs up to
// 2 * 63 * 127 = 16002, so two vpmaddubsw add up in int16 (32004) before they meet the eight
// rows' scales in one vpmaddwd: a 16-input sub-block of 8 rows is 4 vpmaddubsw and 2 vpmaddwd,
// 12 multiplies per 256 products. The codes are q + 32; the offset's term, 32 sum_s sc_s sum
// q_x over sub-block s, comes from the activations' sums per 16 (8 vpmaddwd a token and
// super-block, as dot_q6_k does it).
//
// A group of 8 rows, super-block b, is 1680 bytes (8 x 210, the same bytes rearranged):
//   [0, 16)     the rows' fp16 d
//   [16, 144)   their int8 scales: 16 bytes per pair p of sub-blocks, byte 2 r + e row r's
//               scale of sub-block 2 p + e (so one vpmovsxbw gives the offset's pairs)
//   [144, 1680) the codes, 96 bytes per sub-block s of 16 inputs (words 4 s + k, k = 0..3, of
//               four inputs each): byte 4 r + c of load k < 3, [32 k, 32 k + 32), holds row r's
//               code of input 16 s + 4 k + c in its low 6 bits and bits 2 k, 2 k + 1 of its
//               code of input 16 s + 12 + c in its top two, so three codes are one vpand each
//               and the fourth is gathered from the three top pairs (11 instructions a
//               sub-block; nibble and 2-bit planes, as the file has them, took 17)
#pragma once

#include "gguf_dot_x8.h"

namespace tokenloom_gguf {

constexpr int64_t kQ6GroupBlockBytes = 8 * 210;
constexpr int64_t kQ6_Kx8 = 1000 + kQ6_K;  // our id for the repacked layout (not a ggml type)

// vpshufb patterns: each row's 32-bit lane takes its scale of sub-block 2 p + e in both
// 16-bit halves, from the pair's int16 [r][e] (kDupScale[e]).
alignas(32) inline const uint8_t kDupScale[2][32] = {
    {0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13, 0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13},
    {2, 3, 2, 3, 6, 7, 6, 7, 10, 11, 10, 11, 14, 15, 14, 15, 2, 3, 2, 3, 6, 7, 6, 7, 10, 11, 10, 11, 14, 15, 14, 15}};

// One sub-block (16 inputs) of 8 rows against kTokens tokens: sums[t] += sc_r * sum q x per row lane.
template <int kTokens>
inline void q6_sub_block(const uint8_t* codes, const int32_t* xw, __m256i scales, __m256i* sums) {
  const __m256i low6 = _mm256_set1_epi8(0x3f), top2 = _mm256_set1_epi8(static_cast<char>(0xc0));
  const __m256i b0 = load256(codes), b1 = load256(codes + 32), b2 = load256(codes + 64);
  const __m256i w0 = _mm256_and_si256(b0, low6), w1 = _mm256_and_si256(b1, low6), w2 = _mm256_and_si256(b2, low6);
  // 16-bit shifts of masked bytes: nothing crosses into the neighbouring byte.
  const __m256i w3 = _mm256_or_si256(
      _mm256_or_si256(_mm256_srli_epi16(_mm256_and_si256(b0, top2), 6), _mm256_srli_epi16(_mm256_and_si256(b1, top2), 4)),
      _mm256_srli_epi16(_mm256_and_si256(b2, top2), 2));
#pragma GCC unroll 8
  for (int t = 0; t < kTokens; ++t) {
    const __m256i a = _mm256_add_epi16(_mm256_maddubs_epi16(w0, _mm256_set1_epi32(xw[0 * kTokens + t])),
                                       _mm256_maddubs_epi16(w1, _mm256_set1_epi32(xw[1 * kTokens + t])));
    const __m256i b = _mm256_add_epi16(_mm256_maddubs_epi16(w2, _mm256_set1_epi32(xw[2 * kTokens + t])),
                                       _mm256_maddubs_epi16(w3, _mm256_set1_epi32(xw[3 * kTokens + t])));
    sums[t] = _mm256_add_epi32(sums[t], _mm256_add_epi32(_mm256_madd_epi16(a, scales), _mm256_madd_epi16(b, scales)));
  }
}

// out[t * 8 + r] = row r . x_t for t < kTokens (up to 8); x and xw as dot_q4_k_x8 takes them.
// Past 4 tokens the int32 sums and fp32 accumulators live in L1 (in_memory_past_4), so the
// four code vectors, the scales and a token's temporaries keep to the 16 registers.
template <int kTokens>
inline void dot_q6_k_x8(const uint8_t* group, const ActK& x, int64_t x_stride, const int32_t* xw, float* out) {
  alignas(32) __m256 acc_store[kTokens];
  __m256* acc = in_memory_past_4<kTokens>(acc_store);
#pragma GCC unroll 8
  for (int t = 0; t < kTokens; ++t) acc[t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < x.num_blocks; ++b) {
    const uint8_t* blk = group + b * kQ6GroupBlockBytes;
    alignas(32) __m256i sums_store[kTokens];
    __m256i* sums = in_memory_past_4<kTokens>(sums_store);
#pragma GCC unroll 8
    for (int t = 0; t < kTokens; ++t) sums[t] = _mm256_setzero_si256();
    // - 32 sum_s sc_s sum q over s: the offset of the codes q + 32, a pair of sub-blocks a vpmaddwd.
#pragma GCC unroll 8
    for (int p = 0; p < 8; ++p) {
      const __m256i pair = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 16 + 16 * p)));
#pragma GCC unroll 8
      for (int t = 0; t < kTokens; ++t) {
        int32_t s16;
        std::memcpy(&s16, x.sums16 + (t * x_stride + b) * 16 + 2 * p, 4);
        sums[t] = _mm256_sub_epi32(sums[t], _mm256_madd_epi16(pair, _mm256_set1_epi32(s16)));
      }
    }
#pragma GCC unroll 8
    for (int t = 0; t < kTokens; ++t) sums[t] = _mm256_slli_epi32(sums[t], 5);
    const int32_t* xb = xw + b * (kQK / 4) * kTokens;
#pragma GCC unroll 1
    for (int p = 0; p < 8; ++p) {
      constexpr int64_t kStretch = kQ6GroupBlockBytes / 8;  // an eighth of the super-block per pair of sub-blocks
      prefetch_next_block<kTokens, kQ6GroupBlockBytes, kStretch>(blk + kStretch * p);
      const __m256i pair = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 16 + 16 * p)));
      const uint8_t* codes = blk + 144 + 192 * p;
      q6_sub_block<kTokens>(codes, xb + 8 * kTokens * p, pick(pair, kDupScale[0]), sums);
      q6_sub_block<kTokens>(codes + 96, xb + (8 * p + 4) * kTokens, pick(pair, kDupScale[1]), sums);
    }
    add_super_block<kTokens>(blk, x, x_stride, b, sums, acc);
  }
#pragma GCC unroll 8
  for (int t = 0; t < kTokens; ++t) _mm256_storeu_ps(out + 8 * t, acc[t]);
}

}  // namespace tokenloom_gguf
