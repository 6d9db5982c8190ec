// Probe: does a line that one core brings in (prefetcht0/t1/t2/nta or a plain load) reach the
// other core's later read faster than memory, on this host's L2s and shared L3, and for how
// many MB? Thread B (the decode pool's idle helper while the master runs attention or SiLU)
// touches a region of `size` bytes, then thread A (the master's next matmul) reads it; A's
// read time against the same read with nothing touched before. Regions cycle through 1 GB on
// 2 MB pages, so each starts out of every cache; variants take turns region by region.
// "both" has A read while B prefetches the region's second half (an overlap with no wait).
//   g++ -O3 -march=native -pthread -o /tmp/cross_core_prefetch scripts/bench/probes/cross_core_prefetch.cpp
//   flock /tmp/bench.lock /tmp/cross_core_prefetch 30   # rounds
#include <immintrin.h>
#include <pthread.h>
#include <sched.h>
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

static double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

static void pin(int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
}

enum Touch { kNone, kLoad, kT0, kT1, kT2, kNta, kNumTouch };
static const char* kNames[] = {"cold", "load", "pf_t0", "pf_t1", "pf_t2", "pf_nta"};

static __attribute__((noinline)) int64_t read_all(const uint8_t* p, int64_t n) {
  __m256i acc = _mm256_setzero_si256();
  for (int64_t i = 0; i < n; i += 128) {
    acc = _mm256_xor_si256(acc, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + i)));
    acc = _mm256_xor_si256(acc, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + i + 64)));
    acc = _mm256_xor_si256(acc, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + i + 32)));
    acc = _mm256_xor_si256(acc, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + i + 96)));
  }
  return _mm256_extract_epi64(acc, 0);
}

static __attribute__((noinline)) int64_t touch(const uint8_t* p, int64_t n, Touch t) {
  int64_t s = 0;
  for (int64_t i = 0; i < n; i += 64) {
    const char* c = reinterpret_cast<const char*>(p + i);
    switch (t) {
      case kLoad: s += *reinterpret_cast<const volatile int64_t*>(c); break;
      case kT0: _mm_prefetch(c, _MM_HINT_T0); break;
      case kT1: _mm_prefetch(c, _MM_HINT_T1); break;
      case kT2: _mm_prefetch(c, _MM_HINT_T2); break;
      case kNta: _mm_prefetch(c, _MM_HINT_NTA); break;
      default: break;
    }
  }
  return s;
}

int main(int argc, char** argv) {
  const int rounds = argc > 1 ? atoi(argv[1]) : 20;
  const int64_t total = int64_t{1} << 30;
  uint8_t* buf = static_cast<uint8_t*>(aligned_alloc(int64_t{2} << 20, total));
  madvise(buf, total, MADV_HUGEPAGE);
  for (int64_t i = 0; i < total; i += 8) *reinterpret_cast<int64_t*>(buf + i) = i * 2654435761u;
  const std::vector<int64_t> sizes = {256 << 10, 512 << 10, 1 << 20, 2 << 20, 3 << 20, 4 << 20, 8 << 20, 16 << 20};
  // B's job: 0 idle, 1 touch (region, size, kind) then done, -1 quit.
  std::atomic<int> job{0};
  const uint8_t* region = nullptr;
  int64_t region_bytes = 0;
  Touch kind = kNone;
  std::atomic<double> b_seconds{0};
  std::thread helper([&] {
    pin(1);
    for (;;) {
      int j;
      while ((j = job.load(std::memory_order_acquire)) == 0) _mm_pause();
      if (j < 0) return;
      const double t0 = now();
      volatile int64_t sink = touch(region, region_bytes, kind);
      (void)sink;
      b_seconds.store(now() - t0);
      job.store(0, std::memory_order_release);
    }
  });
  pin(0);
  int64_t offset = 0;
  volatile int64_t sink = 0;
  const int kBoth = kNumTouch;  // B prefetches (t0) the second half while A reads the first
  std::vector<std::vector<std::vector<double>>> a_sec(sizes.size(), std::vector<std::vector<double>>(kNumTouch + 1));
  std::vector<std::vector<std::vector<double>>> b_sec(sizes.size(), std::vector<std::vector<double>>(kNumTouch + 1));
  for (int r = 0; r < rounds; ++r) {
    for (size_t s = 0; s < sizes.size(); ++s) {
      for (int v = 0; v <= kBoth; ++v) {
        const int64_t n = sizes[s];
        if (offset + n > total) offset = 0;
        const uint8_t* p = buf + offset;
        offset += n + (4 << 20);  // a gap: no hardware prefetch carries over
        if (v != kNone && v != kBoth) {
          region = p, region_bytes = n, kind = static_cast<Touch>(v);
          job.store(1, std::memory_order_release);
          while (job.load(std::memory_order_acquire) != 0) _mm_pause();
          b_sec[s][v].push_back(b_seconds.load());
        }
        double t0 = now();
        if (v == kBoth) {
          region = p + n / 2, region_bytes = n / 2, kind = kT0;
          job.store(1, std::memory_order_release);
          sink = sink + read_all(p, n);
          while (job.load(std::memory_order_acquire) != 0) _mm_pause();
        } else {
          sink = sink + read_all(p, n);
        }
        a_sec[s][v].push_back(now() - t0);
      }
    }
  }
  job.store(-1);
  helper.join();
  const auto median = [](std::vector<double> v) {
    if (v.empty()) return 0.0;
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  std::printf("%8s", "MB");
  for (int v = 0; v <= kBoth; ++v) std::printf(" %16s", v == kBoth ? "both(A|B t0)" : kNames[v]);
  std::printf("   (A's read GB/s after B touched; in brackets B's touch GB/s)\n");
  for (size_t s = 0; s < sizes.size(); ++s) {
    std::printf("%8.2f", sizes[s] / 1048576.0);
    for (int v = 0; v <= kBoth; ++v) {
      const double a = sizes[s] / median(a_sec[s][v]) / 1e9;
      const double b = b_sec[s][v].empty() ? 0 : sizes[s] / median(b_sec[s][v]) / 1e9;
      std::printf(" %7.1f [%6.1f]", a, b);
    }
    std::printf("\n");
  }
  return sink == 42;
}
