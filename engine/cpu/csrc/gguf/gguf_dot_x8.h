// Q4_K rows eight at a time, repacked at load time (engine/cpu/gguf_repack.py) so that one
// 32-byte load holds the same four inputs of eight rows, and each output row is a lane.
//
// Why: row by row (gguf_dot.h) each sub-block of 32 inputs costs a token one vpmaddubsw and
// one vpmaddwd (the sub-block's scale), both on the two multiply pipes, so several tokens
// make the kernel compute-bound well below the memory rate. With rows in lanes a sub-block's
// eight vpmaddubsw (8 rows x 32 inputs) add up in int16 (at most 8 * 2 * 15 * 127 = 30480)
// and meet the eight rows' scales in one vpmaddwd: 9 multiplies per 256 products, not 16.
//
// A group of 8 rows, super-block b, is 1152 bytes (8 x 144, the same bytes rearranged):
//   [0, 16)   the rows' fp16 d; [16, 32) their dmin
//   [32, 128) their 6-bit scales and mins, as 128 bytes U (U[8 s + r] = row r's scale of
//             sub-block s; U[64 + 16 p + 2 r + e] = row r's min of sub-block 2 p + e) split
//             into planes: low nibbles L[i] = U[i] | U[64 + i] << 4 (64 bytes), then the top
//             two bits H[i] = U[i] >> 4 | U[32 + i] >> 4 << 2 | U[64 + i] >> 4 << 4 | U[96 + i] >> 4 << 6
//   [128, 1152) the codes: 32 loads, (j, l) at 128 + 32 (8 j + l): byte 4 r + c is row r's
//             qs[32 j + 4 l + c] (low nibble: input 4 l + c of sub-block 2 j; high: of 2 j + 1)
#pragma once

#include "gguf_dot.h"

namespace tokenloom_gguf {

constexpr int64_t kGroupRows = 8;
constexpr int64_t kGroupTokens = 8;  // tokens per pass over a group (dot_q4_k_x8's most)
constexpr int64_t kGroupBlockBytes = 8 * 144;
constexpr int64_t kQ4_Kx8 = 1000 + kQ4_K;  // our id for the repacked layout (not a ggml type)

// Sub-block s's eight rows' scales, each in both of its 16-bit lanes, from U's bytes [8 s, 8 s + 8).
template <int kSub>
inline __m256i sub_block_scales(__m256i scales_lo, __m256i scales_hi) {
  const __m256i u = kSub < 4 ? scales_lo : scales_hi;  // sub-blocks 0..3, 4..7: 8 bytes each
  // within a 128-bit half: sub-block 2 h + 0 in bytes 0..7, 2 h + 1 in 8..15
  const __m256i twice = (kSub % 2 == 0) ? _mm256_unpacklo_epi8(u, u) : _mm256_unpackhi_epi8(u, u);
  return _mm256_cvtepu8_epi16((kSub % 4) < 2 ? _mm256_castsi256_si128(twice) : _mm256_extracti128_si256(twice, 1));
}

// One sub-block (32 inputs) of 8 rows against kTokens tokens: sums[t] += scale_r * sum q x per row lane.
// The sub-blocks go one at a time (a group's codes are loaded twice, once per nibble) so a
// token keeps one int16 sum live, not two.
template <int kTokens, int kSub>
inline void sub_block(const uint8_t* codes, const int32_t* xw, __m256i scales, __m256i* sums) {
  const __m256i low4 = _mm256_set1_epi8(0x0f), high4 = _mm256_set1_epi8(static_cast<char>(0xf0));
  __m256i s16[kTokens];
#pragma GCC unroll 8
  for (int t = 0; t < kTokens; ++t) s16[t] = _mm256_setzero_si256();
#pragma GCC unroll 8
  for (int l = 0; l < 8; ++l) {
    // The high nibbles masked before the shift: the mask takes the load as its memory operand,
    // two instructions where a load, a shift and a mask were three (in L2, one core: 1 and 2
    // tokens 2-3% faster, 8 tokens 8%). Not at 3 and 4 tokens, whose sums and scales fill the
    // registers: the mask's constant made 4 tokens 7% slower.
    constexpr bool kMaskFirst = kTokens <= 2 || kTokens > 4;
    const __m256i bits = load256(codes + 32 * (8 * (kSub / 2) + l));
    const __m256i w = kSub % 2 == 0 ? _mm256_and_si256(bits, low4)
                      : kMaskFirst  ? _mm256_srli_epi16(_mm256_and_si256(bits, high4), 4)
                                    : _mm256_and_si256(_mm256_srli_epi16(bits, 4), low4);
#pragma GCC unroll 8
    for (int t = 0; t < kTokens; ++t) {
      const __m256i xv = _mm256_set1_epi32(xw[(8 * kSub + l) * kTokens + t]);  // token t's inputs 32 s + 4 l ..
      s16[t] = _mm256_add_epi16(s16[t], _mm256_maddubs_epi16(w, xv));
      // GCC would otherwise reassociate the adds into a tree of all 8 products, spilling them.
      asm("" : "+x"(s16[t]));
    }
  }
#pragma GCC unroll 8
  for (int t = 0; t < kTokens; ++t) {
    const __m256i p = _mm256_madd_epi16(s16[t], scales);
    sums[t] = _mm256_add_epi32(sums[t], p);
  }
}

// A group kernel's software prefetch, for calls that take one (prefetches): each stretch
// of kStretch bytes of a super-block, as the kernel reaches it, fetches the same stretch of the
// next super-block (kBlockBytes on; the next group's first past a group's last). All of a
// super-block's lines fetched 4.5 KB ahead at its start (prefetch_ahead, as the rows still do),
// a burst of 18 to 27 prefetches, held up the kernel's own loads: one token read Q6_K's groups
// from memory at three quarters of the plain read, where spread so it reads as fast as the
// plain read, and Q4_K's gained less (docs/cpu-kernels.md has the figures, and
// scripts/bench/probes/gguf_group_prefetch.cpp the variants).
template <int kTokens, int64_t kBlockBytes, int64_t kStretch>
inline void prefetch_next_block(const uint8_t* stretch) {
  if (!prefetches<kTokens>()) return;
#pragma GCC unroll 8
  for (int64_t k = 0; k < kStretch; k += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(stretch + kBlockBytes + k), _MM_HINT_T0);
  }
}

// `p` itself, past 4 tokens hidden from GCC: what it points at then stays in memory.
template <int kTokens, typename T>
inline T* in_memory_past_4(T* p) {
  if (kTokens > 4) asm("" : "+r"(p));
  return p;
}

// acc[t] += d_r * d_t * sums[t] per row lane: super-block b's int32 sums into the fp32
// accumulators, d_r the eight rows' fp16 scales at `d_halves`, d_t token t's activation scale.
template <int kTokens>
inline void add_super_block(const uint8_t* d_halves, const ActK& x, int64_t x_stride, int64_t b, const __m256i* sums,
                            __m256* acc) {
  const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d_halves)));
#pragma GCC unroll 8
  for (int t = 0; t < kTokens; ++t) {
    acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(x.d[t * x_stride + b])), _mm256_cvtepi32_ps(sums[t]),
                             acc[t]);
  }
}

// out[t * 8 + r] = row r . x_t for t < kTokens (up to 8). The tokens' int8 activations come
// interleaved by 4-byte words too (xw: word w of token t at xw[w * kTokens + t], four inputs
// each), so every broadcast's address is one pointer plus a constant: with a row pointer per
// token, 8 tokens' pointers took 8 general registers and GCC reloaded them from the stack
// before every broadcast. x gives the scales and sums per 32 (x_stride blocks a token).
// Up to 4 tokens the accumulators stay in registers. Past 4 (`in_memory_past_4`) the fp32
// accumulators and the super-block's int32 sums live in memory (L1: a load, add and store a
// token and sub-block), so that eight tokens' int16 sums and the codes fill the 16 registers
// without spills: one pass of 8 tokens then unpacks the codes, scales and mins once, where
// two passes of 4 did it twice.
template <int kTokens>
inline void dot_q4_k_x8(const uint8_t* group, const ActK& x, int64_t x_stride, const int32_t* xw, float* out) {
  const __m256i low4 = _mm256_set1_epi8(0x0f), low2 = _mm256_set1_epi8(0x03);
  alignas(32) __m256 acc_store[kTokens];
  __m256* acc = in_memory_past_4<kTokens>(acc_store);
#pragma GCC unroll 8
  for (int t = 0; t < kTokens; ++t) acc[t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < x.num_blocks; ++b) {
    const uint8_t* blk = group + b * kGroupBlockBytes;
    const __m256i l0 = load256(blk + 32), l1 = load256(blk + 64), h = load256(blk + 96);
    {
      // The mins' term first, so its registers are free before the codes'.
      const __m256i mins_lo = _mm256_or_si256(  // U[64, 96): mins of sub-blocks 0..3, [p][r][e]
          _mm256_and_si256(_mm256_srli_epi16(l0, 4), low4),
          _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 4), low2), 4));
      const __m256i mins_hi = _mm256_or_si256(  // U[96, 128): 4..7
          _mm256_and_si256(_mm256_srli_epi16(l1, 4), low4),
          _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 6), low2), 4));
      const __m256i mins[4] = {_mm256_cvtepu8_epi16(_mm256_castsi256_si128(mins_lo)),
                               _mm256_cvtepu8_epi16(_mm256_extracti128_si256(mins_lo, 1)),
                               _mm256_cvtepu8_epi16(_mm256_castsi256_si128(mins_hi)),
                               _mm256_cvtepu8_epi16(_mm256_extracti128_si256(mins_hi, 1))};
      const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 16)));
#pragma GCC unroll 8
      for (int t = 0; t < kTokens; ++t) {
        const int16_t* s32 = x.sums32 + (t * x_stride + b) * 8;
        __m256i m = _mm256_setzero_si256();
#pragma GCC unroll 4
        for (int p = 0; p < 4; ++p) {  // row r: m_r[2p] * sum_{2p} + m_r[2p+1] * sum_{2p+1}
          int32_t pair;
          std::memcpy(&pair, s32 + 2 * p, 4);
          m = _mm256_add_epi32(m, _mm256_madd_epi16(mins[p], _mm256_set1_epi32(pair)));
        }
        acc[t] = _mm256_fnmadd_ps(_mm256_mul_ps(dmin, _mm256_set1_ps(x.d[t * x_stride + b])), _mm256_cvtepi32_ps(m),
                                  acc[t]);
      }
    }
    const __m256i scales_lo =  // U[0, 32): sub-blocks 0..3's scales, 8 rows each
        _mm256_or_si256(_mm256_and_si256(l0, low4), _mm256_slli_epi16(_mm256_and_si256(h, low2), 4));
    const __m256i scales_hi = _mm256_or_si256(  // U[32, 64): 4..7
        _mm256_and_si256(l1, low4), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2), low2), 4));
    alignas(32) __m256i sums_store[kTokens];
    __m256i* sums = in_memory_past_4<kTokens>(sums_store);
#pragma GCC unroll 8
    for (int t = 0; t < kTokens; ++t) sums[t] = _mm256_setzero_si256();
    const uint8_t* codes = blk + 128;
    const int32_t* xb = xw + b * (kQK / 4) * kTokens;
    if (kTokens <= 4) {
      constexpr int64_t kStretch = kGroupBlockBytes / 4;  // a quarter of the super-block per pair of sub-blocks
      prefetch_next_block<kTokens, kGroupBlockBytes, kStretch>(blk);
      sub_block<kTokens, 0>(codes, xb, sub_block_scales<0>(scales_lo, scales_hi), sums);
      sub_block<kTokens, 1>(codes, xb, sub_block_scales<1>(scales_lo, scales_hi), sums);
      prefetch_next_block<kTokens, kGroupBlockBytes, kStretch>(blk + kStretch);
      sub_block<kTokens, 2>(codes, xb, sub_block_scales<2>(scales_lo, scales_hi), sums);
      sub_block<kTokens, 3>(codes, xb, sub_block_scales<3>(scales_lo, scales_hi), sums);
      prefetch_next_block<kTokens, kGroupBlockBytes, kStretch>(blk + 2 * kStretch);
      sub_block<kTokens, 4>(codes, xb, sub_block_scales<4>(scales_lo, scales_hi), sums);
      sub_block<kTokens, 5>(codes, xb, sub_block_scales<5>(scales_lo, scales_hi), sums);
      prefetch_next_block<kTokens, kGroupBlockBytes, kStretch>(blk + 3 * kStretch);
      sub_block<kTokens, 6>(codes, xb, sub_block_scales<6>(scales_lo, scales_hi), sums);
      sub_block<kTokens, 7>(codes, xb, sub_block_scales<7>(scales_lo, scales_hi), sums);
    } else {
      // Past 4 tokens, fully unrolled, the loop's code outgrew the op cache: a loop over the
      // four pairs of sub-blocks, their scales from memory.
      alignas(32) __m256i scales[8] = {
          sub_block_scales<0>(scales_lo, scales_hi), sub_block_scales<1>(scales_lo, scales_hi),
          sub_block_scales<2>(scales_lo, scales_hi), sub_block_scales<3>(scales_lo, scales_hi),
          sub_block_scales<4>(scales_lo, scales_hi), sub_block_scales<5>(scales_lo, scales_hi),
          sub_block_scales<6>(scales_lo, scales_hi), sub_block_scales<7>(scales_lo, scales_hi)};
      const __m256i* scales_at = in_memory_past_4<kTokens>(scales);
#pragma GCC unroll 1
      for (int j = 0; j < 4; ++j) {
        sub_block<kTokens, 0>(codes + 256 * j, xb + 16 * kTokens * j, scales_at[2 * j], sums);
        sub_block<kTokens, 1>(codes + 256 * j, xb + 16 * kTokens * j, scales_at[2 * j + 1], sums);
      }
    }
    add_super_block<kTokens>(blk, x, x_stride, b, sums, acc);
  }
#pragma GCC unroll 8
  for (int t = 0; t < kTokens; ++t) _mm256_storeu_ps(out + 8 * t, acc[t]);
}

}  // namespace tokenloom_gguf
