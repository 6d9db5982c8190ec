// The two passes of paged_decode_attention.cpp's tasks, on ATen's vectors: the block walk with
// its prefetch, the scores, their exponentials, and the weighted V rows. Included there only,
// inside its anonymous namespace (like decode_attention_bf16.h and decode_attention_x8.h, the
// AVX512_BF16 and AVX2 passes that follow it); that file's header says why the kernel is built
// this way.
#pragma once

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
// kPrefetchBlocks ahead, into s.after's blocks at the end: a block's lines at once, before
// fn; with kSpread, fn(rows, start, num_tokens, ahead) takes the block ahead's first byte
// (nullptr past the end) and prefetches its lines itself, a few at a time as it works.
template <typename scalar_t, bool kSpread = false, typename Fn>
inline void for_each_block(const scalar_t* cache, const int32_t* block_table, int64_t seq_len, const TaskShape& s,
                           Fn fn) {
  const int64_t block_bytes = s.block_size * s.head_dim * sizeof(scalar_t);
  const int64_t stride_bytes = s.block_stride * sizeof(scalar_t);
  const BlockRun run = block_run(cache, block_table, seq_len, s);
  const int64_t first_block = s.first_pos / s.block_size;
  const int64_t distance = std::max(kPrefetchBlocks, (kPrefetchBytes + block_bytes - 1) / block_bytes);
  for (int64_t i = 0; i < run.num_blocks; ++i) {
    const int64_t ahead = i + distance;
    const char* next = nullptr;
    if (ahead < run.num_blocks) {
      next = run.base + run.table[ahead] * stride_bytes;
    } else if (ahead - run.num_blocks < s.after.num_blocks) {
      next = s.after.base + s.after.table[ahead - run.num_blocks] * stride_bytes;
    }
    if (!kSpread && next != nullptr) prefetch_rows<2>(next, block_bytes);
    const int64_t block_start = (first_block + i) * s.block_size;
    const int64_t skip = std::max<int64_t>(0, s.first_pos - block_start);  // rows before the window
    const scalar_t* rows = cache + run.table[i] * s.block_stride + s.head_offset + skip * s.head_dim;
    const int64_t num_tokens = std::min(s.block_size, seq_len - block_start) - skip;
    if constexpr (kSpread) {
      fn(rows, block_start + skip - s.first_pos, num_tokens, next);
    } else {
      fn(rows, block_start + skip - s.first_pos, num_tokens);
    }
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
