// The bf16 tile steps of attention_tiles.h, for CPUs with AVX512_BF16: keys,
// values and probabilities packed in 32-bit pairs so that one vdpbf16ps adds two products
// for 16 lanes. Included by that file only, inside its anonymous namespace (it uses its
// Shape and kRowChunk).
#pragma once

#if defined(__AVX512BF16__) && defined(CPU_CAPABILITY_AVX512)
constexpr bool kHasBf16Dot = true;
template <int kRows>
void score_rows_bf16(const uint32_t* q_pairs, const uint32_t* k_pairs, int64_t t0, const Shape& s, float* raw) {
  const int64_t num_pairs = s.head_dim / 2;
  __m512 acc[kRows];
#pragma GCC unroll 8
  for (int r = 0; r < kRows; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t p = 0; p < num_pairs; ++p) {
    const __m512bh k = (__m512bh)_mm512_loadu_si512(k_pairs + p * s.block_size + t0);
#pragma GCC unroll 8
    for (int r = 0; r < kRows; ++r) {
      acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_set1_epi32(q_pairs[r * num_pairs + p]), k);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < kRows; ++r) _mm512_storeu_ps(raw + r * s.block_size + t0, acc[r]);
}

using ScoreRowsBf16Fn = void (*)(const uint32_t*, const uint32_t*, int64_t, const Shape&, float*);
constexpr ScoreRowsBf16Fn kScoreRowsBf16[kRowChunk] = {
    score_rows_bf16<1>, score_rows_bf16<2>, score_rows_bf16<3>, score_rows_bf16<4>,
    score_rows_bf16<5>, score_rows_bf16<6>, score_rows_bf16<7>, score_rows_bf16<8>};

// The same from bf16 pairs: k_pairs[p * block_size + t] holds elements 2p, 2p+1 of token t's
// key, q_pairs[r * head_dim / 2 + p] those of row r's query; one vdpbf16ps adds both
// products for 16 tokens. Needs block_size % 16 == 0. Scores come out unscaled.
void score_block_bf16(const uint32_t* q_pairs, const uint32_t* k_pairs, int64_t num_rows, const Shape& s,
                      float* raw) {
  const int64_t num_pairs = s.head_dim / 2;
  for (int64_t t0 = 0; t0 < s.block_size; t0 += 16) {
    for (int64_t r0 = 0; r0 < num_rows; r0 += kRowChunk) {
      const int64_t rows = std::min<int64_t>(kRowChunk, num_rows - r0);
      kScoreRowsBf16[rows - 1](q_pairs + r0 * num_pairs, k_pairs, t0, s, raw + r0 * s.block_size);
    }
  }
}

// out[j] = column j of the 16 x 16 matrix of 32-bit words whose rows are a[0..15]: 32-bit,
// then 64-bit interleaves within 128-bit lanes, then two rounds of lane shuffles.
inline void transpose_16x16(const __m512i* a, __m512i* out) {
  __m512i t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(a[2 * i], a[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(a[2 * i], a[2 * i + 1]);
  }
  // u[4k + c], lane L: column 4L + c of rows 4k..4k+3.
  for (int k = 0; k < 4; ++k) {
    u[4 * k] = _mm512_unpacklo_epi64(t[4 * k], t[4 * k + 2]);
    u[4 * k + 1] = _mm512_unpackhi_epi64(t[4 * k], t[4 * k + 2]);
    u[4 * k + 2] = _mm512_unpacklo_epi64(t[4 * k + 1], t[4 * k + 3]);
    u[4 * k + 3] = _mm512_unpackhi_epi64(t[4 * k + 1], t[4 * k + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512i v0 = _mm512_shuffle_i32x4(u[c], u[4 + c], _MM_SHUFFLE(2, 0, 2, 0));
    const __m512i v1 = _mm512_shuffle_i32x4(u[c], u[4 + c], _MM_SHUFFLE(3, 1, 3, 1));
    const __m512i w0 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], _MM_SHUFFLE(2, 0, 2, 0));
    const __m512i w1 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], _MM_SHUFFLE(3, 1, 3, 1));
    out[c] = _mm512_shuffle_i32x4(v0, w0, _MM_SHUFFLE(2, 0, 2, 0));
    out[8 + c] = _mm512_shuffle_i32x4(v0, w0, _MM_SHUFFLE(3, 1, 3, 1));
    out[4 + c] = _mm512_shuffle_i32x4(v1, w1, _MM_SHUFFLE(2, 0, 2, 0));
    out[12 + c] = _mm512_shuffle_i32x4(v1, w1, _MM_SHUFFLE(3, 1, 3, 1));
  }
}

// k_pairs[p * stride + t] = the 32-bit pair p of token t's key: the block transposed 16
// tokens by 16 pairs at a time in registers (stride: the width of the tile of blocks it is
// packed into). Gathers did the same at a quarter of the speed, a third of the kernel's time.
// Needs head_dim % 32 == 0 and block_size % 16 == 0.
inline void pack_key_pairs(const at::BFloat16* kb, const Shape& s, int64_t stride, uint32_t* k_pairs) {
  const int64_t num_pairs = s.head_dim / 2;
  const uint32_t* words = reinterpret_cast<const uint32_t*>(kb);
  __m512i rows[16], columns[16];
  for (int64_t t0 = 0; t0 < s.block_size; t0 += 16) {
    for (int64_t p0 = 0; p0 < num_pairs; p0 += 16) {
      for (int r = 0; r < 16; ++r) rows[r] = _mm512_loadu_si512(words + (t0 + r) * num_pairs + p0);
      transpose_16x16(rows, columns);
      for (int j = 0; j < 16; ++j) _mm512_storeu_si512(k_pairs + (p0 + j) * stride + t0, columns[j]);
    }
  }
}

// v_pairs[tp * head_dim + d] = (v[2tp][d], v[2tp+1][d]): two tokens' values side by side,
// so one vdpbf16ps adds both tokens' weighted values for 16 dimensions.
inline void pack_value_pairs(const at::BFloat16* vb, int64_t num_tokens, const Shape& s, uint32_t* v_pairs) {
  // Interleaves the 16-bit elements of two 32-element rows: lo takes elements 0..15, hi 16..31.
  const __m512i lo = _mm512_setr_epi32(0x00200000, 0x00210001, 0x00220002, 0x00230003, 0x00240004, 0x00250005,
                                       0x00260006, 0x00270007, 0x00280008, 0x00290009, 0x002a000a, 0x002b000b,
                                       0x002c000c, 0x002d000d, 0x002e000e, 0x002f000f);
  const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  for (int64_t tp = 0; tp < (num_tokens + 1) / 2; ++tp) {
    const at::BFloat16* even = vb + 2 * tp * s.head_dim;
    const at::BFloat16* odd = even + s.head_dim;
    // An odd count's last pair takes zeros, not the next slot: a stale slot is weighted by a
    // zero probability, and 0 * inf would still be NaN.
    const bool has_odd = 2 * tp + 1 < num_tokens;
    for (int64_t d0 = 0; d0 < s.head_dim; d0 += 32) {
      const __m512i a = _mm512_loadu_si512(even + d0);
      const __m512i b = has_odd ? _mm512_loadu_si512(odd + d0) : _mm512_setzero_si512();
      _mm512_storeu_si512(v_pairs + tp * s.head_dim + d0, _mm512_permutex2var_epi16(a, lo, b));
      _mm512_storeu_si512(v_pairs + tp * s.head_dim + d0 + 16, _mm512_permutex2var_epi16(a, hi, b));
    }
  }
}

// p_pairs[r * block_size / 2 + tp] = row r's probabilities of tokens 2tp, 2tp+1, rounded to bf16.
inline void pack_prob_pairs(const float* p, int64_t num_rows, const Shape& s, uint32_t* p_pairs) {
  for (int64_t r = 0; r < num_rows; ++r) {
    for (int64_t t0 = 0; t0 < s.block_size; t0 += 16) {
      const __m256bh packed = _mm512_cvtneps_pbh(_mm512_loadu_ps(p + r * s.block_size + t0));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p_pairs + r * s.block_size / 2 + t0 / 2), (__m256i)packed);
    }
  }
}

// weigh_rows with bf16 probabilities and values: two tokens per vdpbf16ps.
template <int kRows, int kVecs>
void weigh_rows_bf16(const uint32_t* p_pairs, const uint32_t* v_pairs, int64_t num_token_pairs, const float* corr,
                     const Shape& s, float* o) {
  __m512 acc[kRows][kVecs];
#pragma GCC unroll 4
  for (int r = 0; r < kRows; ++r) {
#pragma GCC unroll 4
    for (int c = 0; c < kVecs; ++c) {
      acc[r][c] = _mm512_mul_ps(_mm512_loadu_ps(o + r * s.head_dim + c * 16), _mm512_set1_ps(corr[r]));
    }
  }
  for (int64_t tp = 0; tp < num_token_pairs; ++tp) {
    __m512bh vt[kVecs];
#pragma GCC unroll 4
    for (int c = 0; c < kVecs; ++c) vt[c] = (__m512bh)_mm512_loadu_si512(v_pairs + tp * s.head_dim + c * 16);
#pragma GCC unroll 4
    for (int r = 0; r < kRows; ++r) {
      const __m512bh pr = (__m512bh)_mm512_set1_epi32(p_pairs[r * s.block_size / 2 + tp]);
#pragma GCC unroll 4
      for (int c = 0; c < kVecs; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], pr, vt[c]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < kRows; ++r) {
#pragma GCC unroll 4
    for (int c = 0; c < kVecs; ++c) _mm512_storeu_ps(o + r * s.head_dim + c * 16, acc[r][c]);
  }
}

using WeighRowsBf16Fn = void (*)(const uint32_t*, const uint32_t*, int64_t, const float*, const Shape&, float*);
template <int kRows>
constexpr WeighRowsBf16Fn weigh_rows_bf16_for(int vecs) {
  return vecs == 1 ? weigh_rows_bf16<kRows, 1> : vecs == 2 ? weigh_rows_bf16<kRows, 2>
       : vecs == 3 ? weigh_rows_bf16<kRows, 3> : weigh_rows_bf16<kRows, 4>;
}

// Needs head_dim % 16 == 0 and block_size % 16 == 0.
void weigh_block_bf16(const uint32_t* p_pairs, const uint32_t* v_pairs, int64_t num_tokens, const float* corr,
                      int64_t num_rows, const Shape& s, float* o) {
  const int64_t num_token_pairs = (num_tokens + 1) / 2;  // an odd last token pairs with a 0 probability
  for (int64_t r0 = 0; r0 < num_rows; r0 += 4) {
    const int64_t rows = std::min<int64_t>(4, num_rows - r0);
    for (int64_t d0 = 0; d0 < s.head_dim; d0 += 64) {
      const int vecs = std::min<int64_t>(4, (s.head_dim - d0) / 16);
      const WeighRowsBf16Fn fn = rows == 1 ? weigh_rows_bf16_for<1>(vecs) : rows == 2 ? weigh_rows_bf16_for<2>(vecs)
                               : rows == 3 ? weigh_rows_bf16_for<3>(vecs) : weigh_rows_bf16_for<4>(vecs);
      fn(p_pairs + r0 * s.block_size / 2, v_pairs + d0, num_token_pairs, corr + r0, s, o + r0 * s.head_dim + d0);
    }
  }
}
#else
constexpr bool kHasBf16Dot = false;
#endif
