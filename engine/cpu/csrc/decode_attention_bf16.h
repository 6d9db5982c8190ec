// The passes of paged_decode_attention.cpp's tasks on a bf16 cache, for CPUs with AVX512_BF16:
// scores by the bf16 dot product (vdpbf16ps: 32 products a K row chunk, summed in fp32),
// probabilities in two bf16 parts, and the weighted V rows two tokens per vdpbf16ps. Included
// there only, inside its anonymous namespace, after decode_attention_passes.h (the block walk).
//
// The V pass pairs tokens as the prefill tiles do (prefill_bf16_tiles.h): two tokens' values
// interleaved into 32-bit pairs, weighted by their two probabilities in one instruction, where
// the fp32 pass converted each value to fp32 and took one FMA per token. The pairs are made in
// registers (no packed copy of the block), so the sums' lanes come out in the interleave's order
// and are put back in dimension order once, at the task's end. Each probability goes in as two
// bf16 parts, its rounding and the rest (p = hi + lo to about 16 bits), two vdpbf16ps a pair:
// probabilities rounded to bf16 alone moved --quantization int8's greedy answers (bf16 KV) off
// fp32's past tests/models/test_int8_fidelity.py's bound.
#pragma once

#if defined(__AVX512BF16__) && defined(CPU_CAPABILITY_AVX512)
#include <cstring>

constexpr bool kHasBf16Dot = true;

// The 16 horizontal sums of v[0..15] in one vector (lane t = the sum of v[t]'s lanes): pairs
// interleaved and added within 128-bit lanes, then quads, then the 128-bit lanes across.
// 45 instructions for 16 sums, against about 8 for each sum done alone.
inline __m512 sum_each_of_16(const __m512* v) {
  __m512 pairs[8], quads[4];
  for (int i = 0; i < 8; ++i) {
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  }
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(pairs[2 * i]), b = _mm512_castps_pd(pairs[2 * i + 1]);
    quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  // quads[m] lane 4k + j: v[4m + j]'s sum over 128-bit lane k. Sum over k into lane 4m + j.
  const __m512 z0 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm512_shuffle_f32x4(quads[0], quads[1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 z1 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm512_shuffle_f32x4(quads[2], quads[3], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(z0, z1, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(z0, z1, _MM_SHUFFLE(3, 1, 3, 1)));
}

// Part `part` of `num_parts` of a block's lines, prefetched into L2: the bf16 passes spread a
// block's prefetches over their work on the block before it, a few lines at a time, rather
// than all 32 lines of a 2 KB block at once (which left the loop waiting for memory).
inline void prefetch_part(const char* block, int64_t block_bytes, int64_t part, int64_t num_parts) {
  if (block == nullptr) return;
  const int64_t num_lines = block_bytes / 64;
  const int64_t begin = part * num_lines / num_parts, end = (part + 1) * num_lines / num_parts;
  for (int64_t line = begin; line < end; ++line) __builtin_prefetch(block + line * 64, 0, 2);
}

// bf16 scores with the CPU's bf16 dot-product instruction: 32 products of a K row with
// the (unscaled, still bf16) query per instruction, summed in fp32, with no conversion
// of K to fp32 first. Sixteen rows' dot vectors are reduced together (sum_each_of_16);
// a block's last few rows one by one. The scale is applied to each fp32 sum.
template <int kGroup>
void score_rows_bf16(const at::BFloat16* query, float scale, const at::BFloat16* k_cache, const int32_t* block_table,
                     int64_t seq_len, const TaskShape& s, float* scores) {
  const int64_t num_chunks = s.head_dim / 32;
  const int64_t n = num_keys(seq_len, s);
  const int64_t block_bytes = s.block_size * s.head_dim * 2;
  const int64_t num_parts = kGroup * ((s.block_size + 15) / 16);  // the full 16-row steps' group heads
  auto score = [&](const at::BFloat16* block, int64_t start, int64_t num_tokens, const char* ahead) {
    int64_t t = 0, part = 0;
    if (num_tokens < 16) prefetch_part(ahead, block_bytes, 0, 1);  // no 16-row step to spread them over
    for (; t + 16 <= num_tokens; t += 16) {
      for (int g = 0; g < kGroup; ++g) {
        prefetch_part(ahead, block_bytes, part++, num_parts);
        const at::BFloat16* q = query + g * s.head_dim;
        __m512 dots[16];
        for (int i = 0; i < 16; ++i) dots[i] = _mm512_setzero_ps();
        for (int64_t c = 0; c < num_chunks; ++c) {
          const __m512bh qc = (__m512bh)_mm512_loadu_si512(q + c * 32);
          for (int i = 0; i < 16; ++i) {
            dots[i] = _mm512_dpbf16_ps(dots[i], qc, (__m512bh)_mm512_loadu_si512(block + (t + i) * s.head_dim + c * 32));
          }
        }
        _mm512_storeu_ps(scores + g * n + start + t, _mm512_mul_ps(sum_each_of_16(dots), _mm512_set1_ps(scale)));
      }
    }
    for (; t < num_tokens; ++t) {
      const at::BFloat16* k = block + t * s.head_dim;
      __m512 dots[kGroup];
      for (int g = 0; g < kGroup; ++g) dots[g] = _mm512_setzero_ps();
      for (int64_t c = 0; c < num_chunks; ++c) {
        const __m512bh kc = (__m512bh)_mm512_loadu_si512(k + c * 32);
        for (int g = 0; g < kGroup; ++g) {
          const __m512bh qc = (__m512bh)_mm512_loadu_si512(query + g * s.head_dim + c * 32);
          dots[g] = _mm512_dpbf16_ps(dots[g], qc, kc);
        }
      }
      for (int g = 0; g < kGroup; ++g) scores[g * n + start + t] = _mm512_reduce_add_ps(dots[g]) * scale;
    }
    if (num_tokens >= 16) {
      while (part < num_parts) prefetch_part(ahead, block_bytes, part++, num_parts);  // a short block: the rest
    }
  };
  for_each_block<at::BFloat16, true>(k_cache, block_table, seq_len, s, score);
}

// The exponentials exp_rows leaves in e[0 .. num_values) as two bf16 parts: hi = e rounded to
// bf16 (to nearest even, as vcvtneps2bf16 does) and lo = the rest, e - hi, rounded.
void split_bf16(const float* e, int64_t num_values, uint16_t* hi, uint16_t* lo) {
  int64_t i = 0;
  for (; i + 16 <= num_values; i += 16) {
    const __m512 x = _mm512_loadu_ps(e + i);
    const __m256i x_hi = (__m256i)_mm512_cvtneps_pbh(x);
    const __m512 rest = _mm512_sub_ps(x, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(x_hi), 16)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi + i), x_hi);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo + i), (__m256i)_mm512_cvtneps_pbh(rest));
  }
  for (; i < num_values; ++i) {
    const c10::BFloat16 x_hi(e[i]);  // round to nearest even
    hi[i] = x_hi.x;
    lo[i] = c10::BFloat16(e[i] - static_cast<float>(x_hi)).x;
  }
}

// Lanes of the unpacklo / unpackhi sums of a 32-dimension chunk, in dimension order: the first
// 16 dimensions, then the last 16 (lane i of the lo sums holds dimension 8 * (i / 4) + i % 4,
// of the hi sums that + 4).
inline __m512i pair_order_first() { return _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23); }
inline __m512i pair_order_second() {
  return _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
}

// acc[r * head_dim + d0 + j] for rows r < kRows and j < 32 * kChunks: the sum over the
// window's keys i of (hi + lo)[r * n + i] * v[first_pos + i][d0 + j] (n: the task's keys), two
// tokens per vdpbf16ps and part, with the sums in registers across the whole walk.
template <int kRows, int kChunks>
void weigh_pairs(const uint16_t* hi, const uint16_t* lo, int64_t n, const at::BFloat16* v_cache,
                 const int32_t* block_table, int64_t seq_len, const TaskShape& s, int64_t d0, float* acc) {
  __m512 sums[kRows][2 * kChunks];  // [row][2 * chunk + (its unpacklo, its unpackhi)]
  for (int r = 0; r < kRows; ++r) {
    for (int c = 0; c < 2 * kChunks; ++c) sums[r][c] = _mm512_setzero_ps();
  }
  auto add_pair = [&](const at::BFloat16* even, const at::BFloat16* odd, const uint32_t* hi_pairs,
                      const uint32_t* lo_pairs) {
    __m512i pairs[2 * kChunks];
    for (int c = 0; c < kChunks; ++c) {
      const __m512i a = _mm512_loadu_si512(even + d0 + 32 * c);
      // An odd count's last token pairs with zeros, not the next slot: 0 * a stale inf is NaN.
      const __m512i b = odd ? _mm512_loadu_si512(odd + d0 + 32 * c) : _mm512_setzero_si512();
      pairs[2 * c] = _mm512_unpacklo_epi16(a, b);
      pairs[2 * c + 1] = _mm512_unpackhi_epi16(a, b);
    }
    for (int r = 0; r < kRows; ++r) {
      const __m512bh w_hi = (__m512bh)_mm512_set1_epi32(hi_pairs[r]), w_lo = (__m512bh)_mm512_set1_epi32(lo_pairs[r]);
      for (int c = 0; c < 2 * kChunks; ++c) {
        sums[r][c] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(sums[r][c], w_lo, (__m512bh)pairs[c]), w_hi, (__m512bh)pairs[c]);
      }
    }
  };
  const int64_t block_bytes = s.block_size * s.head_dim * 2;
  const int64_t num_parts = (s.block_size + 1) / 2;  // a full block's token pairs
  auto weigh = [&](const at::BFloat16* block, int64_t start, int64_t num_tokens, const char* ahead) {
    uint32_t hi_pairs[kRows], lo_pairs[kRows];
    int64_t t = 0;
    for (; t + 2 <= num_tokens; t += 2) {
      prefetch_part(ahead, block_bytes, t / 2, num_parts);
      for (int r = 0; r < kRows; ++r) {  // tokens t, t + 1
        std::memcpy(&hi_pairs[r], hi + r * n + start + t, 4);
        std::memcpy(&lo_pairs[r], lo + r * n + start + t, 4);
      }
      add_pair(block + t * s.head_dim, block + (t + 1) * s.head_dim, hi_pairs, lo_pairs);
    }
    for (int64_t part = t / 2; part < num_parts; ++part) prefetch_part(ahead, block_bytes, part, num_parts);
    if (t < num_tokens) {
      for (int r = 0; r < kRows; ++r) {  // with a 0 probability beside it
        hi_pairs[r] = hi[r * n + start + t];
        lo_pairs[r] = lo[r * n + start + t];
      }
      add_pair(block + t * s.head_dim, nullptr, hi_pairs, lo_pairs);
    }
  };
  for_each_block<at::BFloat16, true>(v_cache, block_table, seq_len, s, weigh);
  for (int r = 0; r < kRows; ++r) {
    for (int c = 0; c < kChunks; ++c) {
      float* out = acc + r * s.head_dim + d0 + 32 * c;
      _mm512_storeu_ps(out, _mm512_permutex2var_ps(sums[r][2 * c], pair_order_first(), sums[r][2 * c + 1]));
      _mm512_storeu_ps(out + 16, _mm512_permutex2var_ps(sums[r][2 * c], pair_order_second(), sums[r][2 * c + 1]));
    }
  }
}

using WeighPairsFn = void (*)(const uint16_t*, const uint16_t*, int64_t, const at::BFloat16*, const int32_t*, int64_t,
                              const TaskShape&, int64_t, float*);
// [rows - 1][chunks - 1]: up to 4 rows by 64 dimensions (16 sums, 4 pairs and a weight in registers).
constexpr WeighPairsFn kWeighPairs[4][2] = {{weigh_pairs<1, 1>, weigh_pairs<1, 2>}, {weigh_pairs<2, 1>, weigh_pairs<2, 2>},
                                            {weigh_pairs<3, 1>, weigh_pairs<3, 2>}, {weigh_pairs<4, 1>, weigh_pairs<4, 2>}};

// acc[g] = sum over the window's keys i of (hi + lo)[g * num_keys + i] * v[first_pos + i], for
// head_dim % 32 == 0: the group by up to 4 heads, the head by up to 64 dimensions, each part a
// walk over the task's V blocks (a part after the first reads them from the core's cache).
void weigh_rows_bf16(const uint16_t* hi, const uint16_t* lo, const at::BFloat16* v_cache, const int32_t* block_table,
                     int64_t seq_len, const TaskShape& s, float* acc) {
  const int64_t n = num_keys(seq_len, s);
  for (int64_t g0 = 0; g0 < s.group; g0 += 4) {
    const int64_t rows = std::min<int64_t>(4, s.group - g0);
    for (int64_t d0 = 0; d0 < s.head_dim; d0 += 64) {
      const int64_t chunks = std::min<int64_t>(2, (s.head_dim - d0) / 32);
      kWeighPairs[rows - 1][chunks - 1](hi + g0 * n, lo + g0 * n, n, v_cache, block_table, seq_len, s, d0,
                                        acc + g0 * s.head_dim);
    }
  }
}
#else
constexpr bool kHasBf16Dot = false;
#endif
