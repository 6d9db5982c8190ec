// bf16 linear layers on CPUs with the AVX512_BF16 dot product: every step where the CPU
// has no AMX, steps of a few tokens where it has (engine/cpu/packing.py decides).
//
// With few tokens a linear layer is a stream of its weights: each weight is used once
// per token, so the kernel must read them at the machine's memory rate; oneDNN's
// prepacked bf16 matmul read them well below it (docs/performance.md, "CPU matmuls").
//
// Weights are repacked once into slabs of 16 output features, each slab contiguous:
//   slabs: [out_features / 16, in_features / 2, 16] 32-bit words, word (s, p, j) = the
//   bf16 pair (2p, 2p + 1) of output feature 16 s + j.
// A slab streams from memory front to back; one vdpbf16ps adds two products for 16
// outputs, with the token's pair broadcast, so there are no horizontal sums. Up to
// kMaxRows tokens share each weight load; more tokens take further passes over the
// slab, which is then in cache, and are bound by the dot products instead: from 64
// tokens up they run near the vdpbf16ps peak (figures: docs/performance.md, "CPU
// matmuls"). The passes split the tokens evenly, and each pass's tokens are interleaved
// pair by pair first ([pair][row] words), so the broadcasts read one stream with
// constant offsets: read from the rows' own streams (one a row, one register each for
// its address), steps of 20 tokens and more ran 8-12% slower. Sums are fp32; the output
// is rounded to bf16 once, or left in fp32 (logits).
#include "share_out.h"

#include <torch/types.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace {
// Whether one-token calls take slab_rows' software prefetches (set_one_token_prefetch; the host's
// choice, as the GGUF kernels' is: engine/cpu/prefetch_tuner.py).
std::atomic<bool> g_one_token_prefetch{true};
}  // namespace

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>

namespace {

constexpr int kMaxRows = 12;  // tokens per pass: their 24 sums and two weight vectors stay in registers
constexpr int64_t kChunksPerThread = 8;  // run_slabs' share-out
constexpr int64_t kChunkBytes = int64_t{4} << 20;  // a call's rows at a time (run_slabs)
// 4 KB ahead in the slab, into L2: prefetching into L1 stalled the loop once the L1's few
// miss buffers were full (8-64-token steps of the model's linears: 10-15% slower).
constexpr int64_t kPrefetchPairs = 64;

// out[r][n0 .. n0+16) for rows [0, kRows) of x_pairs ([num_pairs][kRows] words); out_t is
// at::BFloat16 (rounded once) or float (the sums as they are). `next_slab` (or null): the
// slab whose lines [next_begin, next_end) (a line: one pair's 16 words) are brought into
// L2 meanwhile, spread evenly over this pass's pairs.
template <int kRows, typename out_t>
void slab_rows(const uint32_t* x_pairs, int64_t num_pairs, const uint32_t* slab, const at::BFloat16* bias,
               out_t* out, int64_t out_stride, const uint32_t* next_slab, int64_t next_begin, int64_t next_end) {
  // Fixed point, 16 fraction bits: the lines of next_slab due by each pair (at most one a pair).
  const uint64_t step =
      next_slab != nullptr && num_pairs > 0 ? (static_cast<uint64_t>(next_end - next_begin) << 16) / num_pairs : 0;
  uint64_t due = static_cast<uint64_t>(next_begin) << 16;
  int64_t line = next_begin;
  const bool prefetch = kRows > 1 || g_one_token_prefetch.load(std::memory_order_relaxed);
  // Two sums per row, for even and odd pairs: one row alone would wait on each add's latency.
  __m512 acc[kRows], acc2[kRows];
#pragma GCC unroll 12
  for (int r = 0; r < kRows; ++r) acc[r] = acc2[r] = _mm512_setzero_ps();
  int64_t p = 0;
  for (; p + 2 <= num_pairs; p += 2) {
    if (prefetch) {
      _mm_prefetch(reinterpret_cast<const char*>(slab + (p + kPrefetchPairs) * 16), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(slab + (p + kPrefetchPairs + 1) * 16), _MM_HINT_T1);
      due += 2 * step;
#pragma GCC unroll 2
      for (int i = 0; i < 2 && line < static_cast<int64_t>(due >> 16); ++i, ++line) {
        _mm_prefetch(reinterpret_cast<const char*>(next_slab + 16 * line), _MM_HINT_T1);
      }
    }
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(slab + p * 16);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(slab + (p + 1) * 16);
#pragma GCC unroll 12
    for (int r = 0; r < kRows; ++r) {
      acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_set1_epi32(x_pairs[p * kRows + r]), w0);
      acc2[r] = _mm512_dpbf16_ps(acc2[r], (__m512bh)_mm512_set1_epi32(x_pairs[(p + 1) * kRows + r]), w1);
    }
  }
  for (; p < num_pairs; ++p) {
    const __m512bh w = (__m512bh)_mm512_loadu_si512(slab + p * 16);
#pragma GCC unroll 12
    for (int r = 0; r < kRows; ++r) {
      acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_set1_epi32(x_pairs[p * kRows + r]), w);
    }
  }
  if (next_slab != nullptr && prefetch) {
    for (; line < next_end; ++line) _mm_prefetch(reinterpret_cast<const char*>(next_slab + 16 * line), _MM_HINT_T1);
  }
#pragma GCC unroll 12
  for (int r = 0; r < kRows; ++r) acc[r] = _mm512_add_ps(acc[r], acc2[r]);
  __m512 b = _mm512_setzero_ps();
  if (bias != nullptr) {
    b = _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bias))), 16));
  }
#pragma GCC unroll 12
  for (int r = 0; r < kRows; ++r) {
    if constexpr (std::is_same_v<out_t, float>) {
      _mm512_storeu_ps(out + r * out_stride, _mm512_add_ps(acc[r], b));
    } else {
      const __m256bh y = _mm512_cvtneps_pbh(_mm512_add_ps(acc[r], b));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * out_stride), (__m256i)y);
    }
  }
}

template <typename out_t>
using SlabRowsFn = void (*)(const uint32_t*, int64_t, const uint32_t*, const at::BFloat16*, out_t*, int64_t,
                            const uint32_t*, int64_t, int64_t);
template <typename out_t>
constexpr SlabRowsFn<out_t> kSlabRows[kMaxRows] = {
    slab_rows<1, out_t>, slab_rows<2, out_t>, slab_rows<3, out_t>, slab_rows<4, out_t>,
    slab_rows<5, out_t>, slab_rows<6, out_t>, slab_rows<7, out_t>, slab_rows<8, out_t>,
    slab_rows<9, out_t>, slab_rows<10, out_t>, slab_rows<11, out_t>, slab_rows<12, out_t>};

// At least `num_words` words, kept by the calling thread from call to call: a fresh buffer
// for a prefill chunk's 4 MB would be page-faulted in on every call.
uint32_t* interleave_buffer(size_t num_words) {
  static thread_local std::vector<uint32_t> buffer;
  if (buffer.size() < num_words) buffer.resize(num_words);
  return buffer.data();
}

// Pass i's tokens are rows [first_row(i), first_row(i + 1)): the passes split them evenly.
int64_t first_row(int64_t pass, int64_t num_tokens, int64_t num_passes) { return pass * num_tokens / num_passes; }

// Pairs [p_begin, p_end) of x ([num_tokens][num_pairs] words) with each pass's rows
// interleaved pair by pair into `interleaved`: pass i's block starts at word
// first_row(i) * num_pairs and is [num_pairs][rows of pass i]. The threads copy it in pieces
// of pairs in the region that then runs the slabs (share_out's prologue): copied before the
// region by one thread, it left the other waiting (3% of a 16-token step of Llama-3.2-1B).
void interleave_pairs(const uint32_t* x, int64_t num_tokens, int64_t num_pairs, int64_t num_passes, int64_t p_begin,
                      int64_t p_end, uint32_t* interleaved) {
  for (int64_t i = 0; i < num_passes; ++i) {
    const int64_t r0 = first_row(i, num_tokens, num_passes), rows = first_row(i + 1, num_tokens, num_passes) - r0;
    uint32_t* block = interleaved + r0 * num_pairs;
    for (int64_t r = 0; r < rows; ++r) {
      const uint32_t* row = x + (r0 + r) * num_pairs;
      for (int64_t p = p_begin; p < p_end; ++p) block[p * rows + r] = row[p];
    }
  }
}

// Each slab's outputs for every token, the slabs shared out (share_out.h). With more than
// kMaxRows tokens each slab takes several passes, and every pass brings its share of the
// next slab into L2 (lines in proportion to its rows), so the memory streams through all of
// a slab's passes while the core computes, and the next slab's first pass finds it in cache
// instead of waiting on it; the next slab is usually this thread's (each thread works
// through its own run of slabs). When only the second pass brought it in, at a line a
// pair, the memory sat idle through the first: a step of 9-15 tokens waited on it.
template <typename out_t>
void run_slab_rows(const uint32_t* x, int64_t num_tokens, int64_t num_pairs, const uint32_t* w,
                   const at::BFloat16* b, int64_t num_slabs, out_t* o) {
  const int64_t out_features = num_slabs * 16;
  const int64_t num_passes = (num_tokens + kMaxRows - 1) / kMaxRows;
  // One token's row is already its own interleaving.
  uint32_t* interleaved = num_tokens > 1 ? interleave_buffer(num_tokens * num_pairs) : nullptr;
  const uint32_t* x_pairs = num_tokens > 1 ? interleaved : x;
  // The copy in pieces of about 16 KB, at most kChunksPerThread a thread.
  const int64_t num_pieces = interleaved == nullptr ? 0
      : std::clamp<int64_t>(num_tokens * num_pairs / 4096, 1, kChunksPerThread * at::get_num_threads());
  const auto interleave_piece = [&](int64_t j) {
    interleave_pairs(x, num_tokens, num_pairs, num_passes, j * num_pairs / num_pieces, (j + 1) * num_pairs / num_pieces,
                     interleaved);
  };
  tokenloom_cpu::share_out<kChunksPerThread>(num_slabs, num_pieces, interleave_piece, [&](int64_t s) {
    const uint32_t* next = num_passes > 1 && s + 1 < num_slabs ? w + (s + 1) * num_pairs * 16 : nullptr;
    for (int64_t i = 0; i < num_passes; ++i) {
      const int64_t r0 = first_row(i, num_tokens, num_passes), rows = first_row(i + 1, num_tokens, num_passes) - r0;
      // This pass's share of the next slab's lines, in proportion to its rows.
      const int64_t begin = r0 * num_pairs / num_tokens, end = (r0 + rows) * num_pairs / num_tokens;
      kSlabRows<out_t>[rows - 1](x_pairs + r0 * num_pairs, num_pairs, w + s * num_pairs * 16,
                                 b == nullptr ? nullptr : b + s * 16, o + r0 * out_features + s * 16,
                                 out_features, end > begin ? next : nullptr, begin, end);
    }
  });
}

// A large step in chunks of rows: every slab's passes read all of a call's rows again, and
// past a few MB they no longer stay in cache from one slab to the next (a 1,024-token step of
// an 8,192-input layer ran at three quarters of a 256-token step's rate). The weights are
// read once a chunk, a small cost beside the chunk's dot products.
template <typename out_t>
void run_slabs(const uint32_t* x, int64_t num_tokens, int64_t num_pairs, const uint32_t* w,
               const at::BFloat16* b, int64_t num_slabs, out_t* o) {
  const int64_t chunk = std::max<int64_t>(kMaxRows, kChunkBytes / (std::max<int64_t>(1, num_pairs) * 4));
  for (int64_t r0 = 0; r0 < num_tokens; r0 += chunk) {
    run_slab_rows(x + r0 * num_pairs, std::min(chunk, num_tokens - r0), num_pairs, w, b, num_slabs,
                  o + r0 * num_slabs * 16);
  }
}

}  // namespace

constexpr bool kHasSmallBatchLinear = true;
#else
constexpr bool kHasSmallBatchLinear = false;
#endif

bool has_small_batch_linear() { return kHasSmallBatchLinear; }

void set_one_token_prefetch(bool on) { g_one_token_prefetch.store(on, std::memory_order_relaxed); }
bool one_token_prefetch() { return g_one_token_prefetch.load(std::memory_order_relaxed); }

// x: [num_tokens, in_features] bf16; slabs: [out_features / 16, in_features / 2, 16] int32
// (engine.cpu.packing.pack_slabs' layout); bias: [out_features] bf16 or empty.
// Returns [num_tokens, out_features], bf16, or with out_fp32 the fp32 sums unrounded (logits:
// rounded to bf16, near-equal top logits tie, at 25 a bf16 step is 0.125).
torch::Tensor small_batch_linear(torch::Tensor x, torch::Tensor slabs, torch::Tensor bias, bool out_fp32) {
  TORCH_CHECK(kHasSmallBatchLinear, "small_batch_linear needs a CPU with AVX512_BF16");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.device().is_cpu(), "x: 2-D bf16 on the CPU");
  TORCH_CHECK(slabs.dim() == 3 && slabs.scalar_type() == torch::kInt32 && slabs.size(2) == 16 && slabs.is_contiguous(),
              "slabs: [out_features / 16, in_features / 2, 16] int32, contiguous");
  const int64_t num_tokens = x.size(0), in_features = x.size(1);
  const int64_t num_slabs = slabs.size(0), num_pairs = slabs.size(1), out_features = num_slabs * 16;
  TORCH_CHECK(in_features == 2 * num_pairs, "x's features disagree with the weight's");
  const bool has_bias = bias.numel() > 0;
  if (has_bias) {
    TORCH_CHECK(bias.scalar_type() == at::kBFloat16 && bias.numel() == out_features && bias.is_contiguous(),
                "bias: [out_features] bf16");
  }
  x = x.contiguous();
  auto out = torch::empty({num_tokens, out_features}, x.options().dtype(out_fp32 ? at::kFloat : at::kBFloat16));
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  const uint32_t* x_pairs = reinterpret_cast<const uint32_t*>(x.data_ptr<at::BFloat16>());
  const uint32_t* w = reinterpret_cast<const uint32_t*>(slabs.data_ptr<int32_t>());
  const at::BFloat16* b = has_bias ? bias.data_ptr<at::BFloat16>() : nullptr;
  if (out_fp32) {
    run_slabs(x_pairs, num_tokens, num_pairs, w, b, num_slabs, out.data_ptr<float>());
  } else {
    run_slabs(x_pairs, num_tokens, num_pairs, w, b, num_slabs, out.data_ptr<at::BFloat16>());
  }
#endif
  return out;
}
