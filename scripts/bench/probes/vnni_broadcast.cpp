// Probe: what a group kernel's activation broadcast costs beside vpdpbusd (AVX512-VNNI), one
// core, no memory traffic (the weights and activations sit in L1; what gguf_dot_x16.h is built on).
// Billions of vpdpbusd a second:
//   ymm_registers    256-bit, weights and activations in registers: the instruction's own rate
//   ymm_broadcast    256-bit, each against its own vpbroadcastd from memory (8 rows a group, as
//                    one group of gguf_dot_x8.h's layout would run on VNNI)
//   ymm_embedded     the same with the broadcast as the instruction's {1to8} memory operand
//   ymm_prebroadcast activations laid out broadcast, a 32-byte memory operand each
//   zmm_broadcast    512-bit (two groups, gguf_dot_x16.h), each against its own vpbroadcastd:
//                    twice the products of a ymm one
// Eight accumulators each; the weights' nibbles masked once per eight.
//   g++ -O3 -march=native -o /tmp/vnni_broadcast scripts/bench/probes/vnni_broadcast.cpp && /tmp/vnni_broadcast
#include <immintrin.h>

#include <cstdint>
#include <cstdio>
#include <ctime>

static double now() {
  timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

alignas(64) static int32_t kX[8192 * 8];
alignas(64) static uint8_t kW[8192];
constexpr long kN = 20000000L;

__attribute__((noinline)) double ymm_registers() {
  __m256i a[8];
  for (auto& v : a) v = _mm256_setzero_si256();
  __m256i w = _mm256_set1_epi8(3), x = _mm256_set1_epi8(5);
  const double t = now();
  for (long n = 0; n < kN; ++n) {
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) a[i] = _mm256_dpbusd_epi32(a[i], w, x);
    asm volatile("" : "+x"(w), "+x"(x));
  }
  const double s = now() - t;
  for (int i = 1; i < 8; ++i) a[0] = _mm256_add_epi32(a[0], a[i]);
  asm volatile("" ::"x"(a[0]));
  return 8.0 * kN / s / 1e9;
}

template <int kMode>  // 0: vpbroadcastd, 1: {1to8}, 2: pre-broadcast 32-byte operands
__attribute__((noinline)) double ymm_memory() {
  __m256i a[8];
  for (auto& v : a) v = _mm256_setzero_si256();
  const double t = now();
  for (long n = 0; n < kN; ++n) {
    const __m256i w = _mm256_and_si256(_mm256_load_si256(reinterpret_cast<const __m256i*>(kW + (n & 63) * 32)),
                                       _mm256_set1_epi8(15));
    const int32_t* p = kX + (n & 255) * 8;
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) {
      if (kMode == 0) a[i] = _mm256_dpbusd_epi32(a[i], w, _mm256_set1_epi32(p[i]));
      if (kMode == 1) asm("vpdpbusd %c2(%1)%{1to8%}, %3, %0" : "+v"(a[i]) : "r"(p), "i"(4 * i), "v"(w));
      if (kMode == 2) {
        const __m256i* q = reinterpret_cast<const __m256i*>(kX) + ((n * 8) & 767);
        a[i] = _mm256_dpbusd_epi32(a[i], w, _mm256_load_si256(q + i));
      }
    }
  }
  const double s = now() - t;
  for (int i = 1; i < 8; ++i) a[0] = _mm256_add_epi32(a[0], a[i]);
  asm volatile("" ::"x"(a[0]));
  return 8.0 * kN / s / 1e9;
}

__attribute__((noinline)) double zmm_broadcast() {
  __m512i a[8];
  for (auto& v : a) v = _mm512_setzero_si512();
  const double t = now();
  for (long n = 0; n < kN; ++n) {
    const __m512i w = _mm512_and_si512(_mm512_load_si512(kW + (n & 63) * 64), _mm512_set1_epi8(15));
    const int32_t* p = kX + (n & 255) * 8;
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) a[i] = _mm512_dpbusd_epi32(a[i], w, _mm512_set1_epi32(p[i]));
  }
  const double s = now() - t;
  for (int i = 1; i < 8; ++i) a[0] = _mm512_add_epi32(a[0], a[i]);
  asm volatile("" ::"v"(a[0]));
  return 8.0 * kN / s / 1e9;
}

int main() {
  for (int round = 0; round < 2; ++round) {
    std::printf("ymm_registers %.2f  ymm_broadcast %.2f  ymm_embedded %.2f  ymm_prebroadcast %.2f  zmm_broadcast %.2f\n",
                ymm_registers(), ymm_memory<0>(), ymm_memory<1>(), ymm_memory<2>(), zmm_broadcast());
  }
}
