// A matmul call's activations for the GGUF kernels (gguf_linear.cpp): each token's inputs
// quantized to int8 once per call, as llama.cpp's Q8_K (one scale per 256 inputs, with the
// sums per 16 and 32 the K-quants' mins need) and Q8_0 (per 32, with d * sum for Q4_1's m),
// then, for the grouped types, interleaved by 4-byte words so that a group kernel's
// broadcasts read one pointer plus a constant (gguf_dot_x8.h says why). Included by
// gguf_linear.cpp only: its helpers are in an anonymous namespace.
#pragma once

#include "gguf_dot_x8.h"  // kGroupTokens, the tiles interleave_token lays out
#include "share_out.h"  // from engine/cpu/csrc/, copied beside this file for the build

#include <torch/types.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace tokenloom_gguf {
namespace {

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// 32 inputs at x -> int8 round(x * inv) at q (nearest even, as MXCSR rounds); returns sum q,
// and the first 16's sum at `half`.
template <typename in_t>
inline int32_t quantize32(const in_t* x, float inv, int8_t* q, int32_t* half) {
  const __m256 s = _mm256_set1_ps(inv);
  __m256i i[4];
#pragma GCC unroll 4
  for (int k = 0; k < 4; ++k) i[k] = _mm256_cvtps_epi32(_mm256_mul_ps(load8(x + 8 * k), s));
  // packs interleave the 128-bit halves; the permute puts the 32 bytes back in order.
  const __m256i bytes = _mm256_permutevar8x32_epi32(
      _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3])),
      _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), bytes);
  const __m256i first = _mm256_add_epi32(i[0], i[1]), second = _mm256_add_epi32(i[2], i[3]);
  __m128i s4 = _mm_hadd_epi32(_mm_add_epi32(_mm256_castsi256_si128(first), _mm256_extracti128_si256(first, 1)),
                              _mm_add_epi32(_mm256_castsi256_si128(second), _mm256_extracti128_si256(second, 1)));
  s4 = _mm_hadd_epi32(s4, s4);  // [first's sum, second's sum, ...]
  *half = _mm_cvtsi128_si32(s4);
  return *half + _mm_extract_epi32(s4, 1);
}

template <typename in_t>
inline float max_abs(const in_t* x, int64_t n) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 m = _mm256_setzero_ps();
  for (int64_t k = 0; k < n; k += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, load8(x + k)));
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
}

#if TL_GGUF_VNNI
// The same quantizing on 512-bit vectors, where the group kernels run on AVX512: a prompt's
// calls quantize every token's inputs, and on 256-bit vectors, with the 16-input sums added
// one by one, that showed beside its matmuls (docs/cpu-kernels.md). The same products,
// roundings and integer sums as quantize32 and max_abs, so the same bytes.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// 16 inputs at x -> int8 round(x * inv) at q; returns sum q.
template <typename in_t>
inline int32_t quantize16(const in_t* x, __m512 inv, int8_t* q) {
  const __m512i i = _mm512_cvtps_epi32(_mm512_mul_ps(load16(x), inv));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtsepi32_epi8(i));
  return _mm512_reduce_add_epi32(i);
}

template <typename in_t>
inline float max_abs16(const in_t* x, int64_t n) {
  __m512 m = _mm512_setzero_ps();
  for (int64_t k = 0; k < n; k += 16) m = _mm512_max_ps(m, _mm512_abs_ps(load16(x + k)));
  return _mm512_reduce_max_ps(m);
}
#endif

// One token's inputs in blocks of `block` (32 or 256): scale max|x| / 127 per block and q;
// per 32 inputs the sum of q, which the K-quants keep as int16 per 16 and 32 (and per 16 as
// Q6_K's offset, -32 * sum, in int32) and the others as dx * sum.
template <typename in_t>
void quantize_token(const in_t* x, int64_t in_features, int64_t block, int8_t* q, float* d, int16_t* sums16,
                    int16_t* sums32, int32_t* offsets16, float* ds) {
  for (int64_t b = 0; b < in_features / block; ++b) {
#if TL_GGUF_VNNI
    const float amax = max_abs16(x + b * block, block);
#else
    const float amax = max_abs(x + b * block, block);
#endif
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    d[b] = amax / 127.f;
    for (int64_t k = b * block; k < (b + 1) * block; k += kQ32) {
#if TL_GGUF_VNNI
      const __m512 inv16 = _mm512_set1_ps(inv);
      const int32_t half = quantize16(x + k, inv16, q + k);
      const int32_t sum = half + quantize16(x + k + 16, inv16, q + k + 16);
#else
      int32_t half;
      const int32_t sum = quantize32(x + k, inv, q + k, &half);
#endif
      if (block == kQK) {
        sums16[k / 16] = static_cast<int16_t>(half);
        sums16[k / 16 + 1] = static_cast<int16_t>(sum - half);
        sums32[k / kQ32] = static_cast<int16_t>(sum);
        offsets16[k / 16] = -32 * half, offsets16[k / 16 + 1] = -32 * (sum - half);
      } else {
        ds[b] = d[b] * static_cast<float>(sum);
      }
    }
  }
}

// A call's quantized activations, in memory the calling thread keeps from call to call.
struct Scratch {
  std::vector<int32_t> qk_words;  // qk for the Q4_K groups: tokens interleaved by words (interleave_token)
  std::vector<int32_t> q32_words;  // q32 for the Q4_1 groups, alike
  std::vector<int8_t> qk, q32;
  std::vector<float> dk, d32, ds32;
  std::vector<int16_t> sums16, sums32;
  std::vector<int32_t> offsets16;
};

// The Q4_K groups' activations (gguf_dot_x8.h): q [tokens][in] as 4-byte words, each tile of
// kGroupTokens tokens from t0 with its n tokens interleaved: word w of token t0 + i at
// words[t0 * in / 4 + w * n + i]. One token's words, so the threads that quantize the tokens
// lay them out too (one thread laying out a prompt's took longer).
void interleave_token(const int8_t* row, int64_t t, int64_t num_tokens, int64_t in_features, int32_t* words) {
  const int64_t num_words = in_features / 4;
  const int64_t t0 = t - t % kGroupTokens, n = std::min(kGroupTokens, num_tokens - t0);
  int32_t* out = words + t0 * num_words + (t - t0);
  for (int64_t w = 0; w < num_words; ++w) std::memcpy(out + w * n, row + 4 * w, 4);
}

template <typename in_t>
void quantize_all(const in_t* x, int64_t num_tokens, int64_t in_features, bool need_k, bool need_32,
                  bool need_words, bool need_words32, Scratch& s) {
  if (need_k) {
    s.qk.resize(num_tokens * in_features), s.dk.resize(num_tokens * in_features / kQK);
    s.sums16.resize(num_tokens * in_features / 16), s.sums32.resize(num_tokens * in_features / kQ32);
    s.offsets16.resize(num_tokens * in_features / 16);
  }
  if (need_32) {
    s.q32.resize(num_tokens * in_features);
    s.d32.resize(num_tokens * in_features / kQ32), s.ds32.resize(num_tokens * in_features / kQ32);
  }
  if (need_words) s.qk_words.resize(num_tokens * in_features / 4);
  if (need_words32) s.q32_words.resize(num_tokens * in_features / 4);
  tokenloom_cpu::parallel_for(0, num_tokens, 4, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const in_t* xt = x + t * in_features;
      if (need_k) {
        int8_t* q = s.qk.data() + t * in_features;
        quantize_token(xt, in_features, kQK, q, s.dk.data() + t * in_features / kQK,
                       s.sums16.data() + t * in_features / 16, s.sums32.data() + t * in_features / kQ32,
                       s.offsets16.data() + t * in_features / 16, nullptr);
        if (need_words) interleave_token(q, t, num_tokens, in_features, s.qk_words.data());
      }
      if (need_32) {
        int8_t* q = s.q32.data() + t * in_features;
        quantize_token(xt, in_features, kQ32, q, s.d32.data() + t * in_features / kQ32, nullptr, nullptr, nullptr,
                       s.ds32.data() + t * in_features / kQ32);
        if (need_words32) interleave_token(q, t, num_tokens, in_features, s.q32_words.data());
      }
    }
  });
}

}  // namespace
}  // namespace tokenloom_gguf
