// share_out: items [0, num_items) handed to torch's intra-op threads, or, called from the
// master of a decode step's WorkPool (work_pool.h), to the pool's threads, the master going on
// once every item is done. The bf16 slabs and the int8/int4 panels share out their output
// features this way; parallel_for (at the end) shares out other kernels' ranges in a pool.
//
// Each thread owns one contiguous part of the items and works through it front to back, a
// chunk at a time, so a small step's weights stream from memory as one run per thread: the
// hardware prefetcher and the kernels' own prefetch run on past each chunk's end into the
// next. A thread done with its own part takes chunks from the back of the part with the most
// left, so when a thread loses its core for a while (a server's frontend or client runs on
// the same cores) the others take over its remaining chunks instead of waiting for it at the
// end of the region. (Chunks from one shared counter balanced as well, but each thread's run
// then broke at every chunk, and a one-token step's weights streamed measurably slower:
// docs/cpu-kernels.md.) A thread's pieces shrink as its part runs out (half of what is left,
// at most a chunk), so both threads' last pieces are small and they leave the region close
// together: whole chunks to the end left one thread waiting up to a chunk's time in every region.
//
// A caller may give a prologue of `num_pieces` pieces of work that must all be done before
// any item (the bf16 slabs copy the step's activations into their interleaved layout that
// way, in the region that then reads them). The threads claim pieces from one counter and
// wait until all are done, so one that has lost its core holds up the other by at most the
// piece it was running, not by all of its share.
#pragma once

#include "work_pool.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace tokenloom_cpu {

namespace share_out_detail {

// One thread's part: [front, back) left to do, both in one word so that the owner (taking
// from the front) and a thief (taking from the back) agree on who takes what.
class alignas(64) Part {  // a cache line each: the threads' CAS loops do not share one
 public:
  void reset(int64_t front, int64_t back) { state_.store(pack(front, back), std::memory_order_relaxed); }

  int64_t num_left() const {
    const uint64_t s = state_.load(std::memory_order_relaxed);
    return static_cast<int64_t>(s & 0xffffffffu) - static_cast<int64_t>(s >> 32);
  }

  // The next up to `chunk` items from the front (the owner) or the back (a thief), as
  // [begin, end); begin == end when nothing is left.
  void take(int64_t chunk, bool from_back, int64_t* begin, int64_t* end) {
    uint64_t s = state_.load(std::memory_order_relaxed);
    while (true) {
      const int64_t front = static_cast<int64_t>(s >> 32), back = static_cast<int64_t>(s & 0xffffffffu);
      if (front >= back) {
        *begin = *end = 0;
        return;
      }
      // Smaller pieces near the part's end, so the threads' last pieces end close together.
      const int64_t n = std::min(chunk, std::max<int64_t>(1, (back - front) / 2));
      const uint64_t next = from_back ? pack(front, back - n) : pack(front + n, back);
      if (state_.compare_exchange_weak(s, next, std::memory_order_relaxed)) {
        *begin = from_back ? back - n : front;
        *end = from_back ? back : front + n;
        return;
      }
    }
  }

 private:
  static uint64_t pack(int64_t front, int64_t back) {
    return (static_cast<uint64_t>(front) << 32) | static_cast<uint64_t>(back);
  }
  std::atomic<uint64_t> state_{0};
};

}  // namespace share_out_detail

// Calls before(j) for every j in [0, num_pieces), then, once all have returned, run(begin,
// end) on disjoint ranges that together cover [0, num_items) (fewer than 2^31), each at most
// `chunk` items, about kChunksPerThread chunks to a thread's part. In a WorkPool's region
// (work_pool.h) on its threads, else on torch's.
template <int64_t kChunksPerThread, typename Before, typename Run>
void share_out_ranges(int64_t num_items, int64_t num_pieces, const Before& before, const Run& run,
                      int64_t min_chunk = 1) {
  using share_out_detail::Part;
  if (num_items == 0) return;
  WorkPool* pool = active_pool();
  const int64_t num_threads = std::min<int64_t>(pool != nullptr ? pool->num_threads() : at::get_num_threads(),
                                                num_items);
  const int64_t chunk = std::max<int64_t>(min_chunk, num_items / (num_threads * kChunksPerThread));
  std::unique_ptr<Part[]> parts(new Part[num_threads]);
  for (int64_t t = 0; t < num_threads; ++t) parts[t].reset(t * num_items / num_threads, (t + 1) * num_items / num_threads);
  std::atomic<int64_t> next_piece{0}, num_pieces_done{0}, num_items_done{0};
  const auto run_counted = [&](int64_t begin, int64_t end) {
    run(begin, end);
    if (pool != nullptr) num_items_done.fetch_add(end - begin, std::memory_order_release);
  };
  // Parts [first_part, last_part) are the caller's own; then it takes the others' leftovers.
  const auto body = [&](int64_t first_part, int64_t last_part) {
    for (int64_t j = next_piece.fetch_add(1, std::memory_order_relaxed); j < num_pieces;
         j = next_piece.fetch_add(1, std::memory_order_relaxed)) {
      struct Counted {  // a piece that throws still counts, so no thread waits for it forever
        std::atomic<int64_t>& num_done;
        ~Counted() { num_done.fetch_add(1, std::memory_order_release); }
      } counted{num_pieces_done};
      before(j);
    }
    // A piece's thread that lost its core holds the others up by that piece.
    spin_until([&] { return num_pieces_done.load(std::memory_order_acquire) >= num_pieces; });
    int64_t begin, end;
    for (int64_t t = first_part; t < last_part; ++t) {
      for (parts[t].take(chunk, false, &begin, &end); begin < end; parts[t].take(chunk, false, &begin, &end)) {
        run_counted(begin, end);
      }
    }
    while (true) {  // the others' leftovers, from the fullest part's back
      int64_t victim = -1, most = 0;
      for (int64_t t = 0; t < num_threads; ++t) {
        const int64_t left = parts[t].num_left();
        if (left > most) victim = t, most = left;
      }
      if (victim < 0) return;
      parts[victim].take(chunk, true, &begin, &end);
      run_counted(begin, end);
    }
  };
  if (pool != nullptr) {
    // The master goes on once every item is done, whether or not each helper has come.
    pool->run([&](int64_t t) { t < num_threads ? body(t, t + 1) : body(num_threads, num_threads); },
              [&] { return num_items_done.load(std::memory_order_acquire) >= num_items; });
    return;
  }
  // A call may get several parts (a nested region runs the whole range on one thread).
  at::parallel_for(0, num_threads, 1, body);
}

// share_out_ranges, item by item.
template <int64_t kChunksPerThread, typename Before, typename Fn>
void share_out(int64_t num_items, int64_t num_pieces, const Before& before, const Fn& fn) {
  share_out_ranges<kChunksPerThread>(num_items, num_pieces, before, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) fn(i);
  });
}

// share_out without a prologue.
template <int64_t kChunksPerThread, typename Fn>
void share_out(int64_t num_items, const Fn& fn) {
  share_out<kChunksPerThread>(num_items, 0, [](int64_t) {}, fn);
}

}  // namespace tokenloom_cpu

namespace tokenloom_cpu {

// at::parallel_for in a kernel a decode step runs: in a WorkPool's region its ranges are
// shared out on the pool (each at least `grain` items; fewer items than that run here),
// elsewhere it is at::parallel_for.
template <typename F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  if (active_pool() == nullptr) {
    at::parallel_for(begin, end, grain, f);
    return;
  }
  if (end - begin <= std::max<int64_t>(grain, 1)) {
    if (end > begin) f(begin, end);
    return;
  }
  share_out_ranges<4>(end - begin, 0, [](int64_t) {}, [&](int64_t b, int64_t e) { f(begin + b, begin + e); },
                      std::max<int64_t>(grain, 1));
}

}  // namespace tokenloom_cpu
