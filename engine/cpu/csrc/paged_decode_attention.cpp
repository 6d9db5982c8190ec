// Paged decode attention for the CPU: one query token per sequence, read
// straight from the paged KV cache (no gather into a contiguous copy).
//
// Cache layout is the torch backend's, head-major blocks:
//   k_cache, v_cache: [num_blocks, num_kv_heads, block_size, head_dim]
// One task per (sequence, KV head) computes every query head of its GQA group,
// so each K/V row is read from memory once per group. Two passes per task:
// scores for the whole context (then their exponentials in fp32, less the row's
// max), then the exponential-weighted sum of V rows, divided by the exponentials'
// sum once at the end (an exact softmax). Accumulation is fp32 for every dtype.
//
// A sliding-window layer passes its window: a decode then reads only the blocks that
// hold its last `window` positions (p - window < k <= p), from the first one's offset.
//
// Decode attention is bound by the KV read (every context token's K and V, each
// step), so the kernel's job is to keep up with memory: each row is converted
// to fp32 in vector registers once and used by the whole GQA group (a bf16 cache on
// a CPU with AVX512_BF16 skips the conversion: both passes take the bf16 dot
// product, decode_attention_bf16.h), and blocks
// are prefetched two ahead of use (blocks lie anywhere in the pool, so the
// hardware prefetcher cannot guess them). Tasks are split with ATen's
// parallel_for in equal contiguous ranges: a raw `omp parallel` region here, with
// tasks handed out from a shared counter, made the kernel much slower inside the
// engine (between oneDNN's regions; docs/performance.md, "Decode attention") though
// not in isolation, and handing them out
// from a counter inside parallel_for (as run_slabs does) gained nothing and broke
// the prefetch from one task into the next. In a decode step's work pool
// (work_pool.h) the tasks go out in contiguous runs of several (share_out.h), each
// prefetching from task to task as before.
#include "vec_capability.h"
#include "vec_reduce.h"
#include "share_out.h"  // tokenloom_cpu::parallel_for: a decode step's work pool

#include <torch/types.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

namespace {

using tokenloom_cpu::prefetch_rows;
using tokenloom_cpu::reduce_add;
using tokenloom_cpu::Vec;

#include "decode_attention_passes.h"  // the block walk, the scores, exp and the weighted V rows

#include "decode_attention_bf16.h"  // kHasBf16Dot, and the bf16 passes where the CPU has the bf16 dot product

#include "decode_attention_x8.h"  // kHasX8, and the AVX2 passes where the build has AVX2

// The AVX2 passes take fp32 caches only: a bf16 block's K rows converted into scratch first
// made bf16 caches 5-15% slower in cache (docs/cpu-kernels.md, "Decode attention on AVX2").
template <typename scalar_t>
constexpr bool kUsesX8 = kHasX8 && std::is_same_v<scalar_t, float>;

// Calls fn with std::integral_constant<int, group> for group in 1..kMaxGroup.
template <typename Fn>
void with_group(int64_t group, Fn fn) {
  switch (group) {
    case 1: return fn(std::integral_constant<int, 1>{});
    case 2: return fn(std::integral_constant<int, 2>{});
    case 3: return fn(std::integral_constant<int, 3>{});
    case 4: return fn(std::integral_constant<int, 4>{});
    case 5: return fn(std::integral_constant<int, 5>{});
    case 6: return fn(std::integral_constant<int, 6>{});
    case 7: return fn(std::integral_constant<int, 7>{});
    case 8: return fn(std::integral_constant<int, 8>{});
    default: TORCH_CHECK(false, "group size outside 1..", kMaxGroup);
  }
}

template <typename scalar_t>
void decode_task(const scalar_t* query,  // [group, head_dim] of this (sequence, KV head)
                 const scalar_t* k_cache, const scalar_t* v_cache, const int32_t* block_table, int64_t seq_len,
                 const TaskShape& shape, float scale,
                 float* q_buf,   // [group, head_dim] scratch
                 float* scores,  // [group, num_keys] scratch
                 float* acc,     // [group, head_dim] scratch
                 float* inv_sums,  // [group] scratch: 1 / each score row's sum of exps
                 uint16_t* probs,  // [2, group, num_keys] scratch: the bf16 passes' probabilities, in two parts
                 scalar_t* out) {  // [group, head_dim]
  const int64_t num_values = shape.group * shape.head_dim;
  for (int64_t i = 0; i < num_values; ++i) q_buf[i] = static_cast<float>(query[i]) * scale;
  if constexpr (std::is_same_v<scalar_t, double>) {  // no fp32 vectors for it: the plain loops
    score_and_weigh_scalar(q_buf, k_cache, v_cache, block_table, seq_len, shape, scores, acc, false);
    exp_rows(scores, shape.group, num_keys(seq_len, shape), inv_sums);
    score_and_weigh_scalar(q_buf, k_cache, v_cache, block_table, seq_len, shape, scores, acc, true);
  } else {
    const bool vectorized = shape.head_dim % Vec::size() == 0 && shape.group <= kMaxGroup;
    // The K pass runs into this task's V blocks; the V pass into whatever `shape.after` says.
    TaskShape k_shape = shape;
    k_shape.after = block_run(v_cache, block_table, seq_len, shape);
    if (vectorized) {
      // The group size is a template argument so the group's sums live in registers.
      with_group(shape.group, [&](auto group) {
#if defined(__AVX512BF16__) && defined(CPU_CAPABILITY_AVX512)
        if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
          if (shape.head_dim % 32 == 0) {  // both passes on the bf16 dot product
            score_rows_bf16<group()>(query, scale, k_cache, block_table, seq_len, k_shape, scores);
            const int64_t n = num_keys(seq_len, shape);
            exp_rows(scores, shape.group, n, inv_sums);
            split_bf16(scores, shape.group * n, probs, probs + shape.group * n);
            weigh_rows_bf16(probs, probs + shape.group * n, v_cache, block_table, seq_len, shape, acc);
            return;
          }
        }
#endif
        if constexpr (kUsesX8<scalar_t>) {
          score_rows_x8<group()>(q_buf, k_cache, block_table, seq_len, k_shape, scores);
        } else {
          score_rows<scalar_t, group()>(q_buf, k_cache, block_table, seq_len, k_shape, scores);
        }
        exp_rows(scores, shape.group, num_keys(seq_len, shape), inv_sums);
        if constexpr (kUsesX8<scalar_t>) {
          weigh_rows_x8<scalar_t, group()>(scores, v_cache, block_table, seq_len, shape, acc);
        } else {
          weigh<scalar_t, group()>(scores, v_cache, block_table, seq_len, shape, acc);
        }
      });
    } else {
      score_and_weigh_scalar(q_buf, k_cache, v_cache, block_table, seq_len, shape, scores, acc, false);
      exp_rows(scores, shape.group, num_keys(seq_len, shape), inv_sums);
      score_and_weigh_scalar(q_buf, k_cache, v_cache, block_table, seq_len, shape, scores, acc, true);
    }
  }
  for (int64_t g = 0; g < shape.group; ++g) {
    for (int64_t d = 0; d < shape.head_dim; ++d) {
      const int64_t i = g * shape.head_dim + d;
      out[i] = static_cast<scalar_t>(acc[i] * inv_sums[g]);
    }
  }
}

}  // namespace

// query: [num_seqs, num_heads, head_dim]; block_tables: [num_seqs, max_num_blocks] int32;
// seq_lens: [num_seqs] int32; window: a sliding window's size (each decode sees its last
// `window` positions), 0 or less for none. Returns [num_seqs, num_heads, head_dim].
torch::Tensor paged_decode_attention(
    torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache,
    torch::Tensor block_tables, torch::Tensor seq_lens, double scale, int64_t window) {
  TORCH_CHECK(query.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "bad shapes");
  TORCH_CHECK(query.device().is_cpu() && k_cache.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(query.scalar_type() == k_cache.scalar_type() && v_cache.scalar_type() == k_cache.scalar_type(),
              "query and caches must share a dtype");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && seq_lens.scalar_type() == torch::kInt32,
              "block_tables and seq_lens must be int32");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  query = query.contiguous();
  block_tables = block_tables.contiguous();
  seq_lens = seq_lens.contiguous();
  const int64_t num_seqs = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t num_kv_heads = k_cache.size(1), block_size = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == head_dim && num_heads % num_kv_heads == 0, "head shapes disagree");
  TORCH_CHECK(block_tables.size(0) == num_seqs && seq_lens.size(0) == num_seqs, "one row per sequence");
  const int64_t group = num_heads / num_kv_heads;
  const int64_t max_num_blocks = block_tables.size(1);
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t num_blocks = k_cache.size(0);
  int64_t max_keys = 0;
  // The first position each sequence's decode sees.
  auto first_pos = [&](int64_t seq) { return window > 0 ? std::max<int64_t>(0, lens[seq] - window) : int64_t{0}; };
  // Checked up front: the kernel reads through these without bounds checks (only the window's blocks are read).
  for (int64_t i = 0; i < num_seqs; ++i) {
    TORCH_CHECK(lens[i] >= 1 && lens[i] <= max_num_blocks * block_size, "seq_len outside its block table");
    max_keys = std::max<int64_t>(max_keys, lens[i] - first_pos(i));
    for (int64_t b = first_pos(i) / block_size; b < (lens[i] + block_size - 1) / block_size; ++b) {
      const int32_t block_id = tables[i * max_num_blocks + b];
      TORCH_CHECK(block_id >= 0 && block_id < num_blocks, "block id outside the cache");
    }
  }
  auto out = torch::empty_like(query);
  const int64_t num_tasks = num_seqs * num_kv_heads;
  if (num_tasks == 0) return out;
  // Sequences that share a cached prefix share its blocks. Then the tasks go KV head by
  // KV head, with the sharers side by side, so one thread reads a shared prefix's rows
  // for several sequences in a row while they are still in its cache. Otherwise a
  // sequence's KV heads go together (its blocks hold them side by side).
  std::vector<int64_t> order(num_seqs);
  for (int64_t i = 0; i < num_seqs; ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return tables[a * max_num_blocks] < tables[b * max_num_blocks]; });
  bool shared = false;
  for (int64_t i = 1; i < num_seqs && !shared; ++i) {
    shared = tables[order[i] * max_num_blocks] == tables[order[i - 1] * max_num_blocks];
  }

  auto task_seq = [&](int64_t task) { return shared ? order[task % num_seqs] : task / num_kv_heads; };
  auto task_head = [&](int64_t task) { return shared ? task / num_seqs : task % num_kv_heads; };

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_decode_attention", [&] {
    const scalar_t* q = query.data_ptr<scalar_t>();
    const scalar_t* k = k_cache.data_ptr<scalar_t>();
    const scalar_t* v = v_cache.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    const int64_t block_stride = num_kv_heads * block_size * head_dim;
    tokenloom_cpu::parallel_for(0, num_tasks, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> q_buf(group * head_dim), acc(group * head_dim), scores(group * max_keys), inv_sums(group);
      std::vector<uint16_t> probs(kHasBf16Dot ? 2 * group * max_keys : 0);
      for (int64_t task = begin; task < end; ++task) {
        const int64_t seq = task_seq(task), kv_head = task_head(task);
        const int64_t offset = (seq * num_heads + kv_head * group) * head_dim;
        TaskShape shape{group, head_dim, block_size, block_stride, kv_head * block_size * head_dim, first_pos(seq)};
        if (task + 1 < end) {  // the next task's K blocks follow this task's V blocks
          TaskShape next = shape;
          next.head_offset = task_head(task + 1) * block_size * head_dim;
          next.first_pos = first_pos(task_seq(task + 1));
          shape.after = block_run(k, tables + task_seq(task + 1) * max_num_blocks, lens[task_seq(task + 1)], next);
        }
        decode_task<scalar_t>(q + offset, k, v, tables + seq * max_num_blocks, lens[seq], shape,
                              static_cast<float>(scale), q_buf.data(), scores.data(), acc.data(), inv_sums.data(),
                              probs.data(), o + offset);
      }
    });
  });
  return out;
}


// Which passes paged_decode_attention's vector path was built with, for the tests and the
// logs: "avx512_bf16" (bf16 K scored with the bf16 dot product, else as "avx512"), "avx512"
// (one key at a time, 16-lane horizontal sums), "avx2_x8" (fp32 caches eight keys at a time,
// decode_attention_x8.h; bf16 caches one key at a time) or "default" (ATen's vectors, one key
// at a time).
std::string paged_decode_attention_path() {
  if (kHasBf16Dot) return "avx512_bf16";
  if (kHasX8) return "avx2_x8";
#if defined(CPU_CAPABILITY_AVX512)
  return "avx512";
#else
  return "default";
#endif
}
