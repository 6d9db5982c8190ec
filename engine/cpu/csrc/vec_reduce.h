// Small vector helpers shared by the attention and sampling kernels: horizontal reductions
// of one ATen vector or one row, and a software prefetch of a run of cache lines.
#pragma once

#include "vec_capability.h"

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <cmath>
#include <cstdint>
#include <limits>

namespace tokenloom_cpu {

using Vec = at::vec::Vectorized<float>;

inline float reduce_add(const Vec& x) {
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_reduce_add_ps(x);
#else
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, x);
#endif
}

inline float reduce_max(const Vec& x) {
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_reduce_max_ps(x);
#else
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, x);
#endif
}

#if defined(CPU_CAPABILITY_AVX2)
// The 8 horizontal sums of v[0..7] in one vector (lane i = the sum of v[i]'s lanes): pairs
// added within 128-bit lanes twice, then the two 128-bit halves across. 9 instructions for
// 8 sums, against about 5 for each sum done alone (reduce_add).
inline __m256 sum_each_of_8(const __m256* v) {
  const __m256 a0 = _mm256_hadd_ps(v[0], v[1]), a1 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 a2 = _mm256_hadd_ps(v[4], v[5]), a3 = _mm256_hadd_ps(v[6], v[7]);
  // b0's lane 4h + j: v[j]'s sum over 128-bit half h (j < 4); b1 the same for v[4..7]
  const __m256 b0 = _mm256_hadd_ps(a0, a1), b1 = _mm256_hadd_ps(a2, a3);
  return _mm256_add_ps(_mm256_permute2f128_ps(b0, b1, 0x20), _mm256_permute2f128_ps(b0, b1, 0x31));
}
#endif

// The largest of x[0 .. n), by vectors; NaN if any is (torch's max), -inf for n = 0.
inline float row_max(const float* x, int64_t n) {
  float best = -std::numeric_limits<float>::infinity();
  int64_t i = 0;
  if (n >= Vec::size()) {
    Vec acc = Vec::loadu(x);
    for (i = Vec::size(); i + Vec::size() <= n; i += Vec::size()) acc = at::vec::maximum(acc, Vec::loadu(x + i));
    best = reduce_max(acc);
  }
  for (; i < n; ++i) best = (x[i] > best || std::isnan(x[i])) ? x[i] : best;
  return best;
}

// Blocks lie anywhere in the KV pool, so the hardware prefetcher cannot guess the next one.
// kLocality is __builtin_prefetch's: 3 into L1 (prefetcht0 on x86), 2 into L2 (prefetcht1).
template <int kLocality = 3>
inline void prefetch_rows(const void* start, int64_t num_bytes) {
  const char* p = static_cast<const char*>(start);
  for (int64_t offset = 0; offset < num_bytes; offset += 64) __builtin_prefetch(p + offset, 0, kLocality);
}

}  // namespace tokenloom_cpu
