// Probe: how fast two threads read one layer's KV blocks from memory, by access pattern, with
// the decode attention kernel's prefetch (paged_decode_attention.cpp) and optional work per line.
// The 1B's cache: blocks of 16 tokens x 8 KV heads x 64 dims in bf16 (16 KB), K and V each in
// random-order blocks of a 64 MB pool on 2 MB pages, a 64 MB buffer read before every call so
// each call reads from memory, as a decode step's attention does after its layer's weights.
//   strips   each thread its four KV heads, one at a time: a 2 KB strip of every block, K then V
//            (the kernel's tasks)
//   heads4   each thread its four heads at once: 8 KB of every block
//   blocks   each thread half the blocks, whole (the sequence split between the threads)
// Every block `ahead` bytes on is prefetched into L2 (prefetcht1; argv[2] 0: prefetcht0,
// 3: none), all its lines before the block's work, or (argv[5] = 1) a few at a time through it.
// argv[4] FMAs per 64-byte line stand in for the kernel's arithmetic.
//   g++ -O3 -march=native -fopenmp -o /tmp/kv_read_patterns scripts/bench/probes/kv_read_patterns.cpp
//   flock /tmp/bench.lock /tmp/kv_read_patterns 640 1 8192 0 0   # context, hint, ahead, work, spread
#include <immintrin.h>
#include <omp.h>
#include <sys/mman.h>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

constexpr int kHeads = 8, kBlock = 16, kDim = 64;
constexpr int kBlockBytes = kHeads * kBlock * kDim * 2;  // 16 KB
constexpr int kStrip = kBlock * kDim * 2;                 // one head's 2 KB
constexpr int kLayers = 16;

static int g_work = 0;

static inline __m512i read_lines(const char* p, int64_t n, __m512i acc) {
  for (int64_t i = 0; i < n; i += 64) {
    const __m512 x = _mm512_castsi512_ps(_mm512_loadu_si512(p + i));
    __m512 a0 = x, a1 = x, a2 = x, a3 = x;
    for (int w = 0; w < g_work; w += 4) {
      a0 = _mm512_fmadd_ps(a0, x, x), a1 = _mm512_fmadd_ps(a1, x, x);
      a2 = _mm512_fmadd_ps(a2, x, x), a3 = _mm512_fmadd_ps(a3, x, x);
    }
    acc = _mm512_add_epi32(acc, _mm512_castps_si512(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3))));
  }
  return acc;
}

static inline void prefetch(const char* p, int64_t n, int hint) {
  for (int64_t i = 0; i < n; i += 64) {
    if (hint == 0) _mm_prefetch(p + i, _MM_HINT_T0);
    else if (hint == 1) _mm_prefetch(p + i, _MM_HINT_T1);
  }
}

int main(int argc, char** argv) {
  const int context = argc > 1 ? atoi(argv[1]) : 640, num_blocks = context / kBlock;
  const int hint = argc > 2 ? atoi(argv[2]) : 1;
  const int ahead = argc > 3 ? atoi(argv[3]) : 8192;
  g_work = argc > 4 ? atoi(argv[4]) : 0;
  const bool spread = argc > 5 && atoi(argv[5]) == 1;
  const int64_t pool_blocks = 4096;
  char* pool = static_cast<char*>(aligned_alloc(2 << 20, pool_blocks * kBlockBytes));
  madvise(pool, pool_blocks * kBlockBytes, MADV_HUGEPAGE);
  memset(pool, 1, pool_blocks * kBlockBytes);
  std::vector<int> ids(pool_blocks);
  for (int i = 0; i < pool_blocks; ++i) ids[i] = i;
  std::shuffle(ids.begin(), ids.end(), std::mt19937(1));
  std::vector<std::vector<int>> k_tables(kLayers), v_tables(kLayers);
  for (int l = 0, c = 0; l < kLayers; ++l) {
    for (int b = 0; b < num_blocks; ++b) k_tables[l].push_back(ids[c++]), v_tables[l].push_back(ids[c++]);
  }
  std::vector<char> evict(64 << 20, 2);
  volatile int sink = 0;
  auto call = [&](int pattern, int l) {
#pragma omp parallel num_threads(2)
    {
      const int t = omp_get_thread_num();
      __m512i acc = _mm512_setzero_si512();
      auto walk = [&](const std::vector<int>& table, int64_t offset, int64_t bytes, int b0, int b1) {
        const int distance = std::max<int64_t>(1, (ahead + bytes - 1) / bytes);
        for (int b = b0; b < b1; ++b) {
          const char* cur = pool + int64_t{table[b]} * kBlockBytes + offset;
          const char* next = b + distance < b1 && hint != 3 ? pool + int64_t{table[b + distance]} * kBlockBytes + offset
                                                             : nullptr;
          if (spread && next != nullptr) {
            for (int64_t i = 0; i < bytes; i += 256) prefetch(next + i, 256, hint), acc = read_lines(cur + i, 256, acc);
            continue;
          }
          if (next != nullptr) prefetch(next, bytes, hint);
          acc = read_lines(cur, bytes, acc);
        }
      };
      if (pattern == 0) {
        for (int h = 4 * t; h < 4 * t + 4; ++h) {
          walk(k_tables[l], h * kStrip, kStrip, 0, num_blocks), walk(v_tables[l], h * kStrip, kStrip, 0, num_blocks);
        }
      } else if (pattern == 1) {
        walk(k_tables[l], 4 * t * kStrip, 4 * kStrip, 0, num_blocks);
        walk(v_tables[l], 4 * t * kStrip, 4 * kStrip, 0, num_blocks);
      } else {
        const int b0 = t * num_blocks / 2, b1 = (t + 1) * num_blocks / 2;
        walk(k_tables[l], 0, kBlockBytes, b0, b1), walk(v_tables[l], 0, kBlockBytes, b0, b1);
      }
      sink += _mm512_reduce_add_epi32(acc);
    }
  };
  const char* names[] = {"strips", "heads4", "blocks"};
  for (int round = 0; round < 3; ++round) {
    for (int pattern = 0; pattern < 3; ++pattern) {
      std::vector<double> us;
      for (int i = 0; i < 200; ++i) {
        for (size_t j = 0; j < evict.size(); j += 64) sink += evict[j];
        const auto start = std::chrono::steady_clock::now();
        call(pattern, i % kLayers);
        us.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count());
      }
      std::sort(us.begin(), us.end());
      const double median = us[us.size() / 2], bytes = 2.0 * num_blocks * kBlockBytes;
      printf("context %d hint %d ahead %d work %d spread %d  %-6s median %6.1f us  %5.1f GB/s\n", context, hint, ahead,
             g_work, int(spread), names[pattern], median, bytes / median / 1e3);
    }
  }
}
