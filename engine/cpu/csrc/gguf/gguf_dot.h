// Dot products of one GGUF weight row, in the file's own block bytes, with up to kMaxTokens
// tokens' 8-bit activations, on AVX2 (+ FMA, F16C). The layouts are llama.cpp's
// (ggml/src/ggml-common.h; gguf.quants' dequantize_blocks says the same in numpy):
//   Q4_0 (18 B / 32): fp16 d, 16 bytes of nibbles (low: inputs 0..15, high: 16..31); w = d (q - 8)
//   Q4_1 (20 B / 32): fp16 d, fp16 m, nibbles as Q4_0; w = d q + m
//   Q5_0 (22 B / 32): fp16 d, 32 bits qh (bit l: input l's fifth bit), nibbles as Q4_0; w = d (q - 16)
//   Q5_1 (24 B / 32): fp16 d, fp16 m, qh, nibbles; w = d q + m (a GGUF's fallback for rows
//     that are not whole 256-blocks, e.g. Gemma 3 270M's 640 inputs)
//   Q8_0 (34 B / 32): fp16 d, 32 int8 q; w = d q
//   Q4_K (144 B / 256): fp16 d, fp16 dmin, 12 bytes of eight 6-bit scales and mins, 128 bytes of
//     nibbles: chunk j of 32 bytes holds sub-block 2j in its low nibbles, 2j + 1 in its high;
//     w = d sc_s q - dmin m_s for sub-block s of 32 inputs
//   Q5_K (176 B / 256): as Q4_K, with 32 bytes qh before the nibbles: bit s of qh[l] is input
//     l of sub-block s's fifth bit (16)
//   Q6_K (210 B / 256): 128 bytes ql, 64 bytes qh, 16 int8 scales (one per 16 inputs), fp16 d;
//     half h of 128 inputs: inputs 32 k + l from ql[64 h + l (+32 for odd k)]'s low (k < 2) or
//     high nibble and qh[32 h + l]'s bits 2k, 2k + 1; w = d sc (q - 32)
//
// Activations are quantized as llama.cpp does for these types (gguf_linear.cpp): per 256
// inputs for the K-quants (Q8_K: one fp32 scale, int8 q, sums per 16 and per 32), per 32 for
// the others (Q8_0's scale, and scale * sum q for the minimum's and offset's terms). A
// K-quant super-block's sums stay in int32 (exact) and meet the fp32 scales once; every
// product is an unsigned code times a signed activation on vpmaddubsw, whose pair sums
// cannot saturate here (at most 2 * 63 * 127), then vpmaddwd with the sub-block's scale.
#pragma once

#include <immintrin.h>

#include <atomic>
#include <cstdint>
#include <cstring>

// Whether the build's -march=native has AVX512-VNNI: a call of several tokens then takes the
// grouped rows two groups at a time on 512-bit vpdpbusd (gguf_dot_x16.h), else AVX2's
// vpmaddubsw (gguf_dot_x8.h and its kin). Both sum the same integers exactly, so both give the
// same bits. TL_GGUF_AVX2_ONLY builds the AVX2 path alone on a VNNI CPU (the test that the two
// agree, and the benchmarks' side by side).
#if defined(__AVX512VNNI__) && defined(__AVX512VL__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && \
    !defined(TL_GGUF_AVX2_ONLY)
#define TL_GGUF_VNNI 1
#else
#define TL_GGUF_VNNI 0
#endif

namespace tokenloom_gguf {

constexpr int64_t kQK = 256;  // inputs per K-quant super-block and per Q8_K activation block
constexpr int64_t kQ32 = 32;  // inputs per Q4_0/Q4_1/Q8_0 block and per Q8_0 activation block
constexpr int kMaxTokens = 4;  // tokens per pass over a row: 4 fp32 and 4 int32 accumulators

// ggml's type ids (gguf.GGMLQuantizationType).
enum : int64_t { kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14 };

// Bytes per 32-input block of the 32-block types.
constexpr int64_t q32_block_bytes(int64_t type) {
  return type == kQ8_0 ? 34 : type == kQ4_1 ? 20 : type == kQ5_0 ? 22 : type == kQ5_1 ? 24 : 18;
}

// 32 bits -> 32 bytes, byte l 16 where bit l is set, else 0 (Q5_0/Q5_1's fifth bits).
inline __m256i fifth_bits(const uint8_t* p) {
  uint32_t bits;
  std::memcpy(&bits, p, 4);
  const __m256i spread = _mm256_shuffle_epi8(  // byte l takes the bits' byte l / 8
      _mm256_set1_epi32(static_cast<int>(bits)),
      _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ull));  // byte l: bit l % 8
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(16));
}

// Tokens' activations quantized per 256 inputs (Q8_K), token t's at t * row strides.
struct ActK {
  const int8_t* q;  // [tokens][num_blocks * 256]
  const float* d;  // [tokens][num_blocks]: the scale
  const int16_t* sums16;  // [tokens][num_blocks * 16]: sum of q per 16 inputs
  const int16_t* sums32;  // [tokens][num_blocks * 8]: per 32
  int64_t num_blocks;
  const int32_t* offsets16 = nullptr;  // [tokens][num_blocks * 16]: -32 * sums16, Q6_K's pairs' (gguf_dot_x16.h)
};

// ... per 32 inputs (Q8_0, with Q8_1's scaled sum).
struct Act32 {
  const int8_t* q;  // [tokens][num_blocks * 32]
  const float* d;  // [tokens][num_blocks]
  const float* ds;  // [tokens][num_blocks]: d * sum q
  int64_t num_blocks;
};

inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

inline __m256i load256(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }

// Software prefetch of the weights kPrefetchAhead bytes on, for calls of at most
// kPrefetchTokens tokens. On some hosts a one-token call reads its weights faster than the
// hardware prefetcher runs ahead of it: the kernel then waited on memory and computed in turn.
// On others the hardware keeps up and the software prefetches only slow one token down. So
// one token's are switched at run time (g_one_token_prefetch, chosen while decoding by
// engine/cpu/prefetch_tuner.py); docs/cpu-kernels.md has the figures. Several tokens are
// compute-bound, and the prefetches' own instructions only cost there. Rows and groups lie
// one after another, so a block's prefetch past its row's end is the next row's; a prefetch
// never faults.
constexpr int64_t kPrefetchAhead = 4608;  // 4.5 KB: the rows' (the groups spread theirs: prefetch_next_block)
constexpr int kPrefetchTokens = 3;
inline std::atomic<bool> g_one_token_prefetch{true};  // set_one_token_prefetch (gguf_linear.cpp)

// Whether a call of kTokens tokens prefetches its weights in software.
template <int kTokens>
inline bool prefetches() {
  return kTokens <= kPrefetchTokens && (kTokens > 1 || g_one_token_prefetch.load(std::memory_order_relaxed));
}

// The cache lines of [p + kPrefetchAhead, p + kPrefetchAhead + n).
template <int64_t n>
inline void prefetch_ahead(const uint8_t* p) {
#pragma GCC unroll 32
  for (int64_t k = 0; k < n; k += 64) _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetchAhead + k), _MM_HINT_T0);
}

// Byte patterns for vpshufb: every 16-bit lane takes lane `k` of its own 128-bit half
// (kPick[k]), or lane k of the low half and k + 1 of the high half (kPickPair[k / 2]).
alignas(32) inline const uint8_t kPick[8][32] = {
#define TL_PICK(k) {2 * k, 2 * k + 1, 2 * k, 2 * k + 1, 2 * k, 2 * k + 1, 2 * k, 2 * k + 1, 2 * k, 2 * k + 1, 2 * k, 2 * k + 1, \
                    2 * k, 2 * k + 1, 2 * k, 2 * k + 1, 2 * k, 2 * k + 1, 2 * k, 2 * k + 1, 2 * k, 2 * k + 1, 2 * k, 2 * k + 1, \
                    2 * k, 2 * k + 1, 2 * k, 2 * k + 1, 2 * k, 2 * k + 1, 2 * k, 2 * k + 1}
    TL_PICK(0), TL_PICK(1), TL_PICK(2), TL_PICK(3), TL_PICK(4), TL_PICK(5), TL_PICK(6), TL_PICK(7)};
#undef TL_PICK
alignas(32) inline const uint8_t kPickPair[4][32] = {
#define TL_PAIR(a, b) {2 * a, 2 * a + 1, 2 * a, 2 * a + 1, 2 * a, 2 * a + 1, 2 * a, 2 * a + 1, 2 * a, 2 * a + 1, 2 * a, 2 * a + 1, \
                       2 * a, 2 * a + 1, 2 * a, 2 * a + 1, 2 * b, 2 * b + 1, 2 * b, 2 * b + 1, 2 * b, 2 * b + 1, 2 * b, 2 * b + 1, \
                       2 * b, 2 * b + 1, 2 * b, 2 * b + 1, 2 * b, 2 * b + 1, 2 * b, 2 * b + 1}
    TL_PAIR(0, 1), TL_PAIR(2, 3), TL_PAIR(4, 5), TL_PAIR(6, 7)};
#undef TL_PAIR

inline __m256i pick(__m256i v, const uint8_t* pattern) {
  return _mm256_shuffle_epi8(v, _mm256_load_si256(reinterpret_cast<const __m256i*>(pattern)));
}

// A Q4_K/Q5_K super-block's 12 scale bytes -> bytes 0..7 the sub-blocks' scales, 8..15 their
// mins (6 bits each: the low 6 bits of bytes 0..7, or a nibble of bytes 8..11 with the top
// two bits of bytes 0..7 above it), four at a time in 32-bit words.
inline __m128i k_scales_mins(const uint8_t* packed) {
  constexpr uint32_t kLow6 = 0x3f3f3f3f, kLow4 = 0x0f0f0f0f, kLow2 = 0x03030303;
  uint32_t w[3];
  std::memcpy(w, packed, 12);
  const uint32_t scales_lo = w[0] & kLow6, mins_lo = w[1] & kLow6;
  const uint32_t scales_hi = (w[2] & kLow4) | (((w[0] >> 6) & kLow2) << 4);
  const uint32_t mins_hi = ((w[2] >> 4) & kLow4) | (((w[1] >> 6) & kLow2) << 4);
  return _mm_set_epi32(static_cast<int>(mins_hi), static_cast<int>(mins_lo), static_cast<int>(scales_hi),
                       static_cast<int>(scales_lo));
}

// Q4_K (kHighBits false) and Q5_K (true): out[t] = row . x_t for t < kTokens.
template <int kTokens, bool kHighBits>
inline void dot_q45_k(const uint8_t* row, const ActK& x, int64_t x_stride, float* out) {
  constexpr int64_t kBytes = kHighBits ? 176 : 144;
  const __m256i low4 = _mm256_set1_epi8(0x0f), one = _mm256_set1_epi8(1);
  __m256 acc[kTokens];
#pragma GCC unroll 4
  for (int t = 0; t < kTokens; ++t) acc[t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < x.num_blocks; ++b) {
    const uint8_t* blk = row + b * kBytes;
    if (prefetches<kTokens>()) prefetch_ahead<kBytes>(blk);
    const float d = half_at(blk), dmin = half_at(blk + 2);
    const __m128i scales_mins = k_scales_mins(blk + 4);  // 8 scales, then 8 mins (bytes)
    const __m256i scales16 = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(scales_mins));
    const __m128i mins16 = _mm_cvtepu8_epi16(_mm_srli_si128(scales_mins, 8));
    const uint8_t* qs = blk + (kHighBits ? 48 : 16);
    __m256i high = kHighBits ? load256(blk + 16) : _mm256_setzero_si256();
    __m256i sums[kTokens];
#pragma GCC unroll 4
    for (int t = 0; t < kTokens; ++t) sums[t] = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const __m256i bits = load256(qs + 32 * j);
      __m256i lo = _mm256_and_si256(bits, low4), hi = _mm256_and_si256(_mm256_srli_epi16(bits, 4), low4);
      if (kHighBits) {  // sub-block 2j's fifth bits in bit 0 of `high`, 2j + 1's in bit 1
        lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(high, one), 4));
        hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(high, 1), one), 4));
        high = _mm256_srli_epi16(high, 2);
      }
      const __m256i sc_lo = pick(scales16, kPick[2 * j]), sc_hi = pick(scales16, kPick[2 * j + 1]);
#pragma GCC unroll 4
      for (int t = 0; t < kTokens; ++t) {
        const int8_t* q = x.q + t * x_stride * kQK + b * kQK + 64 * j;
        const __m256i p_lo = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, load256(q)), sc_lo);
        const __m256i p_hi = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, load256(q + 32)), sc_hi);
        sums[t] = _mm256_add_epi32(sums[t], _mm256_add_epi32(p_lo, p_hi));
      }
    }
#pragma GCC unroll 4
    for (int t = 0; t < kTokens; ++t) {
      const float dx = x.d[t * x_stride + b];
      const __m128i s32 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x.sums32 + (t * x_stride + b) * 8));
      const __m128i mins = _mm_madd_epi16(mins16, s32);  // 4 lanes of m_s * sum q over s's 32 inputs
      // sc * sum - m * sums: the mins' four lanes go into the low half, negated.
      const __m256 m = _mm256_castps128_ps256(_mm_cvtepi32_ps(mins));
      acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(d * dx), _mm256_cvtepi32_ps(sums[t]), acc[t]);
      acc[t] = _mm256_fnmadd_ps(_mm256_set1_ps(dmin * dx), _mm256_insertf128_ps(m, _mm_setzero_ps(), 1), acc[t]);
    }
  }
#pragma GCC unroll 4
  for (int t = 0; t < kTokens; ++t) out[t] = hsum(acc[t]);
}

// Q6_K: the codes are q + 32 in [0, 63], unsigned as vpmaddubsw wants; the offset's term,
// 32 sum_s sc_s sum q_x over s, comes from the activations' sums per 16.
template <int kTokens>
inline void dot_q6_k(const uint8_t* row, const ActK& x, int64_t x_stride, float* out) {
  const __m256i low4 = _mm256_set1_epi8(0x0f), low2 = _mm256_set1_epi8(0x03);
  __m256 acc[kTokens];
#pragma GCC unroll 4
  for (int t = 0; t < kTokens; ++t) acc[t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < x.num_blocks; ++b) {
    const uint8_t* blk = row + b * 210;
    if (prefetches<kTokens>()) prefetch_ahead<210>(blk);
    const float d = half_at(blk + 208);
    const __m128i scale_bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192));
    const __m256i scales_all = _mm256_cvtepi8_epi16(scale_bytes);  // 16 lanes: sc_0 .. sc_15
    __m256i sums[kTokens];
#pragma GCC unroll 4
    for (int t = 0; t < kTokens; ++t) {
      const __m256i s16 = load256(x.sums16 + (t * x_stride + b) * 16);
      sums[t] = _mm256_slli_epi32(_mm256_madd_epi16(scales_all, s16), 5);
      sums[t] = _mm256_sub_epi32(_mm256_setzero_si256(), sums[t]);  // - 32 sum sc sum q
    }
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      // sc_{8h} .. sc_{8h + 7} in both halves, as 16-bit lanes
      const __m256i half_scales =
          _mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(h == 0 ? scale_bytes : _mm_srli_si128(scale_bytes, 8)));
      const __m256i ql0 = load256(blk + 64 * h), ql1 = load256(blk + 64 * h + 32);
      const __m256i qh = load256(blk + 128 + 32 * h);
      __m256i q[4];
      q[0] = _mm256_or_si256(_mm256_and_si256(ql0, low4), _mm256_slli_epi16(_mm256_and_si256(qh, low2), 4));
      q[1] = _mm256_or_si256(_mm256_and_si256(ql1, low4),
                             _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2), low2), 4));
      q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), low4),
                             _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 4), low2), 4));
      q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), low4),
                             _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 6), low2), 4));
#pragma GCC unroll 4
      for (int k = 0; k < 4; ++k) {
        const __m256i sc = pick(half_scales, kPickPair[k]);  // 16 inputs at sc_{8h+2k}, 16 at sc_{8h+2k+1}
#pragma GCC unroll 4
        for (int t = 0; t < kTokens; ++t) {
          const int8_t* qx = x.q + t * x_stride * kQK + b * kQK + 128 * h + 32 * k;
          sums[t] = _mm256_add_epi32(sums[t], _mm256_madd_epi16(_mm256_maddubs_epi16(q[k], load256(qx)), sc));
        }
      }
    }
#pragma GCC unroll 4
    for (int t = 0; t < kTokens; ++t) {
      acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(d * x.d[t * x_stride + b]), _mm256_cvtepi32_ps(sums[t]), acc[t]);
    }
  }
#pragma GCC unroll 4
  for (int t = 0; t < kTokens; ++t) out[t] = hsum(acc[t]);
}

// Q4_0 (kType kQ4_0), Q4_1, Q5_0, Q5_1 and Q8_0: blocks of 32 inputs, each with its own fp16
// scale, so each block's int32 sum meets d * dx in fp32. Q4_0's - 8 d, Q5_0's - 16 d and Q4_1's
// and Q5_1's m multiply the block's activation sum (ds = dx * sum q), accumulated apart in a scalar.
template <int kTokens, int64_t kType>
inline void dot_q32(const uint8_t* row, const Act32& x, int64_t x_stride, float* out) {
  constexpr int64_t kBytes = q32_block_bytes(kType);
  constexpr bool kHasMin = kType == kQ4_1 || kType == kQ5_1, kHasFifth = kType == kQ5_0 || kType == kQ5_1;
  const __m256i low4 = _mm256_set1_epi8(0x0f);
  const __m256i ones16 = _mm256_set1_epi16(1);
  __m256 acc[kTokens];
  float offsets[kTokens];
#pragma GCC unroll 4
  for (int t = 0; t < kTokens; ++t) acc[t] = _mm256_setzero_ps(), offsets[t] = 0.f;
  for (int64_t b = 0; b < x.num_blocks; ++b) {
    const uint8_t* blk = row + b * kBytes;
    if (b % 4 == 0 && prefetches<kTokens>()) prefetch_ahead<4 * kBytes>(blk);  // 72 to 136 bytes
    const float d = half_at(blk);
    __m256i w, signs;
    float offset = 0.f;
    if (kType == kQ8_0) {
      signs = load256(blk + 2);
      w = _mm256_sign_epi8(signs, signs);  // |q|, and q's signs go onto the activations
    } else {
      const int64_t codes_at = (kHasMin ? 4 : 2) + (kHasFifth ? 4 : 0);
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + codes_at));
      w = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(bytes, 4), bytes), low4);
      if (kHasFifth) w = _mm256_or_si256(w, fifth_bits(blk + (kHasMin ? 4 : 2)));
      offset = kHasMin ? half_at(blk + 2) : (kHasFifth ? -16.f : -8.f) * d;
    }
#pragma GCC unroll 4
    for (int t = 0; t < kTokens; ++t) {
      __m256i qx = load256(x.q + (t * x_stride + b) * kQ32);
      if (kType == kQ8_0) qx = _mm256_sign_epi8(qx, signs);
      const __m256i s = _mm256_madd_epi16(_mm256_maddubs_epi16(w, qx), ones16);
      acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(d * x.d[t * x_stride + b]), _mm256_cvtepi32_ps(s), acc[t]);
      if (kType != kQ8_0) offsets[t] += offset * x.ds[t * x_stride + b];
    }
  }
#pragma GCC unroll 4
  for (int t = 0; t < kTokens; ++t) out[t] = hsum(acc[t]) + offsets[t];
}

}  // namespace tokenloom_gguf
