// y = x @ W^T (+ bias) with W in a GGUF file's own blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K,
// Q5_K, Q6_K; gguf_dot.h has the layouts and the dot products), rows as the file stores them: no
// repacking, so every weight is the file's bit for bit. A weight may be several parts of
// different types stacked along the outputs (a merged qkv: Q4_K rows for q and k, Q6_K for v).
//
// Activations are quantized to int8 once per call, as llama.cpp's Q8_K (one scale per 256
// inputs, for the K-quants) and Q8_0 (per 32, for the others): the dot products then run on
// vpmaddubsw, 32 multiply-adds an instruction, where fp32 activations would need each code
// widened to fp32 and one FMA per 8 (docs/cpu-kernels.md has the measurements); the
// quantizing is gguf_activations.h.
//
// Q4_K, Q6_K and Q4_1 parts come repacked eight rows to a group where they have eight rows
// (gguf_dot_x8.h, gguf_dot_q6_k_x8.h and gguf_dot_q4_1_x8.h say why); their last rows, and every
// other type, are rows as the file stores them.
//
// Threads share out the output rows eight at a time (share_out.h: torch's threads, or a
// decode step's work pool); each row is read from memory once and used for every token,
// kMaxTokens at a time, or a Q4_K group kGroupTokens at a time (a group of rows, a few KB,
// stays in L1 across the passes).
#include "gguf_activations.h"
#include "gguf_dot_x16.h"
#include "gguf_types.h"
#include "share_out.h"  // from engine/cpu/csrc/, copied beside this file for the build

#include <torch/csrc/utils/pybind.h>
#include <torch/types.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace tokenloom_gguf {
namespace {

bool cpu_runs_kernels() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}

// The activations of tokens t0 and after: each array advanced by t0 tokens' rows.
inline ActK from_token(const ActK& x, int64_t t0) {
  return {x.q + t0 * x.num_blocks * kQK, x.d + t0 * x.num_blocks, x.sums16 + t0 * x.num_blocks * 16,
          x.sums32 + t0 * x.num_blocks * 8, x.num_blocks, x.offsets16 + t0 * x.num_blocks * 16};
}
inline Act32 from_token(const Act32& x, int64_t t0) {
  return {x.q + t0 * x.num_blocks * kQ32, x.d + t0 * x.num_blocks, x.ds + t0 * x.num_blocks, x.num_blocks};
}

// out[t] for kTokens tokens starting at token t0, one row of type `type`.
template <int kTokens>
void dot_row(int64_t type, const uint8_t* row, const ActK& xk, const Act32& x32, int64_t t0, float* out) {
  const ActK k = from_token(xk, t0);
  const Act32 s = from_token(x32, t0);
  switch (type) {
    case kQ4_K: return dot_q45_k<kTokens, false>(row, k, k.num_blocks, out);
    case kQ5_K: return dot_q45_k<kTokens, true>(row, k, k.num_blocks, out);
    case kQ6_K: return dot_q6_k<kTokens>(row, k, k.num_blocks, out);
    case kQ4_0: return dot_q32<kTokens, kQ4_0>(row, s, s.num_blocks, out);
    case kQ4_1: return dot_q32<kTokens, kQ4_1>(row, s, s.num_blocks, out);
    case kQ5_0: return dot_q32<kTokens, kQ5_0>(row, s, s.num_blocks, out);
    case kQ5_1: return dot_q32<kTokens, kQ5_1>(row, s, s.num_blocks, out);
    default: return dot_q32<kTokens, kQ8_0>(row, s, s.num_blocks, out);
  }
}

using DotRowFn = void (*)(int64_t, const uint8_t*, const ActK&, const Act32&, int64_t, float*);
constexpr DotRowFn kDotRow[kMaxTokens] = {dot_row<1>, dot_row<2>, dot_row<3>, dot_row<4>};

// out[t * 8 + r] for kTokens tokens from t0 (a multiple of kGroupTokens, or the last tile's
// tokens), one group of 8 repacked Q4_K rows; words: every token's, interleave_token's.
template <int kTokens>
void dot_group(const uint8_t* group, const ActK& xk, const int32_t* words, int64_t t0, float* out) {
  const ActK k = from_token(xk, t0);
  dot_q4_k_x8<kTokens>(group, k, k.num_blocks, words + t0 * xk.num_blocks * (kQK / 4), out);
}

using DotGroupFn = void (*)(const uint8_t*, const ActK&, const int32_t*, int64_t, float*);
constexpr DotGroupFn kDotGroup[kGroupTokens] = {dot_group<1>, dot_group<2>, dot_group<3>, dot_group<4>,
                                                dot_group<5>, dot_group<6>, dot_group<7>, dot_group<8>};

// ... one group of 8 repacked Q6_K rows (gguf_dot_q6_k_x8.h).
template <int kTokens>
void dot_q6_group(const uint8_t* group, const ActK& xk, const int32_t* words, int64_t t0, float* out) {
  const ActK k = from_token(xk, t0);
  dot_q6_k_x8<kTokens>(group, k, k.num_blocks, words + t0 * xk.num_blocks * (kQK / 4), out);
}

constexpr DotGroupFn kDotQ6Group[kGroupTokens] = {dot_q6_group<1>, dot_q6_group<2>, dot_q6_group<3>, dot_q6_group<4>,
                                                  dot_q6_group<5>, dot_q6_group<6>, dot_q6_group<7>, dot_q6_group<8>};

// ... one group of 8 repacked Q4_1 rows (gguf_dot_q4_1_x8.h), on the Q8_0 activations; words: q32's.
template <int kTokens>
void dot_q4_1_group(const uint8_t* group, const Act32& x32, const int32_t* words, int64_t t0, float* out) {
  const Act32 s = from_token(x32, t0);
  dot_q4_1_x8<kTokens>(group, s, s.num_blocks, words + t0 * x32.num_blocks * (kQ32 / 4), out);
}

using DotGroup32Fn = void (*)(const uint8_t*, const Act32&, const int32_t*, int64_t, float*);
constexpr DotGroup32Fn kDotQ4_1Group[kGroupTokens] = {dot_q4_1_group<1>, dot_q4_1_group<2>, dot_q4_1_group<3>,
                                                      dot_q4_1_group<4>, dot_q4_1_group<5>, dot_q4_1_group<6>,
                                                      dot_q4_1_group<7>, dot_q4_1_group<8>};

#if TL_GGUF_VNNI
// Two neighbouring groups of one part at once (gguf_dot_x16.h): out_a and out_b as dot_group's out.
template <int kTokens>
void dot_group_pair(int64_t type, const uint8_t* group_a, const uint8_t* group_b, const ActK& xk, const Act32& x32,
                    const int32_t* words, const int32_t* words32, int64_t t0, float* out_a, float* out_b) {
  if (type == kQ4_1x8) {
    const Act32 s = from_token(x32, t0);
    return dot_q4_1_x16<kTokens>(group_a, group_b, s, s.num_blocks, words32 + t0 * x32.num_blocks * (kQ32 / 4), out_a,
                                 out_b);
  }
  const ActK k = from_token(xk, t0);
  const int32_t* w = words + t0 * xk.num_blocks * (kQK / 4);
  if (type == kQ4_Kx8) return dot_q4_k_x16<kTokens>(group_a, group_b, k, k.num_blocks, w, out_a, out_b);
  dot_q6_k_x16<kTokens>(group_a, group_b, k, k.num_blocks, w, out_a, out_b);
}

using DotGroupPairFn = void (*)(int64_t, const uint8_t*, const uint8_t*, const ActK&, const Act32&, const int32_t*,
                                const int32_t*, int64_t, float*, float*);
constexpr DotGroupPairFn kDotGroupPair[kGroupTokens] = {dot_group_pair<1>, dot_group_pair<2>, dot_group_pair<3>,
                                                        dot_group_pair<4>, dot_group_pair<5>, dot_group_pair<6>,
                                                        dot_group_pair<7>, dot_group_pair<8>};
#endif

inline void store(float* p, float v) { *p = v; }
inline void store(at::BFloat16* p, float v) { *p = at::BFloat16(v); }  // nearest even, as torch's cast

// Tokens per tile when a call has many (a prompt's): their activations stay in L2 while
// a range of rows passes over them.
constexpr int64_t kTokenTile = 64;
constexpr int64_t kChunksPerThread = 8;

struct Part {
  const uint8_t* bytes;
  int64_t type, row_bytes, first_row, num_rows, first_item;  // an item: 8 rows (a group's)
};

template <typename out_t>
void store_row(out_t* out, int64_t out_features, int64_t t, int64_t r, float y, const float* bias) {
  store(out + t * out_features + r, y + (bias != nullptr ? bias[r] : 0.f));
}

// A group's 8 outputs of one token, y (+ bias[r0, r0 + 8)) at out, in one vector store, as a
// prompt's calls store 8 values a group and token (scalar stores with the bias's test each
// were a few percent of a 512-token gate_up, and bf16's scalar roundings more).
inline __m256 group_values(const float* y, const float* bias, int64_t r0) {
  const __m256 v = _mm256_loadu_ps(y);
  return bias != nullptr ? _mm256_add_ps(v, _mm256_loadu_ps(bias + r0)) : v;
}
inline void store_group(float* out, const float* y, const float* bias, int64_t r0) {
  _mm256_storeu_ps(out, group_values(y, bias, r0));
}
// bf16 as torch rounds (c10's round_to_nearest_even): the bits plus 0x7fff plus the kept part's
// lowest bit, the top half kept; a NaN becomes 0x7fc0.
inline void store_group(at::BFloat16* out, const float* y, const float* bias, int64_t r0) {
  const __m256 v = group_values(y, bias, r0);
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i top = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
  top = _mm256_blendv_epi8(top, _mm256_set1_epi32(0x7fc0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  const __m128i halves = _mm_packus_epi32(_mm256_castsi256_si128(top), _mm256_extracti128_si256(top, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), halves);
}

// Rows [r0, r0 + n) of one part (n <= 8) for tokens [t0, t1).
template <typename out_t>
void run_item(const Part& part, int64_t r0, int64_t n, const ActK& xk, const int32_t* words, const Act32& x32,
              int64_t t0, int64_t t1, int64_t out_features, const float* bias, out_t* out,
              const int32_t* words32) {
  const uint8_t* rows = part.bytes + (r0 - part.first_row) * part.row_bytes;
  // A group of 8 rows: kGroupTokens tokens a pass, dot_group(num, t, y) giving y [num][8 rows].
  const auto run_group = [&](const auto& dot_group) {
    for (int64_t t = t0; t < t1; t += kGroupTokens) {
      const int64_t num = std::min<int64_t>(kGroupTokens, t1 - t);
      float y[kGroupTokens * kGroupRows];
      dot_group(num, t, y);
      for (int64_t i = 0; i < num; ++i) store_group(out + (t + i) * out_features + r0, y + i * kGroupRows, bias, r0);
    }
  };
  if (part.type == kQ4_1x8) {
    run_group([&](int64_t num, int64_t t, float* y) { kDotQ4_1Group[num - 1](rows, x32, words32, t, y); });
    return;
  }
  if (part.type == kQ4_Kx8 || part.type == kQ6_Kx8) {
    const DotGroupFn* dot_group_fn = part.type == kQ4_Kx8 ? kDotGroup : kDotQ6Group;
    run_group([&](int64_t num, int64_t t, float* y) { dot_group_fn[num - 1](rows, xk, words, t, y); });
    return;
  }
  for (int64_t t = t0; t < t1; t += kMaxTokens) {
    const int64_t num = std::min<int64_t>(kMaxTokens, t1 - t);
    float y[kMaxTokens];
    for (int64_t j = 0; j < n; ++j) {
      kDotRow[num - 1](part.type, rows + j * part.row_bytes, xk, x32, t, y);
      for (int64_t i = 0; i < num; ++i) store_row(out, out_features, t + i, r0 + j, y[i], bias);
    }
  }
}

// Whether a call of num_tokens tokens takes its groups two at a time (gguf_dot_x16.h). One to
// three tokens read their weights from memory faster on AVX2's kernels: one token's chain of
// eight vpdpbusd a sub-block waits on their latency, where vpmaddubsw's products are
// independent. From 4 tokens the pairs win where a pass's activations outgrow L1, since a
// pair reads them once for 16 rows; where they fit, the groups one at a time stay ahead up to
// 7 tokens, and from 8 the pairs are ahead everywhere (docs/cpu-kernels.md has the figures).
inline bool pairs_groups(int64_t num_tokens, int64_t in_features) {
  if (!TL_GGUF_VNNI || num_tokens < 4) return false;
  return num_tokens >= kGroupTokens || num_tokens * in_features > 16 * 1024;
}

// Whether item i (of part `part`, in a thread's items [.., end)) is the first of two whole
// groups that dot_group_pair takes at once.
inline bool starts_group_pair(const Part& part, int64_t i, int64_t end) {
  return type_info(part.type).is_grouped && i + 1 < end && (i + 2 - part.first_item) * kGroupRows <= part.num_rows;
}

// Rows [r0, r0 + 16) of one grouped part, two groups at once, for tokens [t0, t1).
template <typename out_t>
void run_group_pair(const Part& part, int64_t r0, const ActK& xk, const int32_t* words, const Act32& x32, int64_t t0,
                    int64_t t1, int64_t out_features, const float* bias, out_t* out, const int32_t* words32) {
#if TL_GGUF_VNNI
  const uint8_t* group_a = part.bytes + (r0 - part.first_row) * part.row_bytes;
  const uint8_t* group_b = group_a + kGroupRows * part.row_bytes;
  for (int64_t t = t0; t < t1; t += kGroupTokens) {
    const int64_t num = std::min<int64_t>(kGroupTokens, t1 - t);
    float y_a[kGroupTokens * kGroupRows], y_b[kGroupTokens * kGroupRows];
    kDotGroupPair[num - 1](part.type, group_a, group_b, xk, x32, words, words32, t, y_a, y_b);
    for (int64_t i = 0; i < num; ++i) {
      store_group(out + (t + i) * out_features + r0, y_a + i * kGroupRows, bias, r0);
      store_group(out + (t + i) * out_features + r0 + kGroupRows, y_b + i * kGroupRows, bias, r0 + kGroupRows);
    }
  }
#endif
}

template <typename out_t>
void run_rows(const std::vector<Part>& parts, const ActK& xk, const int32_t* words, const Act32& x32,
              int64_t num_tokens, int64_t out_features, const float* bias, out_t* out, const int32_t* words32) {
  const int64_t num_items = parts.back().first_item + (parts.back().num_rows + kGroupRows - 1) / kGroupRows;
  const bool pairs = pairs_groups(num_tokens, x32.num_blocks * kQ32);  // every type takes whole 32s
  tokenloom_cpu::share_out_ranges<kChunksPerThread>(num_items, 0, [](int64_t) {}, [&](int64_t begin, int64_t end) {
    for (int64_t t0 = 0; t0 < num_tokens; t0 += kTokenTile) {
      const int64_t t1 = std::min(num_tokens, t0 + kTokenTile);
      size_t p = 0;
      for (int64_t i = begin; i < end; ++i) {
        while (p + 1 < parts.size() && parts[p + 1].first_item <= i) ++p;
        const Part& part = parts[p];
        const int64_t r0 = part.first_row + (i - part.first_item) * kGroupRows;
        if (pairs && starts_group_pair(part, i, end)) {
          run_group_pair(part, r0, xk, words, x32, t0, t1, out_features, bias, out, words32);
          ++i;
          continue;
        }
        const int64_t n = std::min(kGroupRows, part.first_row + part.num_rows - r0);
        run_item(part, r0, n, xk, words, x32, t0, t1, out_features, bias, out, words32);
      }
    }
  });
}

}  // namespace

// x: [num_tokens, in_features] fp32 or bf16; blocks: uint8, contiguous, every part's bytes;
// layout: int64 [num_parts, 3], a part's (type, byte offset in blocks, rows), the parts stacked
// along the outputs (a part's rows row-major, or for kQ4_Kx8, kQ6_Kx8 and kQ4_1x8 its groups of 8); bias: fp32
// [out_features] or empty. Returns [num_tokens, out_features] in x's dtype, or fp32 (logits).
// The schema of the quantized linears' ops (engine/cpu/decode_stack.py calls them alike).
torch::Tensor gguf_linear(const torch::Tensor& x_in, const torch::Tensor& blocks, const torch::Tensor& layout,
                          const torch::Tensor& bias, int64_t out_features, bool out_fp32) {
  TORCH_CHECK(cpu_runs_kernels(), "gguf linears need a CPU with AVX2, FMA and F16C");
  TORCH_CHECK(x_in.dim() == 2 && x_in.device().is_cpu() &&
                  (x_in.scalar_type() == at::kBFloat16 || x_in.scalar_type() == at::kFloat),
              "x: 2-D bf16 or fp32 on the CPU");
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.is_contiguous(), "blocks: uint8, contiguous");
  TORCH_CHECK(layout.scalar_type() == at::kLong && layout.dim() == 2 && layout.size(1) == 3 && layout.size(0) > 0 &&
                  layout.is_contiguous(),
              "layout: int64 [num_parts, 3] (type, byte offset, rows)");
  const torch::Tensor x = x_in.contiguous();
  const int64_t num_tokens = x.size(0), in_features = x.size(1);
  const int64_t* entries = layout.data_ptr<int64_t>();
  std::vector<Part> spans;
  bool need_k = false, need_32 = false, need_words = false, need_words32 = false;
  int64_t num_rows = 0;
  for (int64_t i = 0; i < layout.size(0); ++i) {
    const int64_t type = entries[3 * i], offset = entries[3 * i + 1], rows = entries[3 * i + 2];
    const TypeInfo& info = type_info(type);
    TORCH_CHECK(in_features % info.block_inputs == 0, in_features, " inputs are not whole blocks of type ", type);
    const int64_t row_bytes = in_features / info.block_inputs * info.block_bytes;
    TORCH_CHECK(rows > 0 && offset >= 0 && offset + rows * row_bytes <= blocks.numel() &&
                    (!info.is_grouped || rows % kGroupRows == 0),
                "part ", i, ": ", rows, " rows of type ", type, " at byte ", offset, " are not inside the blocks");
    (info.is_k ? need_k : need_32) = true;
    (info.is_k ? need_words : need_words32) |= info.is_grouped;
    const int64_t first_item =
        spans.empty() ? 0 : spans.back().first_item + (spans.back().num_rows + kGroupRows - 1) / kGroupRows;
    spans.push_back({blocks.data_ptr<uint8_t>() + offset, type, row_bytes, num_rows, rows, first_item});
    num_rows += rows;
  }
  TORCH_CHECK(num_rows == out_features, "the parts hold ", num_rows, " rows, not ", out_features);
  const bool has_bias = bias.numel() > 0;
  TORCH_CHECK(!has_bias || (bias.scalar_type() == at::kFloat && bias.numel() == out_features && bias.is_contiguous()),
              "bias: fp32 [out_features]");
  auto out = torch::empty({num_tokens, out_features}, x.options().dtype(out_fp32 ? at::kFloat : x.scalar_type()));
  if (num_tokens == 0 || out_features == 0) return out;

  thread_local Scratch scratch;
  if (x.scalar_type() == at::kFloat) {
    quantize_all(x.data_ptr<float>(), num_tokens, in_features, need_k, need_32, need_words, need_words32, scratch);
  } else {
    quantize_all(x.data_ptr<at::BFloat16>(), num_tokens, in_features, need_k, need_32, need_words, need_words32, scratch);
  }
  const ActK xk{scratch.qk.data(), scratch.dk.data(), scratch.sums16.data(), scratch.sums32.data(), in_features / kQK,
                scratch.offsets16.data()};
  const Act32 x32{scratch.q32.data(), scratch.d32.data(), scratch.ds32.data(), in_features / kQ32};
  const float* b = has_bias ? bias.data_ptr<float>() : nullptr;
  if (out.scalar_type() == at::kFloat) {
    run_rows(spans, xk, scratch.qk_words.data(), x32, num_tokens, out_features, b, out.data_ptr<float>(),
             scratch.q32_words.data());
  } else {
    run_rows(spans, xk, scratch.qk_words.data(), x32, num_tokens, out_features, b, out.data_ptr<at::BFloat16>(),
             scratch.q32_words.data());
  }
  return out;
}

}  // namespace tokenloom_gguf

namespace tokenloom_gguf {
torch::Tensor gguf_rows(const torch::Tensor& blocks, const torch::Tensor& layout, const torch::Tensor& rows,
                        int64_t in_features);  // gguf_rows.cpp
torch::Tensor pack_q4_k_x8(const torch::Tensor& rows);  // gguf_repack.cpp
torch::Tensor pack_q6_k_x8(const torch::Tensor& rows);
torch::Tensor pack_q4_1_x8(const torch::Tensor& rows);
}  // namespace tokenloom_gguf

namespace {

// Reads `bytes` (uint8, contiguous, a multiple of 4 KB) once, on the threads and hand-out the
// matmuls use (share_out), summing 64-bit words so nothing is skipped; returns the sum. The
// benchmark's stream rate (scripts/bench/gguf_kernels.py): what these threads can read at most.
int64_t stream_read(const torch::Tensor& bytes) {
  TORCH_CHECK(bytes.scalar_type() == at::kByte && bytes.is_contiguous() && bytes.numel() % 4096 == 0,
              "bytes: uint8, contiguous, whole 4 KB pages");
  const uint8_t* base = bytes.data_ptr<uint8_t>();
  std::atomic<int64_t> total{0};
  tokenloom_cpu::share_out_ranges<8>(bytes.numel() / 4096, 0, [](int64_t) {}, [&](int64_t begin, int64_t end) {
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
    for (const uint8_t* p = base + begin * 4096; p < base + end * 4096; p += 128) {
      a0 = _mm256_add_epi64(a0, tokenloom_gguf::load256(p)), a1 = _mm256_add_epi64(a1, tokenloom_gguf::load256(p + 32));
      a2 = _mm256_add_epi64(a2, tokenloom_gguf::load256(p + 64)), a3 = _mm256_add_epi64(a3, tokenloom_gguf::load256(p + 96));
    }
    const __m256i s = _mm256_add_epi64(_mm256_add_epi64(a0, a1), _mm256_add_epi64(a2, a3));
    total.fetch_add(_mm256_extract_epi64(s, 0) + _mm256_extract_epi64(s, 1) + _mm256_extract_epi64(s, 2) +
                    _mm256_extract_epi64(s, 3), std::memory_order_relaxed);
  });
  return total.load();
}

bool has_gguf_kernels() { return tokenloom_gguf::cpu_runs_kernels(); }

// The decode steps' work pool of the other kernels' library (its work_pool_address), which
// this library's share_out and parallel_for then use when called from that pool's master.
void use_work_pool(int64_t address) {
  tokenloom_cpu::work_pool_slot() = reinterpret_cast<tokenloom_cpu::WorkPool*>(address);
}

// Whether one-token calls prefetch their weights in software (gguf_dot.h's g_one_token_prefetch).
void set_one_token_prefetch(bool on) { tokenloom_gguf::g_one_token_prefetch.store(on, std::memory_order_relaxed); }
bool one_token_prefetch() { return tokenloom_gguf::g_one_token_prefetch.load(std::memory_order_relaxed); }

// "avx512_vnni" where calls of several tokens take the groups two at a time on vpdpbusd, else "avx2" (gguf_dot.h).
const char* dot_isa() { return TL_GGUF_VNNI ? "avx512_vnni" : "avx2"; }

}  // namespace

// A side build (TL_GGUF_SIDE_BUILD: gguf_extension.py's load_gguf_kernels_avx2, or a variant
// built to be measured beside the main one) loads beside it: a namespace can be registered once.
#ifndef TL_GGUF_SIDE_BUILD
TORCH_LIBRARY(tokenloom_gguf, m) {
  m.def("linear(Tensor x, Tensor blocks, Tensor layout, Tensor bias, int out_features, bool out_fp32) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenloom_gguf, CPU, m) {
  m.impl("linear", &tokenloom_gguf::gguf_linear);
}
#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("use_work_pool", &use_work_pool, "share out on the decode steps' work pool at this address (work_pool.h)");
  m.def("q4_k_x8_type", [] { return tokenloom_gguf::kQ4_Kx8; }, "our type id of Q4_K rows repacked 8 to a group");
  m.def("q6_k_x8_type", [] { return tokenloom_gguf::kQ6_Kx8; }, "our type id of Q6_K rows repacked 8 to a group");
  m.def("q4_1_x8_type", [] { return tokenloom_gguf::kQ4_1x8; }, "our type id of Q4_1 rows repacked 8 to a group");
  m.def("dot_isa", &dot_isa, "the group kernels' inner products: avx512_vnni or avx2");
  m.def("has_gguf_kernels", &has_gguf_kernels, "whether this CPU runs the gguf kernels (AVX2, FMA, F16C)");
  m.def("set_one_token_prefetch", &set_one_token_prefetch,
        "whether one-token calls prefetch their weights in software (engine/cpu/prefetch_tuner.py chooses)");
  m.def("one_token_prefetch", &one_token_prefetch, "whether one-token calls prefetch their weights in software");
  m.def("stream_read", &stream_read, "read a buffer once on the matmuls' threads (the benchmark's stream rate)");
  m.def("gguf_rows", &tokenloom_gguf::gguf_rows, "rows of the blocks as fp32, gguf's dequantized values bit for bit");
  m.def("pack_q4_k_x8", &tokenloom_gguf::pack_q4_k_x8, "Q4_K rows repacked eight to a group (gguf_repack.cpp)");
  m.def("pack_q6_k_x8", &tokenloom_gguf::pack_q6_k_x8, "Q6_K rows repacked eight to a group (gguf_repack.cpp)");
  m.def("pack_q4_1_x8", &tokenloom_gguf::pack_q4_1_x8, "Q4_1 rows repacked eight to a group (gguf_repack.cpp)");
  m.def("gguf_linear", &tokenloom_gguf::gguf_linear, "y = x @ W^T (+ bias), W in GGUF blocks, parts stacked (CPU)");
}
