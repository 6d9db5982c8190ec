// Q4_1 rows eight at a time, repacked at load time (engine/cpu/gguf_repack.py's pack_q4_1_x8), as
// Q4_K's are (gguf_dot_x8.h): one 32-byte load holds the same four inputs of eight rows, each
// output row is a lane, and the tokens' int8 activations (Q8_0's, per 32) come interleaved by
// 4-byte words (interleave_token).
//
// Why: row by row (gguf_dot.h's dot_q32) each block of 32 inputs costs a token a vpmaddubsw, a
// vpmaddwd, a vector FMA and a scalar one (the minimum's term) for 32 products of one row, and
// its 16 code bytes lie at 20-byte strides, across cache lines. With rows in lanes a block's
// eight vpmaddubsw (8 rows x 32 inputs) add up in int16 (at most 8 * 2 * 15 * 127 = 30480) and
// meet one vpmaddwd by ones: 9 multiplies per 256 products, and one epilogue (cvt, d_r d_x and
// the m_r ds_x FMA) for the eight rows.
//
// A group of 8 rows, block b of 32 inputs, is 160 bytes (8 x 20, the same bytes rearranged):
//   [0, 16)    the rows' fp16 d, row r at 2 r (one vcvtph2ps gives the eight rows' d)
//   [16, 32)   their fp16 m
//   [32, 160)  the codes: 4 loads, load l at 32 + 32 l: byte 4 r + c is row r's qs[4 l + c]
//              (low nibble: input 4 l + c; high: input 16 + 4 l + c), so load l's low nibbles
//              meet the activations' word l and its high nibbles word 4 + l
// w = d q + m (q in 0..15), as the file's rows: only bits move, unpack_q4_1_x8 reads them back.
#pragma once

#include "gguf_dot_x8.h"

namespace tokenloom_gguf {

constexpr int64_t kQ4_1GroupBlockBytes = 8 * 20;
constexpr int64_t kQ4_1x8 = 1000 + kQ4_1;  // our id for the repacked layout (not a ggml type)

// out[t * 8 + r] = row r . x_t for t < kTokens (up to 8). x: the tokens' Q8_0 scales d and
// scaled sums ds = d sum q per 32 (x_stride blocks a token); xw: their int8 inputs as words,
// word w of token t at xw[w * kTokens + t]. Past 4 tokens the fp32 accumulators live in L1
// (in_memory_past_4), so eight tokens' int16 sums and the codes keep to the 16 registers.
template <int kTokens>
inline void dot_q4_1_x8(const uint8_t* group, const Act32& x, int64_t x_stride, const int32_t* xw, float* out) {
  const __m256i low4 = _mm256_set1_epi8(0x0f), high4 = _mm256_set1_epi8(static_cast<char>(0xf0));
  const __m256i ones16 = _mm256_set1_epi16(1);
  alignas(32) __m256 acc_store[kTokens];
  __m256* acc = in_memory_past_4<kTokens>(acc_store);
#pragma GCC unroll 8
  for (int t = 0; t < kTokens; ++t) acc[t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < x.num_blocks; ++b) {
    const uint8_t* blk = group + b * kQ4_1GroupBlockBytes;
    // Each block fetches its own bytes four blocks on, spread as the K groups' are
    // (prefetch_next_block): ten lines in a burst every fourth block read slower from memory
    // (docs/cpu-kernels.md).
    prefetch_next_block<kTokens, 4 * kQ4_1GroupBlockBytes, kQ4_1GroupBlockBytes>(blk);
    const int32_t* xb = xw + b * (kQ32 / 4) * kTokens;
    __m256i s16[kTokens];
#pragma GCC unroll 8
    for (int t = 0; t < kTokens; ++t) s16[t] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int k = 0; k < 8; ++k) {  // word k: load k % 4's low (k < 4) or high nibbles
      const __m256i bits = load256(blk + 32 + 32 * (k % 4));
      const __m256i w = k < 4 ? _mm256_and_si256(bits, low4) : _mm256_srli_epi16(_mm256_and_si256(bits, high4), 4);
#pragma GCC unroll 8
      for (int t = 0; t < kTokens; ++t) {
        s16[t] = _mm256_add_epi16(s16[t], _mm256_maddubs_epi16(w, _mm256_set1_epi32(xb[k * kTokens + t])));
        // GCC would otherwise reassociate the adds into a tree of all 8 products, spilling them.
        asm("" : "+x"(s16[t]));
      }
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk)));
    const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 16)));
#pragma GCC unroll 8
    for (int t = 0; t < kTokens; ++t) {
      const __m256 sums = _mm256_cvtepi32_ps(_mm256_madd_epi16(s16[t], ones16));  // row r's sum q q_x in lane r
      acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(x.d[t * x_stride + b])), sums, acc[t]);
      acc[t] = _mm256_fmadd_ps(m, _mm256_set1_ps(x.ds[t * x_stride + b]), acc[t]);  // m_r d_x sum q_x
    }
  }
#pragma GCC unroll 8
  for (int t = 0; t < kTokens; ++t) _mm256_storeu_ps(out + 8 * t, acc[t]);
}

}  // namespace tokenloom_gguf
