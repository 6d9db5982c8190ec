// Probe: the Q4_K groups' kernel (gguf_dot_x8.h) reading weights from memory on one and two
// threads at 1, 2, 4 and 8 tokens, beside a plain read of the same bytes (stream) in the same
// run, each layer-sized pass timed alone (fast decile): the kernel without the op's Python and
// hand-out around it. With -DWITH_OLD it also runs an older copy of the headers, renamed to
// namespace old_gguf, in passes of at most 4 tokens as that kernel did (docs/cpu-kernels.md; an
// old copy from after the tokens' interleaved words, whose dot_q4_k_x8 takes them as `xw`):
//   mkdir -p /tmp/old && for f in gguf_dot.h gguf_dot_x8.h; do git show REV:engine/cpu/csrc/gguf/$f \
//     | sed 's/tokenloom_gguf/old_gguf/g; s/"gguf_dot.h"/"old_gguf_dot.h"/' > /tmp/old/old_$f; done
//   g++ -O3 -march=native -fopenmp -DWITH_OLD -I engine/cpu/csrc/gguf -I /tmp/old \
//     -o /tmp/gguf_q4k_groups scripts/bench/probes/gguf_q4k_groups.cpp
//   flock /tmp/bench.lock /tmp/gguf_q4k_groups 2048 8192   # inputs, outputs (a layer's shape)
//   flock /tmp/bench.lock /tmp/gguf_q4k_groups 2048 256 0.5 # cycle 0.5 MB (L2: the kernel's compute rate)
#include "gguf_dot_x8.h"
#ifdef WITH_OLD
#include "old_gguf_dot_x8.h"
#endif
#include <omp.h>
#include <chrono>
#include <cstdio>
#include <vector>
#include <random>
#include <algorithm>
#include <string>
static double now(){return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();}
int main(int argc, char** argv) {
  const int64_t in = argc > 1 ? atoi(argv[1]) : 2048, out_rows = argc > 2 ? atoi(argv[2]) : 8192;
  const int64_t nsb = in / 256, group_bytes = nsb * 1152, layer_groups = out_rows / 8;
  const double cycle_mb = argc > 3 ? atof(argv[3]) : 320.0;  // MB the passes cycle through
  const int64_t num_layers = std::max<int64_t>(argc > 3 ? 1 : 2, static_cast<int64_t>(cycle_mb * (1 << 20)) / (layer_groups * group_bytes));
  std::mt19937 rng(0);
  std::vector<uint8_t> w(num_layers * layer_groups * group_bytes + 65536);
  for (size_t i = 0; i < w.size(); i += 4) { uint32_t r = rng(); memcpy(&w[i], &r, 4); }
  for (int64_t g = 0; g < num_layers * layer_groups * nsb; ++g) for (int k = 0; k < 32; k += 2) { w[g * 1152 + k] = 0x1e; w[g * 1152 + k + 1] = 0x20; }
  std::vector<int8_t> q(8 * in); for (auto& v : q) v = (int8_t)(rng() % 255 - 127);
  std::vector<float> dx(8 * nsb, 0.01f);
  std::vector<int16_t> s16(8 * nsb * 16, 48), s32(8 * nsb * 8, 96);
  std::vector<int32_t> xw[9];
  for (int T = 1; T <= 8; ++T) { xw[T].resize(in / 4 * T); for (int t = 0; t < T; ++t) for (int k = 0; k < in / 4; ++k) memcpy(&xw[T][k * T + t], &q[t * in + 4 * k], 4); }
  const tokenloom_gguf::ActK a{q.data(), dx.data(), s16.data(), s32.data(), nsb};
#ifdef WITH_OLD
  const old_gguf::ActK oa{q.data(), dx.data(), s16.data(), s32.data(), nsb};
#endif
  volatile float sink = 0;
  auto run_group = [&](int kind, int T, const uint8_t* g, float* out) {
    using namespace tokenloom_gguf;
    if (kind == 0) {  // stream
      __m256i acc = _mm256_setzero_si256();
      for (int64_t i = 0; i < group_bytes; i += 64) acc = _mm256_add_epi64(acc, _mm256_add_epi64(load256(g + i), load256(g + i + 32)));
      out[0] = _mm256_extract_epi32(acc, 0); return;
    }
#ifdef WITH_OLD
    if (kind == 1) {  // old: passes of at most 4 tokens
      for (int t0 = 0; t0 < T; t0 += 4) {
        const int n = std::min(4, T - t0);
        const old_gguf::ActK k{oa.q + t0 * nsb * 256, oa.d + t0 * nsb, oa.sums16 + t0 * nsb * 16, oa.sums32 + t0 * nsb * 8, nsb};
        switch (n) { case 1: old_gguf::dot_q4_k_x8<1>(g, k, nsb, xw[n].data(), out); break; case 2: old_gguf::dot_q4_k_x8<2>(g, k, nsb, xw[n].data(), out); break;
                     case 3: old_gguf::dot_q4_k_x8<3>(g, k, nsb, xw[n].data(), out); break; default: old_gguf::dot_q4_k_x8<4>(g, k, nsb, xw[n].data(), out); }
      }
      return;
    }
#endif
    switch (T) { case 1: dot_q4_k_x8<1>(g, a, nsb, xw[1].data(), out); break; case 2: dot_q4_k_x8<2>(g, a, nsb, xw[2].data(), out); break;
                 case 4: dot_q4_k_x8<4>(g, a, nsb, xw[4].data(), out); break; default: dot_q4_k_x8<8>(g, a, nsb, xw[8].data(), out); }
  };
  const char* names[3] = {"stream", "old", "new"};
#ifdef WITH_OLD
  const int num_kinds = 3;
#else
  const int num_kinds = 2;
  names[1] = "new";
#endif
  for (int threads = 1; threads <= 2; ++threads) {
    for (int T : {1, 2, 4, 8}) {
      std::vector<double> times[3];
      for (int64_t round = 0; round < std::max<int64_t>(3, 60 / num_layers); ++round)
        for (int k = 0; k < num_kinds; ++k)
          for (int64_t layer = 0; layer < num_layers; ++layer) {
            double s = 0;
            #pragma omp parallel num_threads(threads)
            {
              #pragma omp barrier
              #pragma omp master
              s = now();
              const int id = omp_get_thread_num();
              const int64_t g0 = layer * layer_groups + id * layer_groups / threads, g1 = layer * layer_groups + (id + 1) * layer_groups / threads;
              float out[64];
              const int kind = num_kinds == 2 && k == 1 ? 2 : k;
              for (int64_t g = g0; g < g1; ++g) run_group(kind, T, w.data() + g * group_bytes, out);
              sink = sink + out[0];
              #pragma omp barrier
            }
            times[k].push_back(now() - s);
          }
      printf("in %lld out %lld threads %d tokens %d:", (long long)in, (long long)out_rows, threads, T);
      for (int k = 0; k < num_kinds; ++k) { auto& v = times[k]; std::sort(v.begin(), v.end());
        printf("  %s %.1f GB/s", names[num_kinds == 2 && k == 1 ? 2 : k], layer_groups * group_bytes / v[v.size() / 10] / 1e9); }
      printf("   (fast decile of %zu passes)\n", times[0].size());
    }
  }
}
