// Probe: where a one-token group kernel (gguf_dot_x8.h, gguf_dot_q6_k_x8.h) puts its software
// prefetch, from memory on two threads, beside a plain read of the same bytes. Variants:
//   header       the kernel as the headers have it now
//   block4608    every line of a super-block fetched 4.5 KB ahead at its start (the kernels before
//                prefetch_next_block, as the row kernels still do)
//   spreadN      a stretch per pair of sub-blocks (Q4_K 288 bytes, Q6_K 210), N bytes ahead
//   none         no software prefetch (the hardware prefetcher alone)
// Each pass reads one layer (2048 inputs x 8192 outputs, or argv[3] x argv[4]; each thread half
// of it, as share_out parts them) from 320 MB of random groups on 2 MB pages; the variants take
// turns pass by pass, each on a layer not read for 20+ passes (past the L3), so a drift in the
// machine's memory rate falls on all of them alike. Median GB/s of the passes, and each
// variant's median over `stream` of the same round.
//   g++ -O3 -march=native -fopenmp -I engine/cpu/csrc/gguf -o /tmp/gguf_group_prefetch scripts/bench/probes/gguf_group_prefetch.cpp
//   flock /tmp/bench.lock /tmp/gguf_group_prefetch 6 6   # Q6_K (or 4: Q4_K), rounds
//   flock /tmp/bench.lock /tmp/gguf_group_prefetch 4 2 8192 2048   # ... on a down projection's shape
// "header" follows g_one_token_prefetch, on here (engine/cpu/prefetch_tuner.py switches it in
// the engine).
#include "gguf_dot_q6_k_x8.h"
#include <omp.h>
#include <sys/mman.h>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>
using namespace tokenloom_gguf;

static double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

template <int64_t kAhead, int64_t kBytes>
inline void fetch(const uint8_t* p) {
#pragma GCC unroll 32
  for (int64_t k = 0; k < kBytes; k += 64) _mm_prefetch(reinterpret_cast<const char*>(p + kAhead + k), _MM_HINT_T0);
}

enum Mode { kBlock, kSpread, kNone };

// dot_q6_k_x8<1> with the prefetch at kMode, kAhead.
template <Mode kMode, int64_t kAhead>
void q6(const uint8_t* group, const ActK& x, const int32_t* xw, float* out) {
  __m256 acc[1] = {_mm256_setzero_ps()};
  for (int64_t b = 0; b < x.num_blocks; ++b) {
    const uint8_t* blk = group + b * kQ6GroupBlockBytes;
    if (kMode == kBlock) fetch<kAhead, kQ6GroupBlockBytes>(blk);
    __m256i sums[1] = {_mm256_setzero_si256()};
#pragma GCC unroll 8
    for (int p = 0; p < 8; ++p) {
      const __m256i pair = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 16 + 16 * p)));
      int32_t s16;
      std::memcpy(&s16, x.sums16 + b * 16 + 2 * p, 4);
      sums[0] = _mm256_sub_epi32(sums[0], _mm256_madd_epi16(pair, _mm256_set1_epi32(s16)));
    }
    sums[0] = _mm256_slli_epi32(sums[0], 5);
    const int32_t* xb = xw + b * (kQK / 4);
#pragma GCC unroll 1
    for (int p = 0; p < 8; ++p) {
      if (kMode == kSpread) fetch<kAhead, 210>(blk + 210 * p);
      const __m256i pair = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 16 + 16 * p)));
      const uint8_t* codes = blk + 144 + 192 * p;
      q6_sub_block<1>(codes, xb + 8 * p, pick(pair, kDupScale[0]), sums);
      q6_sub_block<1>(codes + 96, xb + 8 * p + 4, pick(pair, kDupScale[1]), sums);
    }
    add_super_block<1>(blk, x, x.num_blocks, b, sums, acc);
  }
  _mm256_storeu_ps(out, acc[0]);
}

// dot_q4_k_x8<1> with the prefetch at kMode, kAhead.
template <Mode kMode, int64_t kAhead>
void q4(const uint8_t* group, const ActK& x, const int32_t* xw, float* out) {
  const __m256i low4 = _mm256_set1_epi8(0x0f), low2 = _mm256_set1_epi8(0x03);
  __m256 acc[1] = {_mm256_setzero_ps()};
  for (int64_t b = 0; b < x.num_blocks; ++b) {
    const uint8_t* blk = group + b * kGroupBlockBytes;
    if (kMode == kBlock) fetch<kAhead, kGroupBlockBytes>(blk);
    const __m256i l0 = load256(blk + 32), l1 = load256(blk + 64), h = load256(blk + 96);
    const __m256i mins_lo = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low4),
                                            _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 4), low2), 4));
    const __m256i mins_hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low4),
                                            _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 6), low2), 4));
    const __m256i mins[4] = {_mm256_cvtepu8_epi16(_mm256_castsi256_si128(mins_lo)),
                             _mm256_cvtepu8_epi16(_mm256_extracti128_si256(mins_lo, 1)),
                             _mm256_cvtepu8_epi16(_mm256_castsi256_si128(mins_hi)),
                             _mm256_cvtepu8_epi16(_mm256_extracti128_si256(mins_hi, 1))};
    __m256i m = _mm256_setzero_si256();
    for (int p = 0; p < 4; ++p) {
      int32_t pair;
      std::memcpy(&pair, x.sums32 + b * 8 + 2 * p, 4);
      m = _mm256_add_epi32(m, _mm256_madd_epi16(mins[p], _mm256_set1_epi32(pair)));
    }
    const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 16)));
    acc[0] = _mm256_fnmadd_ps(_mm256_mul_ps(dmin, _mm256_set1_ps(x.d[b])), _mm256_cvtepi32_ps(m), acc[0]);
    const __m256i lo = _mm256_or_si256(_mm256_and_si256(l0, low4), _mm256_slli_epi16(_mm256_and_si256(h, low2), 4));
    const __m256i hi = _mm256_or_si256(_mm256_and_si256(l1, low4),
                                       _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2), low2), 4));
    __m256i sums[1] = {_mm256_setzero_si256()};
    const uint8_t* codes = blk + 128;
    const int32_t* xb = xw + b * (kQK / 4);
#define TL_PAIR(j)                                                                   \
  if (kMode == kSpread) fetch<kAhead, 288>(blk + 288 * j);                           \
  sub_block<1, 2 * j>(codes, xb, sub_block_scales<2 * j>(lo, hi), sums);             \
  sub_block<1, 2 * j + 1>(codes, xb, sub_block_scales<2 * j + 1>(lo, hi), sums);
    TL_PAIR(0) TL_PAIR(1) TL_PAIR(2) TL_PAIR(3)
#undef TL_PAIR
    add_super_block<1>(blk, x, x.num_blocks, b, sums, acc);
  }
  _mm256_storeu_ps(out, acc[0]);
}

static int64_t g_group_bytes;
void stream(const uint8_t* g, const ActK&, const int32_t*, float* out) {
  __m256i acc = _mm256_setzero_si256();
  for (int64_t i = 0; i < g_group_bytes; i += 64) acc = _mm256_add_epi64(acc, _mm256_add_epi64(load256(g + i), load256(g + i + 32)));
  out[0] = static_cast<float>(_mm256_extract_epi32(acc, 0));
}

int main(int argc, char** argv) {
  const bool is_q4 = argc > 1 && argv[1][0] == '4';
  const int rounds = argc > 2 ? atoi(argv[2]) : 6;
  const int64_t in = argc > 3 ? atoi(argv[3]) : 2048, nsb = in / kQK, layer_groups = (argc > 4 ? atoi(argv[4]) : 8192) / 8;
  g_group_bytes = nsb * (is_q4 ? kGroupBlockBytes : kQ6GroupBlockBytes);
  const int64_t layer_bytes = layer_groups * g_group_bytes, num_layers = (320ll << 20) / layer_bytes;
  const size_t num_bytes = ((num_layers * layer_bytes) >> 21 << 21) + (4 << 20);
  uint8_t* w = static_cast<uint8_t*>(std::aligned_alloc(2 << 20, num_bytes));
  madvise(w, num_bytes, MADV_HUGEPAGE);
  std::mt19937 rng(0);
  for (size_t i = 0; i < num_bytes; i += 4) { const uint32_t r = rng(); std::memcpy(w + i, &r, 4); }
  std::vector<int8_t> q(in);
  for (auto& v : q) v = static_cast<int8_t>(rng() % 255 - 127);
  std::vector<float> d(nsb, 0.01f);
  std::vector<int16_t> s16(nsb * 16, 48), s32(nsb * 8, 96);
  std::vector<int32_t> xw(in / 4);
  std::memcpy(xw.data(), q.data(), in);  // one token: its words in order
  const ActK a{q.data(), d.data(), s16.data(), s32.data(), nsb};
  using Fn = void (*)(const uint8_t*, const ActK&, const int32_t*, float*);
  const std::vector<std::pair<const char*, Fn>> variants = is_q4
      ? std::vector<std::pair<const char*, Fn>>{
            {"stream", stream},
            {"header", [](const uint8_t* g, const ActK& x, const int32_t* v, float* o) { dot_q4_k_x8<1>(g, x, x.num_blocks, v, o); }},
            {"block4608", q4<kBlock, 4608>}, {"spread2304", q4<kSpread, 2304>}, {"spread1152", q4<kSpread, 1152>},
            {"spread576", q4<kSpread, 576>}, {"none", q4<kNone, 0>}}
      : std::vector<std::pair<const char*, Fn>>{
            {"stream", stream},
            {"header", [](const uint8_t* g, const ActK& x, const int32_t* v, float* o) { dot_q6_k_x8<1>(g, x, x.num_blocks, v, o); }},
            {"block4608", q6<kBlock, 4608>}, {"spread3360", q6<kSpread, 3360>}, {"spread1680", q6<kSpread, 1680>},
            {"spread1024", q6<kSpread, 1024>}, {"none", q6<kNone, 0>}};
  const int num_variants = static_cast<int>(variants.size());
  std::vector<std::vector<double>> rates(num_variants), shares(num_variants);
  volatile float sink = 0;
  int64_t pass = 0;
  for (int r = 0; r < rounds; ++r) {
    std::vector<std::vector<double>> round_rates(num_variants);
    for (int64_t layer = 0; layer < num_layers; ++layer) {
      for (int k = 0; k < num_variants; ++k, ++pass) {
        const int v = static_cast<int>((k + r + layer) % num_variants);  // each variant in every slot
        const uint8_t* base = w + (pass % num_layers) * layer_bytes;
        double start = 0;
#pragma omp parallel num_threads(2)
        {
#pragma omp barrier
#pragma omp master
          start = now();
          const int id = omp_get_thread_num();
          float out[8], total = 0;
          for (int64_t g = id * layer_groups / 2; g < (id + 1) * layer_groups / 2; ++g) {
            variants[v].second(base + g * g_group_bytes, a, xw.data(), out);
            total += out[0];
          }
          sink = sink + total;
#pragma omp barrier
        }
        round_rates[v].push_back(layer_bytes / (now() - start) / 1e9);
      }
    }
    for (auto& x : round_rates) std::sort(x.begin(), x.end());
    for (int v = 0; v < num_variants; ++v) {
      rates[v].insert(rates[v].end(), round_rates[v].begin(), round_rates[v].end());
      shares[v].push_back(round_rates[v][round_rates[v].size() / 2] / round_rates[0][round_rates[0].size() / 2]);
    }
  }
  printf("%s groups, one token, two threads, %d rounds of %lld layers (%.1f MB each)\n", is_q4 ? "Q4_K" : "Q6_K", rounds,
         static_cast<long long>(num_layers), layer_bytes / 1e6);
  for (int v = 0; v < num_variants; ++v) {
    std::sort(rates[v].begin(), rates[v].end());
    std::sort(shares[v].begin(), shares[v].end());
    printf("%-11s median %5.1f GB/s  of stream (rounds' medians) %.2f-%.2f\n", variants[v].first,
           rates[v][rates[v].size() / 2], shares[v].front(), shares[v].back());
  }
}
