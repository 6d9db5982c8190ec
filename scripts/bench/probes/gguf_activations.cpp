// Probe: Q4_K's matmul with int8 activations (the kernel's 8-row groups, gguf_dot_x8.h) against
// fp32 activations (codes widened to fp32, four FMA chains a token), on one core with the
// weights in L2, so it times the compute alone (the memory's rate is scripts/bench/gguf_kernels.py's).
// JSON out, GB/s of weights at 1 and 4 tokens:
//   g++ -O3 -march=native -I engine/cpu/csrc/gguf -o /tmp/gguf_activations scripts/bench/probes/gguf_activations.cpp
//   flock /tmp/bench.lock /tmp/gguf_activations
#include "gguf_dot_x8.h"
#include <chrono>
#include <cstdio>
#include <vector>
#include <random>
using namespace tokenloom_gguf;

template <int T>
void dot_f32(const uint8_t* row, const float* x, int64_t nsb, int64_t in, float* out) {
  const __m256i low4 = _mm256_set1_epi8(0x0f);
  __m256 acc[T][4];  // four chains a token: FMA's latency is not the limit
  for (int t = 0; t < T; ++t) for (int k = 0; k < 4; ++k) acc[t][k] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nsb; ++b) {
    const uint8_t* blk = row + b * 144;
    const float d = half_at(blk), dmin = half_at(blk + 2);
    alignas(16) uint8_t sm[16];
    _mm_store_si128((__m128i*)sm, k_scales_mins(blk + 4));
    for (int j = 0; j < 4; ++j) {
      const __m256i bits = load256(blk + 16 + 32 * j);
      const __m256i nib[2] = {_mm256_and_si256(bits, low4), _mm256_and_si256(_mm256_srli_epi16(bits, 4), low4)};
      for (int h = 0; h < 2; ++h) {
        const int s = 2 * j + h;
        __m256 w[4];
        const __m128i lo = _mm256_castsi256_si128(nib[h]), hi = _mm256_extracti128_si256(nib[h], 1);
        w[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
        w[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
        w[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
        w[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
        const __m256 scale = _mm256_set1_ps(d * sm[s]), off = _mm256_set1_ps(dmin * sm[8 + s]);
        for (int k = 0; k < 4; ++k) w[k] = _mm256_fmsub_ps(w[k], scale, off);
        for (int t = 0; t < T; ++t) {
          const float* xs = x + t * in + b * 256 + 32 * s;
          for (int k = 0; k < 4; ++k) acc[t][k] = _mm256_fmadd_ps(w[k], _mm256_loadu_ps(xs + 8 * k), acc[t][k]);
        }
      }
    }
  }
  for (int t = 0; t < T; ++t) out[t] = hsum(_mm256_add_ps(_mm256_add_ps(acc[t][0], acc[t][1]), _mm256_add_ps(acc[t][2], acc[t][3])));
}

int main() {
  const int64_t in = 2048, rows = 256, nsb = in / 256;  // 256 x 2048 Q4_K: 295 KB, in L2 (512 KB)
  std::mt19937 rng(0);
  std::vector<uint8_t> w(rows * nsb * 144);
  for (auto& v : w) v = rng() & 0xff;
  for (int64_t i = 0; i < rows * nsb; ++i) { w[i * 144] = 0x1e; w[i * 144 + 1] = 0x20; w[i * 144 + 2] = 0x1e; w[i * 144 + 3] = 0x20; }
  std::vector<float> x(4 * in, 0.5f);
  std::vector<int8_t> q(4 * in, 3);
  std::vector<float> dx(4 * nsb, 0.01f);
  std::vector<int16_t> s16(4 * nsb * 16, 48), s32(4 * nsb * 8, 96);
  const ActK a{q.data(), dx.data(), s16.data(), s32.data(), nsb};
  const std::vector<int32_t> xw(4 * in / 4, 0x03030303);  // q's words, tokens interleaved (all 3s alike)
  float out[64];
  volatile float sink = 0;
  auto time = [&](auto&& f) {
    for (int i = 0; i < 50; ++i) f();
    auto t0 = std::chrono::steady_clock::now();
    const int n = 2000;
    for (int i = 0; i < n; ++i) f();
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / n;
  };
  const double bytes = rows * nsb * 144.0;
  double t1 = time([&] { for (int64_t g = 0; g < rows / 8; ++g) { dot_q4_k_x8<1>(w.data() + g * nsb * 1152, a, nsb, xw.data(), out); sink = out[0]; } });
  double t4 = time([&] { for (int64_t g = 0; g < rows / 8; ++g) { dot_q4_k_x8<4>(w.data() + g * nsb * 1152, a, nsb, xw.data(), out); sink = out[0]; } });
  double f1 = time([&] { for (int64_t r = 0; r < rows; ++r) { dot_f32<1>(w.data() + r * nsb * 144, x.data(), nsb, in, out); sink = out[0]; } });
  double f4 = time([&] { for (int64_t r = 0; r < rows; ++r) { dot_f32<4>(w.data() + r * nsb * 144, x.data(), nsb, in, out); sink = out[0]; } });
  std::printf("{\"int8_x8_1_gb_s\": %.1f, \"int8_x8_4_gb_s\": %.1f, \"fp32_1_gb_s\": %.1f, \"fp32_4_gb_s\": %.1f}\n",
              bytes / t1 / 1e9, bytes / t4 / 1e9, bytes / f1 / 1e9, bytes / f4 / 1e9);
}
