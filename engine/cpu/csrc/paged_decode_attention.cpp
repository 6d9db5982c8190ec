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
// to fp32 in vector registers once and used by the whole GQA group, and blocks
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

#include <torch/extension.h>
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

// Query heads per KV head that the vector path keeps in registers; larger groups take the plain loops.
constexpr int64_t kMaxGroup = 8;

// Reads `Vec::size()` elements at `ptr` as fp32.
template <typename scalar_t>
inline Vec load_float(const scalar_t* ptr) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return Vec::loadu(ptr);
  } else {
    Vec out;
    at::vec::load_to_float<scalar_t>(ptr, out);
    return out;
  }
}

// Blocks ahead of the one in use that are prefetched. One block is too close: its rows
// arrive after a task has already scored them (blocks lie anywhere in the pool, so the
// hardware prefetcher cannot guess them). Into L2, not L1: a 2 KB block is 32 lines, more
// than the L1's miss buffers hold, and the prefetch instructions then stall the loop.
constexpr int64_t kPrefetchBlocks = 2;
// ... and at least this many bytes ahead: a bf16 block of 64-dim rows is 2 KB, two of them too
// close for a run of blocks that each start on a page of their own.
#ifndef TL_PREFETCH_BYTES
#define TL_PREFETCH_BYTES 8192
#endif
constexpr int64_t kPrefetchBytes = TL_PREFETCH_BYTES;

// The blocks of one (sequence, KV head) in one cache, for prefetching: block i's rows
// start at base + table[i] * the block stride.
struct BlockRun {
  const char* base = nullptr;
  const int32_t* table = nullptr;
  int64_t num_blocks = 0;
};

struct TaskShape {
  int64_t group, head_dim, block_size, block_stride, head_offset;
  int64_t first_pos = 0;  // the first position in this sequence's window (0: the whole context)
  BlockRun after;  // what is read after this pass: its first blocks are prefetched as the pass ends
};

// The keys a task attends to: positions [s.first_pos, seq_len). Scores are [group, num_keys].
inline int64_t num_keys(int64_t seq_len, const TaskShape& s) { return seq_len - s.first_pos; }

// The blocks holding positions [s.first_pos, seq_len).
template <typename scalar_t>
BlockRun block_run(const scalar_t* cache, const int32_t* block_table, int64_t seq_len, const TaskShape& s) {
  const int64_t first_block = s.first_pos / s.block_size;
  return {reinterpret_cast<const char*>(cache + s.head_offset), block_table + first_block,
          (seq_len + s.block_size - 1) / s.block_size - first_block};
}

// Calls fn(rows, start, num_tokens) for each block of one sequence's cached rows of this
// task's KV head in its window, in position order: `rows` is the first row to read, `start`
// its index among the task's keys (its position - s.first_pos). Prefetches run
// kPrefetchBlocks ahead, into s.after's blocks at the end.
template <typename scalar_t, typename Fn>
inline void for_each_block(const scalar_t* cache, const int32_t* block_table, int64_t seq_len, const TaskShape& s,
                           Fn fn) {
  const int64_t block_bytes = s.block_size * s.head_dim * sizeof(scalar_t);
  const int64_t stride_bytes = s.block_stride * sizeof(scalar_t);
  const BlockRun run = block_run(cache, block_table, seq_len, s);
  const int64_t first_block = s.first_pos / s.block_size;
  const int64_t distance = std::max(kPrefetchBlocks, (kPrefetchBytes + block_bytes - 1) / block_bytes);
  for (int64_t i = 0; i < run.num_blocks; ++i) {
    const int64_t ahead = i + distance;
    if (ahead < run.num_blocks) {
      prefetch_rows<2>(run.base + run.table[ahead] * stride_bytes, block_bytes);
    } else if (ahead - run.num_blocks < s.after.num_blocks) {
      prefetch_rows<2>(s.after.base + s.after.table[ahead - run.num_blocks] * stride_bytes, block_bytes);
    }
    const int64_t block_start = (first_block + i) * s.block_size;
    const int64_t skip = std::max<int64_t>(0, s.first_pos - block_start);  // rows before the window
    fn(cache + run.table[i] * s.block_stride + s.head_offset + skip * s.head_dim, block_start + skip - s.first_pos,
       std::min(s.block_size, seq_len - block_start) - skip);
  }
}

// scores[g * num_keys + i] = scale * q[g] . k[first_pos + i] for every row of this KV head in the window.
template <typename scalar_t, int kGroup>
void score_rows(const float* q_buf, const scalar_t* k_cache, const int32_t* block_table, int64_t seq_len,
                const TaskShape& s, float* scores) {
  const int64_t num_chunks = s.head_dim / Vec::size();
  const int64_t n = num_keys(seq_len, s);
  for_each_block(k_cache, block_table, seq_len, s, [&](const scalar_t* block, int64_t start, int64_t num_tokens) {
    for (int64_t t = 0; t < num_tokens; ++t) {
      // Each K chunk is converted once and used by the whole group.
      const scalar_t* k = block + t * s.head_dim;
      Vec dots[kGroup];
      for (int64_t g = 0; g < kGroup; ++g) dots[g] = Vec(0.f);
      for (int64_t c = 0; c < num_chunks; ++c) {
        const Vec kc = load_float(k + c * Vec::size());
        for (int64_t g = 0; g < kGroup; ++g) {
          dots[g] = at::vec::fmadd(Vec::loadu(q_buf + g * s.head_dim + c * Vec::size()), kc, dots[g]);
        }
      }
      for (int64_t g = 0; g < kGroup; ++g) scores[g * n + start + t] = reduce_add(dots[g]);
    }
  });
}

#if defined(__AVX512BF16__) && defined(CPU_CAPABILITY_AVX512)
// The 16 horizontal sums of v[0..15] in one vector (lane t = the sum of v[t]'s lanes): pairs
// interleaved and added within 128-bit lanes, then quads, then the 128-bit lanes across.
// 45 instructions for 16 sums, against about 8 for each sum done alone.
inline __m512 sum_each_of_16(const __m512* v) {
  __m512 pairs[8], quads[4];
  for (int i = 0; i < 8; ++i) {
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  }
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(pairs[2 * i]), b = _mm512_castps_pd(pairs[2 * i + 1]);
    quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  // quads[m] lane 4k + j: v[4m + j]'s sum over 128-bit lane k. Sum over k into lane 4m + j.
  const __m512 z0 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm512_shuffle_f32x4(quads[0], quads[1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 z1 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm512_shuffle_f32x4(quads[2], quads[3], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(z0, z1, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(z0, z1, _MM_SHUFFLE(3, 1, 3, 1)));
}

// bf16 scores with the CPU's bf16 dot-product instruction: 32 products of a K row with
// the (unscaled, still bf16) query per instruction, summed in fp32, with no conversion
// of K to fp32 first. Sixteen rows' dot vectors are reduced together (sum_each_of_16);
// a block's last few rows one by one. The scale is applied to each fp32 sum.
template <int kGroup>
void score_rows_bf16(const at::BFloat16* query, float scale, const at::BFloat16* k_cache, const int32_t* block_table,
                     int64_t seq_len, const TaskShape& s, float* scores) {
  const int64_t num_chunks = s.head_dim / 32;
  const int64_t n = num_keys(seq_len, s);
  for_each_block(k_cache, block_table, seq_len, s, [&](const at::BFloat16* block, int64_t start, int64_t num_tokens) {
    int64_t t = 0;
    for (; t + 16 <= num_tokens; t += 16) {
      for (int g = 0; g < kGroup; ++g) {
        const at::BFloat16* q = query + g * s.head_dim;
        __m512 dots[16];
        for (int i = 0; i < 16; ++i) dots[i] = _mm512_setzero_ps();
        for (int64_t c = 0; c < num_chunks; ++c) {
          const __m512bh qc = (__m512bh)_mm512_loadu_si512(q + c * 32);
          for (int i = 0; i < 16; ++i) {
            dots[i] = _mm512_dpbf16_ps(dots[i], qc, (__m512bh)_mm512_loadu_si512(block + (t + i) * s.head_dim + c * 32));
          }
        }
        _mm512_storeu_ps(scores + g * n + start + t, _mm512_mul_ps(sum_each_of_16(dots), _mm512_set1_ps(scale)));
      }
    }
    for (; t < num_tokens; ++t) {
      const at::BFloat16* k = block + t * s.head_dim;
      __m512 dots[kGroup];
      for (int g = 0; g < kGroup; ++g) dots[g] = _mm512_setzero_ps();
      for (int64_t c = 0; c < num_chunks; ++c) {
        const __m512bh kc = (__m512bh)_mm512_loadu_si512(k + c * 32);
        for (int g = 0; g < kGroup; ++g) {
          const __m512bh qc = (__m512bh)_mm512_loadu_si512(query + g * s.head_dim + c * 32);
          dots[g] = _mm512_dpbf16_ps(dots[g], qc, kc);
        }
      }
      for (int g = 0; g < kGroup; ++g) scores[g * n + start + t] = _mm512_reduce_add_ps(dots[g]) * scale;
    }
  });
}
constexpr bool kHasBf16Dot = true;
#else
constexpr bool kHasBf16Dot = false;
#endif

// acc[g] = sum over the window's keys i of weights[g * num_keys + i] * v[first_pos + i]
// (exp_rows' exponentials: the softmax before its division).
template <typename scalar_t, int kGroup>
void weigh_rows(const float* weights, const scalar_t* v_cache, const int32_t* block_table, int64_t seq_len,
                const TaskShape& s, float* acc) {
  const int64_t num_chunks = s.head_dim / Vec::size();
  const int64_t n = num_keys(seq_len, s);
  std::fill(acc, acc + s.group * s.head_dim, 0.f);
  for_each_block(v_cache, block_table, seq_len, s, [&](const scalar_t* block, int64_t start, int64_t num_tokens) {
    for (int64_t c = 0; c < num_chunks; ++c) {
      // Each V chunk is converted once and used by the whole group; the group's
      // partial sums stay in registers across the block's rows.
      Vec sums[kGroup];
      for (int64_t g = 0; g < kGroup; ++g) sums[g] = Vec::loadu(acc + g * s.head_dim + c * Vec::size());
      for (int64_t t = 0; t < num_tokens; ++t) {
        const Vec v = load_float(block + t * s.head_dim + c * Vec::size());
        for (int64_t g = 0; g < kGroup; ++g) sums[g] = at::vec::fmadd(Vec(weights[g * n + start + t]), v, sums[g]);
      }
      for (int64_t g = 0; g < kGroup; ++g) sums[g].store(acc + g * s.head_dim + c * Vec::size());
    }
  });
}

// weigh_rows with the head's vectors known at compile time: a V row is loaded (and
// converted) once, whole, and every group head's sums stay in registers across the block.
template <typename scalar_t, int kGroup, int kChunks>
void weigh_rows_fixed(const float* weights, const scalar_t* v_cache, const int32_t* block_table, int64_t seq_len,
                      const TaskShape& s, float* acc) {
  Vec sums[kGroup][kChunks];
  const int64_t n = num_keys(seq_len, s);
  for (int g = 0; g < kGroup; ++g) {
    for (int c = 0; c < kChunks; ++c) sums[g][c] = Vec(0.f);
  }
  for_each_block(v_cache, block_table, seq_len, s, [&](const scalar_t* block, int64_t start, int64_t num_tokens) {
    const float* p = weights + start;
    for (int64_t t = 0; t < num_tokens; ++t) {
      Vec v[kChunks];
      for (int c = 0; c < kChunks; ++c) v[c] = load_float(block + t * s.head_dim + c * Vec::size());
      for (int g = 0; g < kGroup; ++g) {
        const Vec pg(p[g * n + t]);
        for (int c = 0; c < kChunks; ++c) sums[g][c] = at::vec::fmadd(pg, v[c], sums[g][c]);
      }
    }
  });
  for (int g = 0; g < kGroup; ++g) {
    for (int c = 0; c < kChunks; ++c) sums[g][c].store(acc + g * s.head_dim + c * Vec::size());
  }
}

// Registers for the sums of weigh_rows_fixed: 32 vector registers on AVX-512, 16 on AVX2.
constexpr int kMaxSumVectors = Vec::size() >= 16 ? 24 : 12;

// weigh_rows_fixed where the group's sums fit in registers, else weigh_rows.
template <typename scalar_t, int kGroup>
void weigh(const float* weights, const scalar_t* v_cache, const int32_t* block_table, int64_t seq_len,
           const TaskShape& s, float* acc) {
  const int64_t num_chunks = s.head_dim / Vec::size();
  if constexpr (kGroup * 4 <= kMaxSumVectors) {
    if (num_chunks == 4) return weigh_rows_fixed<scalar_t, kGroup, 4>(weights, v_cache, block_table, seq_len, s, acc);
  }
  if constexpr (kGroup * 8 <= kMaxSumVectors) {
    if (num_chunks == 8) return weigh_rows_fixed<scalar_t, kGroup, 8>(weights, v_cache, block_table, seq_len, s, acc);
  }
  if constexpr (kGroup * 2 <= kMaxSumVectors) {
    if (num_chunks == 2) return weigh_rows_fixed<scalar_t, kGroup, 2>(weights, v_cache, block_table, seq_len, s, acc);
  }
  weigh_rows<scalar_t, kGroup>(weights, v_cache, block_table, seq_len, s, acc);
}

// The same two passes without vectors, for head sizes that are not a multiple of the vector width.
template <typename scalar_t>
void score_and_weigh_scalar(const float* q_buf, const scalar_t* k_cache, const scalar_t* v_cache,
                            const int32_t* block_table, int64_t seq_len, const TaskShape& s, float* scores,
                            float* acc, bool weigh) {
  const int64_t n = num_keys(seq_len, s);
  if (!weigh) std::fill(scores, scores + s.group * n, 0.f);
  else std::fill(acc, acc + s.group * s.head_dim, 0.f);
  for (int64_t pos = s.first_pos; pos < seq_len; ++pos) {
    const int64_t offset = block_table[pos / s.block_size] * s.block_stride + s.head_offset +
                           (pos % s.block_size) * s.head_dim;
    for (int64_t g = 0; g < s.group; ++g) {
      if (!weigh) {
        const float* q = q_buf + g * s.head_dim;
        float dot = 0.f;
        for (int64_t d = 0; d < s.head_dim; ++d) dot += q[d] * static_cast<float>(k_cache[offset + d]);
        scores[g * n + pos - s.first_pos] = dot;
      } else {
        const float p = scores[g * n + pos - s.first_pos];
        for (int64_t d = 0; d < s.head_dim; ++d) acc[g * s.head_dim + d] += p * static_cast<float>(v_cache[offset + d]);
      }
    }
  }
}

// Each of the group's score rows, in place, becomes exp(score - the row's max), and
// inv_sums[g] 1 / that row's sum: the softmax's division is left to the task's output
// (group * head_dim values instead of group * num_keys). exp is ATen's vectorized one (the
// build has no -ffast-math to hand std::exp to libmvec).
void exp_rows(float* scores, int64_t group, int64_t width, float* inv_sums) {
  for (int64_t g = 0; g < group; ++g) {
    float* s = scores + g * width;
    const float max_score = tokenloom_cpu::row_max(s, width);
    Vec sums(0.f);
    int64_t t = 0;
    for (; t + Vec::size() <= width; t += Vec::size()) {
      const Vec e = (Vec::loadu(s + t) - Vec(max_score)).exp_u20();
      e.store(s + t);
      sums = sums + e;
    }
    float sum = reduce_add(sums);
    for (; t < width; ++t) {
      s[t] = std::exp(s[t] - max_score);
      sum += s[t];
    }
    inv_sums[g] = 1.f / sum;
  }
}

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
        if constexpr (std::is_same_v<scalar_t, at::BFloat16> && kHasBf16Dot) {
          if (shape.head_dim % 32 == 0) {
            score_rows_bf16<group()>(query, scale, k_cache, block_table, seq_len, k_shape, scores);
          } else {
            score_rows<scalar_t, group()>(q_buf, k_cache, block_table, seq_len, k_shape, scores);
          }
        } else if constexpr (kUsesX8<scalar_t>) {
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
                              o + offset);
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
