// Paged decode attention for the CPU: one query token per sequence, read
// straight from the paged KV cache (no gather into a contiguous copy).
//
// Cache layout is the torch backend's, head-major blocks:
//   k_cache, v_cache: [num_blocks, num_kv_heads, block_size, head_dim]
// One task per (sequence, KV head) computes every query head of its GQA group,
// so each K/V row is read from memory once per group. Two passes per task:
// scores for the whole context (then an exact softmax in fp32), then the
// probability-weighted sum of V rows. Accumulation is fp32 for every dtype.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

template <typename scalar_t>
inline float to_float(scalar_t x) {
  return static_cast<float>(x);
}

// Walks one sequence's cached rows of one KV head in position order through its
// block table: rows of a block are contiguous, blocks lie anywhere in the pool.
struct RowWalk {
  const int32_t* block_table;
  int64_t seq_len, block_size, block_stride, head_offset, head_dim;

  template <typename scalar_t, typename RowFn>
  void for_each_row(const scalar_t* cache, RowFn row_fn) const {
    for (int64_t start = 0; start < seq_len; start += block_size) {
      const scalar_t* block = cache + block_table[start / block_size] * block_stride + head_offset;
      const int64_t num_tokens = std::min(block_size, seq_len - start);
      for (int64_t t = 0; t < num_tokens; ++t) row_fn(start + t, block + t * head_dim);
    }
  }
};

template <typename scalar_t>
void decode_task(
    const scalar_t* query,         // [group, head_dim] of this (sequence, KV head)
    const scalar_t* k_cache,       // base of the cache
    const scalar_t* v_cache,
    const int32_t* block_table,    // this sequence's row
    int64_t seq_len, int64_t kv_head, int64_t group, int64_t head_dim,
    int64_t num_kv_heads, int64_t block_size, float scale,
    float* q_buf,                  // [group, head_dim] scratch
    float* scores,                 // [group, seq_len] scratch
    float* acc,                    // [group, head_dim] scratch
    scalar_t* out) {               // [group, head_dim]
  for (int64_t i = 0; i < group * head_dim; ++i) q_buf[i] = to_float(query[i]) * scale;
  const int64_t block_stride = num_kv_heads * block_size * head_dim;
  const int64_t head_offset = kv_head * block_size * head_dim;

  const RowWalk walk{block_table, seq_len, block_size, block_stride, head_offset, head_dim};
  walk.for_each_row(k_cache, [=](int64_t pos, const scalar_t* k) {
    for (int64_t g = 0; g < group; ++g) {
      const float* q = q_buf + g * head_dim;
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < head_dim; ++d) dot += q[d] * to_float(k[d]);
      scores[g * seq_len + pos] = dot;
    }
  });

  for (int64_t g = 0; g < group; ++g) {
    float* s = scores + g * seq_len;
    float max_score = s[0];
#pragma omp simd reduction(max : max_score)
    for (int64_t t = 0; t < seq_len; ++t) max_score = std::max(max_score, s[t]);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < seq_len; ++t) {
      s[t] = std::exp(s[t] - max_score);
      sum += s[t];
    }
    const float inv_sum = 1.f / sum;
#pragma omp simd
    for (int64_t t = 0; t < seq_len; ++t) s[t] *= inv_sum;
  }

  std::fill(acc, acc + group * head_dim, 0.f);
  walk.for_each_row(v_cache, [=](int64_t pos, const scalar_t* v) {
    for (int64_t g = 0; g < group; ++g) {
      const float p = scores[g * seq_len + pos];
      float* a = acc + g * head_dim;
#pragma omp simd
      for (int64_t d = 0; d < head_dim; ++d) a[d] += p * to_float(v[d]);
    }
  });
  for (int64_t i = 0; i < group * head_dim; ++i) out[i] = static_cast<scalar_t>(acc[i]);
}

}  // namespace

// query: [num_seqs, num_heads, head_dim]; block_tables: [num_seqs, max_num_blocks] int32;
// seq_lens: [num_seqs] int32. Returns [num_seqs, num_heads, head_dim].
torch::Tensor paged_decode_attention(
    torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache,
    torch::Tensor block_tables, torch::Tensor seq_lens, double scale) {
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
  int64_t max_seq_len = 0;
  // Checked up front: the kernel reads through these without bounds checks.
  for (int64_t i = 0; i < num_seqs; ++i) {
    TORCH_CHECK(lens[i] >= 1 && lens[i] <= max_num_blocks * block_size, "seq_len outside its block table");
    max_seq_len = std::max<int64_t>(max_seq_len, lens[i]);
    for (int64_t b = 0; b < (lens[i] + block_size - 1) / block_size; ++b) {
      const int32_t block_id = tables[i * max_num_blocks + b];
      TORCH_CHECK(block_id >= 0 && block_id < num_blocks, "block id outside the cache");
    }
  }
  auto out = torch::empty_like(query);

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_decode_attention", [&] {
    const scalar_t* q = query.data_ptr<scalar_t>();
    const scalar_t* k = k_cache.data_ptr<scalar_t>();
    const scalar_t* v = v_cache.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
      // Scratch per thread, sized for the longest context in the batch.
      std::vector<float> q_buf(group * head_dim), acc(group * head_dim), scores(group * max_seq_len);
      for (int64_t task = begin; task < end; ++task) {
        const int64_t seq = task / num_kv_heads, kv_head = task % num_kv_heads;
        const int64_t offset = (seq * num_heads + kv_head * group) * head_dim;
        decode_task<scalar_t>(q + offset, k, v, tables + seq * max_num_blocks, lens[seq], kv_head, group,
                              head_dim, num_kv_heads, block_size, static_cast<float>(scale),
                              q_buf.data(), scores.data(), acc.data(), o + offset);
      }
    });
  });
  return out;
}
