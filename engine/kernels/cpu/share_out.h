// share_out: items [0, num_items) handed to torch's intra-op threads in chunks from a shared
// counter rather than split in equal parts up front: when a thread loses its core for a
// while (a server's frontend or client runs on the same cores), the others take over its
// remaining chunks instead of waiting for it at the end of the region. The bf16 slabs and
// the int8 panels share out their output features this way.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace tokenloom_cpu {

// Calls fn(i) once for every i in [0, num_items), about kChunksPerThread chunks a thread.
template <int64_t kChunksPerThread, typename Fn>
void share_out(int64_t num_items, const Fn& fn) {
  if (num_items == 0) return;
  const int64_t num_threads = std::min<int64_t>(at::get_num_threads(), num_items);
  const int64_t chunk = std::max<int64_t>(1, num_items / (num_threads * kChunksPerThread));
  std::atomic<int64_t> next{0};
  at::parallel_for(0, num_threads, 1, [&](int64_t, int64_t) {
    for (int64_t first = next.fetch_add(chunk); first < num_items; first = next.fetch_add(chunk)) {
      for (int64_t i = first; i < std::min(first + chunk, num_items); ++i) fn(i);
    }
  });
}

}  // namespace tokenloom_cpu
