// WorkPool: one OpenMP region around a whole decode step's layers, whose master thread runs
// the layers and whose other threads help with each kernel's items as they come free.
//
// Inside torch's intra-op regions (one per kernel call, a few hundred a step) every thread
// must reach the region's end before the caller goes on. On a host with as many threads as
// cores, a server's frontend or its client takes a core for a while once per token; the
// thread it displaces then holds up every region it is part of, and both cores wait
// (a one-user int8 decode lost as much time as the other processes ran). In the pool's
// region the master posts each kernel's items, works on them itself and goes on as soon as
// every item is done: a helper that has lost its core holds it up by at most the item it
// was running, and one that comes back late finds the items gone and waits for the next.
//
// Kernels reach the pool through active_pool(): the pool of the calling thread's open region,
// or null (then they run on torch's threads as before). share_out.h shares out items on it;
// parallel_for below stands in for at::parallel_for in the kernels a decode step runs.
// The quantized kernels are another shared library: they hold their own pointer to this
// library's pool, set once through use_work_pool (engine/cpu/decode_stack.py).
#pragma once

#include <ATen/Parallel.h>
#include <omp.h>
#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>
#include <thread>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace tokenloom_cpu {

inline void spin_pause() {
#if defined(__x86_64__)
  _mm_pause();
#endif
}

// Pauses a waiting thread spins through before it yields its core on each further spin, so
// that a thread it waits on, or another process, can run there.
constexpr int64_t kSpinsBeforeYield = int64_t{1} << 12;

// Spins until done(), yielding the core past kSpinsBeforeYield spins.
template <typename Done>
void spin_until(const Done& done) {
  for (int64_t spins = 0; !done(); ++spins) {
    spin_pause();
    if (spins > kSpinsBeforeYield) std::this_thread::yield();
  }
}

class WorkPool {
 public:
  // Whether the calling thread is the master of this pool's open region.
  bool is_master() const {
    return is_open_.load(std::memory_order_acquire) && pthread_equal(master_, pthread_self());
  }

  // The region's threads, the master included.
  int64_t num_threads() const { return num_threads_; }

  // Runs master_fn on the calling thread, with the other `num_threads` - 1 of an OpenMP
  // region serving its posted work until it returns. One thread, already inside a region,
  // or the pool taken by another thread's region: master_fn alone, its kernels on torch's
  // threads as before. An exception leaves the region and is rethrown.
  template <typename F>
  void run_region(int64_t num_threads, const F& master_fn) {
    bool is_free = false;
    if (num_threads <= 1 || omp_in_parallel() || !is_taken_.compare_exchange_strong(is_free, true)) {
      master_fn();
      return;
    }
    struct Release {
      std::atomic<bool>& taken;
      ~Release() { taken.store(false, std::memory_order_release); }
    } release{is_taken_};
    std::exception_ptr error;
    master_ = pthread_self();
    is_closing_.store(false, std::memory_order_release);
    const uint64_t start = generation_.load(std::memory_order_acquire);  // even: nothing posted yet
#pragma omp parallel num_threads(num_threads)
    {
      if (omp_get_thread_num() == 0) {
        num_threads_ = omp_get_num_threads();
        is_open_.store(true, std::memory_order_release);
        try {
          master_fn();
        } catch (...) {
          error = std::current_exception();
        }
        is_open_.store(false, std::memory_order_release);
        is_closing_.store(true, std::memory_order_release);
      } else {
        serve(omp_get_thread_num(), start);
      }
    }
    if (error) std::rethrow_exception(error);
  }

  // Master only: body(t) runs on the master (t = 0) and on each helper that comes free
  // (t = its thread number) while the work is posted; returns once done() holds and no
  // helper is still inside body. body must claim its work so that any number of calls,
  // late ones included, do each piece once, and done() must say when every piece is done.
  // An exception from body, on any thread, is rethrown here once no helper is inside it.
  template <typename Body, typename Done>
  void run(const Body& body, const Done& done) {
    body_ = &call<Body>;
    context_ = &body;
    helper_error_ = nullptr;
    has_failed_.store(false, std::memory_order_relaxed);
    generation_.fetch_add(1, std::memory_order_seq_cst);  // odd: posted
    std::exception_ptr error;
    try {
      body(0);
    } catch (...) {
      error = std::current_exception();
    }
    // A failed body leaves its items undone: then only the helpers' leaving is waited for.
    if (!error) spin_until([&] { return done() || has_failed_.load(std::memory_order_acquire); });
    generation_.fetch_add(1, std::memory_order_seq_cst);  // even: closed to helpers that have not entered
    spin_until([&] { return num_inside_.load(std::memory_order_seq_cst) == 0; });
    if (!error) error = helper_error_;
    if (error) std::rethrow_exception(error);
  }

 private:
  template <typename Body>
  static void call(const void* context, int64_t thread) {
    (*static_cast<const Body*>(context))(thread);
  }

  // A helper: runs each posted body once, until the master's function has returned.
  // `served`: the generation before the region began (nothing posted).
  void serve(int64_t thread, uint64_t served) {
    for (int64_t spins = 0; !is_closing_.load(std::memory_order_acquire); ++spins) {
      const uint64_t generation = generation_.load(std::memory_order_acquire);
      if ((generation & 1) == 0 || generation == served) {
        spin_pause();
        if (spins > kSpinsBeforeYield) std::this_thread::yield();  // the master runs serial work, or lost its core
        continue;
      }
      // Entered, then checked again: the master closes before it waits for num_inside to
      // drop, so a helper either sees the close or is waited for (both sides seq_cst).
      num_inside_.fetch_add(1, std::memory_order_seq_cst);
      if (generation_.load(std::memory_order_seq_cst) == generation) {
        try {
          body_.load(std::memory_order_relaxed)(context_.load(std::memory_order_relaxed), thread);
        } catch (...) {  // must not leave the OpenMP region: handed to the master
          bool expected = false;
          if (has_failed_.compare_exchange_strong(expected, true)) helper_error_ = std::current_exception();
        }
      }
      num_inside_.fetch_sub(1, std::memory_order_seq_cst);
      served = generation;
      spins = 0;
    }
  }

  std::atomic<uint64_t> generation_{0};
  std::atomic<int64_t> num_inside_{0};
  std::atomic<void (*)(const void*, int64_t)> body_{nullptr};
  std::atomic<const void*> context_{nullptr};
  std::atomic<bool> is_open_{false}, is_closing_{true};
  std::atomic<bool> is_taken_{false};  // a thread's region holds the pool
  std::atomic<bool> has_failed_{false};  // a helper's body threw: helper_error_ holds it
  std::exception_ptr helper_error_;
  pthread_t master_{};
  int64_t num_threads_ = 1;
};

// This library's pointer to the pool (each shared library that includes this header has its own).
inline WorkPool*& work_pool_slot() {
  static WorkPool* slot = nullptr;
  return slot;
}

// The pool whose open region the calling thread is the master of, or null.
inline WorkPool* active_pool() {
  WorkPool* pool = work_pool_slot();
  return pool != nullptr && pool->is_master() ? pool : nullptr;
}

}  // namespace tokenloom_cpu
