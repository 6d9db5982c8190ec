// Probe: Q6_K's groups (gguf_dot_q6_k_x8.h) against its rows (gguf_dot.h's dot_q6_k, passes of
// at most 4 tokens over 8 rows, as the op runs them) and a plain read of the same bytes
// (stream), one and two threads, 1, 2, 4 and 8 tokens, each layer-sized pass timed alone (fast
// decile). Weights cycled through 320 MB (from memory), or with `l2` one layer of 8 groups
// (256 KB at 2048 inputs: the kernels' compute alone).
//   g++ -O3 -march=native -fopenmp -I engine/cpu/csrc/gguf -o /tmp/gguf_q6k_groups \
//     scripts/bench/probes/gguf_q6k_groups.cpp
//   flock /tmp/bench.lock /tmp/gguf_q6k_groups 2048 8192 [l2]   # inputs, outputs (a layer's shape)
#include "gguf_dot_q6_k_x8.h"
#include <omp.h>
#include <sys/mman.h>
#include <cstdlib>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>
static double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
int main(int argc, char** argv) {
  using namespace tokenloom_gguf;
  const int64_t in = argc > 1 ? atoi(argv[1]) : 2048;
  const bool l2 = argc > 3 && std::string(argv[3]) == "l2";
  const int64_t out_rows = l2 ? 64 : (argc > 2 ? atoi(argv[2]) : 8192);
  const int64_t nsb = in / 256, group_bytes = nsb * 1680, layer_groups = out_rows / 8;
  const int64_t num_layers = l2 ? 64 : std::max<int64_t>(2, (320ll << 20) / (layer_groups * group_bytes));
  const int64_t stored_layers = l2 ? 1 : num_layers;
  std::mt19937 rng(0);
  // On 2 MB pages, as the engine places a GGUF's blocks (4 KB pages stop the hardware prefetcher at each page's end).
  const size_t num_bytes = ((stored_layers * layer_groups * group_bytes + 65536) >> 21 << 21) + (2 << 20);
  uint8_t* w_data = static_cast<uint8_t*>(std::aligned_alloc(2 << 20, num_bytes));
  madvise(w_data, num_bytes, MADV_HUGEPAGE);
  struct Bytes { uint8_t* p; size_t n; uint8_t* data() { return p; } size_t size() const { return n; } uint8_t& operator[](size_t i) { return p[i]; } } w{w_data, num_bytes};
  for (size_t i = 0; i < w.size(); i += 4) { uint32_t r = rng(); memcpy(&w[i], &r, 4); }
  std::vector<int8_t> q(8 * in); for (auto& v : q) v = (int8_t)(rng() % 255 - 127);
  std::vector<float> dx(8 * nsb, 0.01f);
  std::vector<int16_t> s16(8 * nsb * 16, 48), s32(8 * nsb * 8, 96);
  std::vector<int32_t> xw[9];
  for (int T = 1; T <= 8; ++T) { xw[T].resize(in / 4 * T); for (int t = 0; t < T; ++t) for (int k = 0; k < in / 4; ++k) memcpy(&xw[T][k * T + t], &q[t * in + 4 * k], 4); }
  const ActK a{q.data(), dx.data(), s16.data(), s32.data(), nsb};
  volatile float sink = 0;
  auto run_group = [&](int kind, int T, const uint8_t* g, float* out) {
    if (kind == 0) {  // stream
      __m256i acc = _mm256_setzero_si256();
      for (int64_t i = 0; i < group_bytes; i += 64) acc = _mm256_add_epi64(acc, _mm256_add_epi64(load256(g + i), load256(g + i + 32)));
      out[0] = _mm256_extract_epi32(acc, 0); return;
    }
    if (kind == 1) {  // rows: 8 rows of the file's layout, passes of at most 4 tokens
      for (int t0 = 0; t0 < T; t0 += 4, out += 32) {
        const int n = std::min(4, T - t0);
        const ActK k{a.q + t0 * nsb * 256, a.d + t0 * nsb, a.sums16 + t0 * nsb * 16, a.sums32 + t0 * nsb * 8, nsb};
        for (int r = 0; r < 8; ++r) {
          const uint8_t* row = g + r * nsb * 210;
          float* y = out + 4 * r;
          switch (n) { case 1: dot_q6_k<1>(row, k, nsb, y); break; case 2: dot_q6_k<2>(row, k, nsb, y); break;
                       case 3: dot_q6_k<3>(row, k, nsb, y); break; default: dot_q6_k<4>(row, k, nsb, y); }
        }
      }
      return;
    }
    switch (T) { case 1: dot_q6_k_x8<1>(g, a, nsb, xw[1].data(), out); break; case 2: dot_q6_k_x8<2>(g, a, nsb, xw[2].data(), out); break;
                 case 4: dot_q6_k_x8<4>(g, a, nsb, xw[4].data(), out); break; default: dot_q6_k_x8<8>(g, a, nsb, xw[8].data(), out); }
  };
  const char* names[3] = {"stream", "rows", "groups"};
  for (int threads = 1; threads <= 2; ++threads) {
    for (int T : {1, 2, 4, 8}) {
      std::vector<double> times[3];
      for (int round = 0; round < 3; ++round)
        for (int k = 0; k < 3; ++k)
          for (int64_t layer = 0; layer < num_layers; ++layer) {
            double s = 0;
            const int64_t base = l2 ? 0 : layer * layer_groups;
            #pragma omp parallel num_threads(threads)
            {
              #pragma omp barrier
              #pragma omp master
              s = now();
              const int id = omp_get_thread_num();
              const int64_t g0 = base + id * layer_groups / threads, g1 = base + (id + 1) * layer_groups / threads;
              float out[64] = {};
              float total = 0;
              for (int64_t g = g0; g < g1; ++g) {
                run_group(k, T, w.data() + g * group_bytes, out);
                for (int i = 0; i < 64; ++i) total += out[i];  // every token's output read: none is dead code
              }
              sink = sink + total;
              #pragma omp barrier
            }
            times[k].push_back(now() - s);
          }
      printf("in %lld out %lld%s threads %d tokens %d:", (long long)in, (long long)out_rows, l2 ? " (L2)" : "", threads, T);
      for (int k = 0; k < 3; ++k) { auto& v = times[k]; std::sort(v.begin(), v.end());
        printf("  %s %.1f GB/s", names[k], layer_groups * group_bytes / v[v.size() / 10] / 1e9); }
      printf("   (fast decile of %lld layers x 3)\n", (long long)num_layers);
    }
  }
}
