// Two neighbouring groups of 8 repacked rows (Q4_K, Q6_K, Q4_1: gguf_dot_x8.h,
// gguf_dot_q6_k_x8.h, gguf_dot_q4_1_x8.h) at once on 512-bit AVX512-VNNI: each zmm holds the
// same 32-byte load of both groups, rows 0..7 of the first in lanes 0..7 and of the second in
// lanes 8..15, and every product is a vpdpbusd against one activation word broadcast to all 16.
//
// Why: with one group in a 256-bit register each vpdpbusd needs its own broadcast, and that
// pair runs well below vpdpbusd's own rate; a 512-bit vpdpbusd with its broadcast runs at the
// instruction's full rate with twice the products (scripts/bench/probes/vnni_broadcast.cpp;
// docs/cpu-kernels.md has the figures). The groups keep their layout, so a pair's sums are
// each group's bit for bit. Calls of few tokens stay on the AVX2 kernels (gguf_linear.cpp's
// pairs_groups).
#pragma once

#include "gguf_dot_q4_1_x8.h"
#include "gguf_dot_q6_k_x8.h"
#include "gguf_dot_x8.h"

#if TL_GGUF_VNNI

namespace tokenloom_gguf {

// [a's 32 bytes | b's 32 bytes]
inline __m512i load_pair(const uint8_t* a, const uint8_t* b) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(load256(a)), load256(b), 1);
}

// 16 fp16 values, a's 8 then b's 8, as fp32.
inline __m512 halves_pair(const uint8_t* a, const uint8_t* b) {
  const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a));
  return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(lo),
                                                 _mm_loadu_si128(reinterpret_cast<const __m128i*>(b)), 1));
}

// Bytes [8 k, 8 k + 8) of each group's half of z (a's in z's low 256 bits, b's in its high),
// zero-extended to 16 int32 lanes: each of the 16 rows' byte.
template <int k>
inline __m512i rows_bytes32(__m512i z) {
  const __m512i pick = _mm512_set_epi64(0, 0, 0, 0, 0, 0, 4 + k, k);
  return _mm512_cvtepu8_epi32(_mm512_castsi512_si128(_mm512_permutexvar_epi64(pick, z)));
}

// 128-bit lanes k of each group's half of z (0 or 1), a's then b's, zero-extended to 32 int16.
template <int k>
inline __m512i rows_lanes16(__m512i z) {
  const __m512i lanes = _mm512_shuffle_i64x2(z, z, _MM_SHUFFLE(3, 1, 2, 0));  // [a0, b0, a1, b1]
  return _mm512_cvtepu8_epi16(k == 0 ? _mm512_castsi512_si256(lanes) : _mm512_extracti64x4_epi64(lanes, 1));
}

template <int kTokens>
inline void store_pair(const __m512* acc, float* out_a, float* out_b) {
#pragma GCC unroll 8
  for (int t = 0; t < kTokens; ++t) {
    _mm256_storeu_ps(out_a + 8 * t, _mm512_castps512_ps256(acc[t]));
    _mm256_storeu_ps(out_b + 8 * t, _mm512_extractf32x8_ps(acc[t], 1));
  }
}

// acc[t] += d_r * d_t * sums[t] per row lane (add_super_block's, both groups).
template <int kTokens>
inline void add_super_block_pair(__m512 d, const ActK& x, int64_t x_stride, int64_t b, const __m512i* sums,
                                 __m512* acc) {
#pragma GCC unroll 8
  for (int t = 0; t < kTokens; ++t) {
    acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(x.d[t * x_stride + b])), _mm512_cvtepi32_ps(sums[t]),
                             acc[t]);
  }
}

// The prefetch of both groups' next super-block (prefetch_next_block's), for one-token calls.
template <int kTokens, int64_t kBlockBytes, int64_t kStretch>
inline void prefetch_next_pair(const uint8_t* a, const uint8_t* b) {
  prefetch_next_block<kTokens, kBlockBytes, kStretch>(a);
  prefetch_next_block<kTokens, kBlockBytes, kStretch>(b);
}

// dot_q4_k_x8 for groups a and b: out_a[t * 8 + r], out_b[t * 8 + r]. Past 4 tokens the int32
// sums and fp32 accumulators live in L1 (in_memory_past_4), and a token's two chains (a pair's
// sub-blocks) over 8 tokens keep to the 32 registers. The sums in registers too ran faster on
// one core in L1 but slower in a prompt's layers on two threads (docs/cpu-kernels.md).
template <int kTokens>
inline void dot_q4_k_x16(const uint8_t* group_a, const uint8_t* group_b, const ActK& x, int64_t x_stride,
                         const int32_t* xw, float* out_a, float* out_b) {
  const __m512i low4 = _mm512_set1_epi8(0x0f), low2 = _mm512_set1_epi8(0x03);
  alignas(64) __m512 acc_store[kTokens];
  __m512* acc = in_memory_past_4<kTokens>(acc_store);
#pragma GCC unroll 8
  for (int t = 0; t < kTokens; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < x.num_blocks; ++b) {
    const uint8_t* a_blk = group_a + b * kGroupBlockBytes;
    const uint8_t* b_blk = group_b + b * kGroupBlockBytes;
    const __m512i l0 = load_pair(a_blk + 32, b_blk + 32), l1 = load_pair(a_blk + 64, b_blk + 64);
    const __m512i h = load_pair(a_blk + 96, b_blk + 96);
    {
      const __m512i mins_lo = _mm512_or_si512(  // per group U[64, 96): mins of sub-blocks 0..3, [p][r][e]
          _mm512_and_si512(_mm512_srli_epi16(l0, 4), low4),
          _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(h, 4), low2), 4));
      const __m512i mins_hi = _mm512_or_si512(  // U[96, 128): 4..7
          _mm512_and_si512(_mm512_srli_epi16(l1, 4), low4),
          _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(h, 6), low2), 4));
      const __m512i mins[4] = {rows_lanes16<0>(mins_lo), rows_lanes16<1>(mins_lo), rows_lanes16<0>(mins_hi),
                               rows_lanes16<1>(mins_hi)};
      const __m512 dmin = halves_pair(a_blk + 16, b_blk + 16);
#pragma GCC unroll 8
      for (int t = 0; t < kTokens; ++t) {
        const int16_t* s32 = x.sums32 + (t * x_stride + b) * 8;
        __m512i m = _mm512_setzero_si512();
#pragma GCC unroll 4
        for (int p = 0; p < 4; ++p) {
          int32_t pair;
          std::memcpy(&pair, s32 + 2 * p, 4);
          m = _mm512_add_epi32(m, _mm512_madd_epi16(mins[p], _mm512_set1_epi32(pair)));
        }
        acc[t] = _mm512_fnmadd_ps(_mm512_mul_ps(dmin, _mm512_set1_ps(x.d[t * x_stride + b])), _mm512_cvtepi32_ps(m),
                                  acc[t]);
      }
    }
    const __m512i scales_lo =  // per group U[0, 32): sub-blocks 0..3's scales, 8 rows each
        _mm512_or_si512(_mm512_and_si512(l0, low4), _mm512_slli_epi16(_mm512_and_si512(h, low2), 4));
    const __m512i scales_hi = _mm512_or_si512(  // U[32, 64): 4..7
        _mm512_and_si512(l1, low4), _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(h, 2), low2), 4));
    alignas(64) const __m512i scales[8] = {rows_bytes32<0>(scales_lo), rows_bytes32<1>(scales_lo),
                                           rows_bytes32<2>(scales_lo), rows_bytes32<3>(scales_lo),
                                           rows_bytes32<0>(scales_hi), rows_bytes32<1>(scales_hi),
                                           rows_bytes32<2>(scales_hi), rows_bytes32<3>(scales_hi)};
    alignas(64) __m512i sums_store[kTokens];
    __m512i* sums = in_memory_past_4<kTokens>(sums_store);
#pragma GCC unroll 8
    for (int t = 0; t < kTokens; ++t) sums[t] = _mm512_setzero_si512();
    const int32_t* xb = xw + b * (kQK / 4) * kTokens;
#pragma GCC unroll 1
    for (int j = 0; j < 4; ++j) {  // sub-blocks 2 j (low nibbles) and 2 j + 1 (high) of the same bytes
      constexpr int64_t kStretch = kGroupBlockBytes / 4;
      prefetch_next_pair<kTokens, kGroupBlockBytes, kStretch>(a_blk + j * kStretch, b_blk + j * kStretch);
      const uint8_t* a_codes = a_blk + 128 + 256 * j;
      const uint8_t* b_codes = b_blk + 128 + 256 * j;
      const int32_t* xj = xb + 16 * kTokens * j;
      __m512i even[kTokens], odd[kTokens];
#pragma GCC unroll 8
      for (int t = 0; t < kTokens; ++t) even[t] = _mm512_setzero_si512(), odd[t] = _mm512_setzero_si512();
#pragma GCC unroll 8
      for (int l = 0; l < 8; ++l) {
        const __m512i bits = load_pair(a_codes + 32 * l, b_codes + 32 * l);
        const __m512i w_even = _mm512_and_si512(bits, low4);
        const __m512i w_odd = _mm512_and_si512(_mm512_srli_epi16(bits, 4), low4);
#pragma GCC unroll 8
        for (int t = 0; t < kTokens; ++t) {
          even[t] = _mm512_dpbusd_epi32(even[t], w_even, _mm512_set1_epi32(xj[l * kTokens + t]));
          odd[t] = _mm512_dpbusd_epi32(odd[t], w_odd, _mm512_set1_epi32(xj[(8 + l) * kTokens + t]));
        }
      }
#pragma GCC unroll 8
      for (int t = 0; t < kTokens; ++t) {
        sums[t] = _mm512_add_epi32(sums[t], _mm512_add_epi32(_mm512_mullo_epi32(even[t], scales[2 * j]),
                                                             _mm512_mullo_epi32(odd[t], scales[2 * j + 1])));
      }
    }
    add_super_block_pair<kTokens>(halves_pair(a_blk, b_blk), x, x_stride, b, sums, acc);
  }
  store_pair<kTokens>(acc, out_a, out_b);
}

// The four code vectors of sub-block codes (q6_codes's), both groups' in one zmm each.
inline void q6_codes_pair(const uint8_t* a, const uint8_t* b, __m512i* w) {
  const __m512i low6 = _mm512_set1_epi8(0x3f), top2 = _mm512_set1_epi8(static_cast<char>(0xc0));
  const __m512i b0 = load_pair(a, b), b1 = load_pair(a + 32, b + 32), b2 = load_pair(a + 64, b + 64);
  w[0] = _mm512_and_si512(b0, low6), w[1] = _mm512_and_si512(b1, low6), w[2] = _mm512_and_si512(b2, low6);
  w[3] = _mm512_or_si512(
      _mm512_or_si512(_mm512_srli_epi16(_mm512_and_si512(b0, top2), 6), _mm512_srli_epi16(_mm512_and_si512(b1, top2), 4)),
      _mm512_srli_epi16(_mm512_and_si512(b2, top2), 2));
}

// dot_q6_k_x8 for groups a and b.
template <int kTokens>
inline void dot_q6_k_x16(const uint8_t* group_a, const uint8_t* group_b, const ActK& x, int64_t x_stride,
                         const int32_t* xw, float* out_a, float* out_b) {
  alignas(64) __m512 acc_store[kTokens];
  __m512* acc = in_memory_past_4<kTokens>(acc_store);
#pragma GCC unroll 8
  for (int t = 0; t < kTokens; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < x.num_blocks; ++b) {
    const uint8_t* a_blk = group_a + b * kQ6GroupBlockBytes;
    const uint8_t* b_blk = group_b + b * kQ6GroupBlockBytes;
    // Pair p's scales: int16 [group][row][sub-block], sign-extended from the file's int8.
    const auto pair_scales = [&](int p) {
      const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a_blk + 16 + 16 * p));
      const __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b_blk + 16 + 16 * p));
      return _mm512_cvtepi8_epi16(_mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1));
    };
    alignas(64) __m512i sums_store[kTokens];
    __m512i* sums = in_memory_past_4<kTokens>(sums_store);
#pragma GCC unroll 8
    for (int t = 0; t < kTokens; ++t) sums[t] = _mm512_setzero_si512();
    const int32_t* xb = xw + b * (kQK / 4) * kTokens;
    const int32_t* offsets = x.offsets16 + b * 16;
#pragma GCC unroll 1
    for (int p = 0; p < 8; ++p) {
      constexpr int64_t kStretch = kQ6GroupBlockBytes / 8;
      prefetch_next_pair<kTokens, kQ6GroupBlockBytes, kStretch>(a_blk + kStretch * p, b_blk + kStretch * p);
      const __m512i pair = pair_scales(p);
      const __m512i sc_even = _mm512_srai_epi32(_mm512_slli_epi32(pair, 16), 16), sc_odd = _mm512_srai_epi32(pair, 16);
      __m512i w[8];
      q6_codes_pair(a_blk + 144 + 192 * p, b_blk + 144 + 192 * p, w);
      q6_codes_pair(a_blk + 144 + 192 * p + 96, b_blk + 144 + 192 * p + 96, w + 4);
      const int32_t* xp = xb + 8 * kTokens * p;
#pragma GCC unroll 8
      for (int t = 0; t < kTokens; ++t) {
        // The codes are q + 32: each sub-block's chain starts from the offset's -32 sum q_x,
        // so sc (q + 32 - 32) . x is one vpmulld a sub-block (the AVX2 kernel's sum, as integers).
        const int32_t* offset = offsets + t * x_stride * 16 + 2 * p;
        __m512i even = _mm512_set1_epi32(offset[0]), odd = _mm512_set1_epi32(offset[1]);
#pragma GCC unroll 4
        for (int k = 0; k < 4; ++k) {
          even = _mm512_dpbusd_epi32(even, w[k], _mm512_set1_epi32(xp[k * kTokens + t]));
          odd = _mm512_dpbusd_epi32(odd, w[4 + k], _mm512_set1_epi32(xp[(4 + k) * kTokens + t]));
        }
        sums[t] = _mm512_add_epi32(sums[t], _mm512_add_epi32(_mm512_mullo_epi32(even, sc_even),
                                                             _mm512_mullo_epi32(odd, sc_odd)));
      }
    }
    add_super_block_pair<kTokens>(halves_pair(a_blk, b_blk), x, x_stride, b, sums, acc);
  }
  store_pair<kTokens>(acc, out_a, out_b);
}

// dot_q4_1_x8 for groups a and b, on the Q8_0 activations.
template <int kTokens>
inline void dot_q4_1_x16(const uint8_t* group_a, const uint8_t* group_b, const Act32& x, int64_t x_stride,
                         const int32_t* xw, float* out_a, float* out_b) {
  const __m512i low4 = _mm512_set1_epi8(0x0f);
  alignas(64) __m512 acc_store[kTokens];
  __m512* acc = in_memory_past_4<kTokens>(acc_store);
#pragma GCC unroll 8
  for (int t = 0; t < kTokens; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < x.num_blocks; ++b) {
    const uint8_t* a_blk = group_a + b * kQ4_1GroupBlockBytes;
    const uint8_t* b_blk = group_b + b * kQ4_1GroupBlockBytes;
    prefetch_next_pair<kTokens, 4 * kQ4_1GroupBlockBytes, kQ4_1GroupBlockBytes>(a_blk, b_blk);
    const int32_t* xb = xw + b * (kQ32 / 4) * kTokens;
    __m512i s32[kTokens];
#pragma GCC unroll 8
    for (int t = 0; t < kTokens; ++t) s32[t] = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int k = 0; k < 4; ++k) {  // load k: its low nibbles meet word k, its high ones word 4 + k
      const __m512i bits = load_pair(a_blk + 32 + 32 * k, b_blk + 32 + 32 * k);
      const __m512i w_lo = _mm512_and_si512(bits, low4), w_hi = _mm512_and_si512(_mm512_srli_epi16(bits, 4), low4);
#pragma GCC unroll 8
      for (int t = 0; t < kTokens; ++t) {
        s32[t] = _mm512_dpbusd_epi32(s32[t], w_lo, _mm512_set1_epi32(xb[k * kTokens + t]));
        s32[t] = _mm512_dpbusd_epi32(s32[t], w_hi, _mm512_set1_epi32(xb[(4 + k) * kTokens + t]));
      }
    }
    const __m512 d = halves_pair(a_blk, b_blk), m = halves_pair(a_blk + 16, b_blk + 16);
#pragma GCC unroll 8
    for (int t = 0; t < kTokens; ++t) {
      acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(x.d[t * x_stride + b])), _mm512_cvtepi32_ps(s32[t]),
                               acc[t]);
      acc[t] = _mm512_fmadd_ps(m, _mm512_set1_ps(x.ds[t * x_stride + b]), acc[t]);
    }
  }
  store_pair<kTokens>(acc, out_a, out_b);
}

}  // namespace tokenloom_gguf

#endif  // TL_GGUF_VNNI
