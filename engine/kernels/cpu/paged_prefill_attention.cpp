// Paged prefill attention for the CPU: query chunks longer than one token (a whole
// prompt, a chunk after earlier context, a question after a cached prefix) attend
// causally to their sequence's context, read in place through the block table. The
// torch path gathered every context block into a copy per layer and ran SDPA with a
// mask tensor, which on this project's CPUs reached about a quarter of the matmul rate.
//
// Cache layout is the torch backend's, head-major blocks:
//   k_cache, v_cache: [num_blocks, num_kv_heads, block_size, head_dim]
// One task is (sequence, KV head, tile of queries): the tile's rows are every query
// head of the GQA group for each query, so each K/V block is read and converted once
// per tile and used by up to kTileRows rows. Per block, flash-attention style: scores
// for the tile, an online softmax (running max and sum per row, fp32), then the
// probability-weighted V rows added into fp32 accumulators. Keys past a row's own
// position are masked by count, never by a mask tensor.
//
// Scores without horizontal sums: the K block is laid out transposed once per tile
// ([head_dim][block_size] in fp32, or [head_dim / 2][block_size] bf16 pairs for the
// AVX512_BF16 dot product), so one vector FMA gives a row's score against a whole
// vector of tokens.
#include "vec_capability.h"
#include "vec_reduce.h"

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cstring>
#include <vector>

namespace {

using tokenloom_cpu::prefetch_rows;
using tokenloom_cpu::reduce_add;
using tokenloom_cpu::reduce_max;
using tokenloom_cpu::Vec;

constexpr int64_t kTileRows = 96;  // query rows (queries x group) per task
constexpr int kRowChunk = 8;       // rows whose score accumulators stay in registers together
constexpr float kMasked = -1e30f;  // not -inf: the build uses -ffast-math, which assumes finite values

struct Shape {
  int64_t num_heads, group, head_dim, block_size, block_stride, head_stride;
};

struct Task {
  int64_t seq, kv_head, first_query, num_queries, cost;
};

// Per-thread scratch, sized for the largest tile.
struct Scratch {
  std::vector<float> q, kt, v, p, o, m, l, corr;
  std::vector<uint32_t> q_pairs, k_pairs, v_pairs, p_pairs;
  std::vector<int64_t> limits;
  Scratch(const Shape& s) :
      q(kTileRows * s.head_dim), kt(s.head_dim * s.block_size), v(s.block_size * s.head_dim),
      p(kTileRows * s.block_size), o(kTileRows * s.head_dim), m(kTileRows), l(kTileRows * Vec::size()), corr(kTileRows),
      q_pairs(kTileRows * s.head_dim / 2 + 1), k_pairs(s.head_dim / 2 * s.block_size + 1),
      v_pairs(s.block_size / 2 * s.head_dim + 1), p_pairs(kTileRows * s.block_size / 2 + 1), limits(kTileRows) {}
};

template <typename scalar_t>
inline void to_float(const scalar_t* src, float* dst, int64_t n) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    std::memcpy(dst, src, n * sizeof(float));
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
  }
}

inline int64_t vec_count(int64_t remaining) { return std::min<int64_t>(Vec::size(), remaining); }

inline Vec load(const float* ptr, int64_t count) {
  return count == Vec::size() ? Vec::loadu(ptr) : Vec::loadu(ptr, count);
}

inline void store(const Vec& x, float* ptr, int64_t count) {
  if (count == Vec::size()) x.store(ptr);
  else x.store(ptr, count);
}

// The inner loops below are templates on their row (and vector) counts, picked from
// tables: with every count known at compile time the accumulators stay in registers
// (with run-time counts and conditions in the loop the compiler spilled them to the
// stack, and the kernel ran at a quarter of the speed).
template <int kRows>
void score_rows(const float* q, const float* kt, int64_t t0, int64_t count, const Shape& s, float* raw) {
  Vec acc[kRows];
#pragma GCC unroll 8
  for (int r = 0; r < kRows; ++r) acc[r] = Vec(0.f);
  for (int64_t d = 0; d < s.head_dim; ++d) {
    const Vec k = load(kt + d * s.block_size + t0, count);
#pragma GCC unroll 8
    for (int r = 0; r < kRows; ++r) acc[r] = at::vec::fmadd(Vec(q[r * s.head_dim + d]), k, acc[r]);
  }
#pragma GCC unroll 8
  for (int r = 0; r < kRows; ++r) store(acc[r], raw + r * s.block_size + t0, count);
}

using ScoreRowsFn = void (*)(const float*, const float*, int64_t, int64_t, const Shape&, float*);
constexpr ScoreRowsFn kScoreRows[kRowChunk] = {score_rows<1>, score_rows<2>, score_rows<3>, score_rows<4>,
                                               score_rows<5>, score_rows<6>, score_rows<7>, score_rows<8>};

// raw[r * block_size + t] = q[r] . k[t] for rows [0, num_rows), from the transposed fp32 block
// kt[d * block_size + t] and the fp32 (pre-scaled) query rows.
void score_block(const float* q, const float* kt, int64_t num_rows, const Shape& s, float* raw) {
  for (int64_t t0 = 0; t0 < s.block_size; t0 += Vec::size()) {
    const int64_t count = vec_count(s.block_size - t0);
    for (int64_t r0 = 0; r0 < num_rows; r0 += kRowChunk) {
      const int64_t rows = std::min<int64_t>(kRowChunk, num_rows - r0);
      kScoreRows[rows - 1](q + r0 * s.head_dim, kt, t0, count, s, raw + r0 * s.block_size);
    }
  }
}

#include "prefill_bf16_tiles.h"  // kHasBf16Dot, and the bf16 steps where the CPU has them

// Online softmax over one block for each row: raw scores in `p` become probabilities
// relative to the row's new running max (0 past the row's visible keys); corr[r] is what
// the row's earlier sums scale by. Each row's running sum stays a vector (l[r * lanes...])
// and is reduced once, at the end.
void softmax_block(float* p, const int64_t* limits, int64_t num_rows, float scale, const Shape& s, float* m,
                   float* l, float* corr) {
  for (int64_t r = 0; r < num_rows; ++r) {
    float* row = p + r * s.block_size;
    const int64_t limit = std::max<int64_t>(0, limits[r]);  // keys of this block the row may see
    if (limit == 0) {
      corr[r] = 1.f;
      std::fill(row, row + s.block_size, 0.f);
      continue;
    }
    Vec block_max(kMasked);
    for (int64_t t0 = 0; t0 < limit; t0 += Vec::size()) {
      const int64_t count = vec_count(limit - t0);
      const Vec x = load(row + t0, count) * Vec(scale);
      store(x, row + t0, count);
      block_max = at::vec::maximum(block_max, Vec::set(Vec(kMasked), x, count));
    }
    const float new_max = std::max(reduce_max(block_max), m[r]);
    corr[r] = std::exp(m[r] - new_max);
    m[r] = new_max;
    Vec sums = Vec::loadu(l + r * Vec::size()) * Vec(corr[r]);
    for (int64_t t0 = 0; t0 < s.block_size; t0 += Vec::size()) {
      const int64_t count = vec_count(s.block_size - t0);
      const int64_t visible = std::clamp<int64_t>(limit - t0, 0, count);
      const Vec e = Vec::set(Vec(0.f), (load(row + t0, count) - Vec(new_max)).exp_u20(), visible);
      store(e, row + t0, count);
      sums = sums + e;
    }
    sums.store(l + r * Vec::size());
  }
}

// Four rows by up to four vectors of head_dim (two on 16-register AVX2) summed in
// registers, so each V vector loaded serves four rows.
constexpr int kPvRows = 4;
constexpr int kPvVecs = Vec::size() >= 16 ? 4 : 2;

template <int kRows, int kVecs>
void weigh_rows(const float* p, const float* v, int64_t num_tokens, const float* corr, const Shape& s, float* o) {
  Vec acc[kRows][kVecs];
#pragma GCC unroll 4
  for (int r = 0; r < kRows; ++r) {
#pragma GCC unroll 4
    for (int c = 0; c < kVecs; ++c) acc[r][c] = Vec::loadu(o + r * s.head_dim + c * Vec::size()) * Vec(corr[r]);
  }
  for (int64_t t = 0; t < num_tokens; ++t) {
    Vec vt[kVecs];
#pragma GCC unroll 4
    for (int c = 0; c < kVecs; ++c) vt[c] = Vec::loadu(v + t * s.head_dim + c * Vec::size());
#pragma GCC unroll 4
    for (int r = 0; r < kRows; ++r) {
      const Vec pr(p[r * s.block_size + t]);
#pragma GCC unroll 4
      for (int c = 0; c < kVecs; ++c) acc[r][c] = at::vec::fmadd(pr, vt[c], acc[r][c]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < kRows; ++r) {
#pragma GCC unroll 4
    for (int c = 0; c < kVecs; ++c) acc[r][c].store(o + r * s.head_dim + c * Vec::size());
  }
}

using WeighRowsFn = void (*)(const float*, const float*, int64_t, const float*, const Shape&, float*);
template <int kRows>
constexpr WeighRowsFn weigh_rows_for(int vecs) {
  if constexpr (kPvVecs == 4) {
    return vecs == 1 ? weigh_rows<kRows, 1> : vecs == 2 ? weigh_rows<kRows, 2> : vecs == 3 ? weigh_rows<kRows, 3>
                                                                                             : weigh_rows<kRows, 4>;
  } else {
    return vecs == 1 ? weigh_rows<kRows, 1> : weigh_rows<kRows, 2>;
  }
}

// o[r] = o[r] * corr[r] + sum over the block's tokens t of p[r][t] * v[t] (p is 0 where the
// row may not look). The vector path needs head_dim to be a multiple of the vector width.
void weigh_block(const float* p, const float* v, int64_t num_tokens, const float* corr, int64_t num_rows,
                 const Shape& s, float* o) {
  if (s.head_dim % Vec::size() == 0) {
    for (int64_t r0 = 0; r0 < num_rows; r0 += kPvRows) {
      const int64_t rows = std::min<int64_t>(kPvRows, num_rows - r0);
      for (int64_t d0 = 0; d0 < s.head_dim; d0 += kPvVecs * Vec::size()) {
        const int vecs = std::min<int64_t>(kPvVecs, (s.head_dim - d0) / Vec::size());
        const WeighRowsFn fn = rows == 1 ? weigh_rows_for<1>(vecs) : rows == 2 ? weigh_rows_for<2>(vecs)
                             : rows == 3 ? weigh_rows_for<3>(vecs) : weigh_rows_for<4>(vecs);
        fn(p + r0 * s.block_size, v + d0, num_tokens, corr + r0, s, o + r0 * s.head_dim + d0);
      }
    }
    return;
  }
  for (int64_t r = 0; r < num_rows; ++r) {
    float* orow = o + r * s.head_dim;
    for (int64_t d = 0; d < s.head_dim; ++d) {
      float acc = orow[d] * corr[r];
      for (int64_t t = 0; t < num_tokens; ++t) acc += p[r * s.block_size + t] * v[t * s.head_dim + d];
      orow[d] = acc;
    }
  }
}

template <typename scalar_t>
void prefill_task(const Task& task, const scalar_t* query, const scalar_t* k_cache, const scalar_t* v_cache,
                  const int32_t* block_table, int64_t seq_len, int64_t query_start, int64_t query_len,
                  const Shape& s, float scale, Scratch& w, scalar_t* out) {
  const int64_t num_rows = task.num_queries * s.group;
  const int64_t first_pos = seq_len - query_len + task.first_query;  // context position of the tile's first query
  const int64_t last_pos = first_pos + task.num_queries - 1;
  // Row r is query j = r / group, head g = r % group of this KV head.
  auto row_offset = [&](int64_t r) {
    return ((query_start + task.first_query + r / s.group) * s.num_heads + task.kv_head * s.group + r % s.group) *
           s.head_dim;
  };
  bool use_bf16_dot = false;
  if constexpr (std::is_same_v<scalar_t, at::BFloat16> && kHasBf16Dot) {
    use_bf16_dot = s.block_size % 16 == 0 && s.head_dim % 32 == 0;
  }
  for (int64_t r = 0; r < num_rows; ++r) {
    if (use_bf16_dot) {
      std::memcpy(w.q_pairs.data() + r * (s.head_dim / 2), query + row_offset(r), s.head_dim * sizeof(scalar_t));
    } else {
      float* q = w.q.data() + r * s.head_dim;
      to_float(query + row_offset(r), q, s.head_dim);
      for (int64_t d = 0; d < s.head_dim; ++d) q[d] *= scale;
    }
  }
  std::fill(w.o.begin(), w.o.begin() + num_rows * s.head_dim, 0.f);
  std::fill(w.m.begin(), w.m.begin() + num_rows, kMasked);
  std::fill(w.l.begin(), w.l.begin() + num_rows * Vec::size(), 0.f);
  const int64_t block_bytes = s.block_size * s.head_dim * sizeof(scalar_t);
  const int64_t num_blocks = last_pos / s.block_size + 1;
  const int64_t head_offset = task.kv_head * s.head_stride;
  for (int64_t b = 0; b < num_blocks; ++b) {
    if (b + 1 < num_blocks) {
      prefetch_rows(k_cache + block_table[b + 1] * s.block_stride + head_offset, block_bytes);
      prefetch_rows(v_cache + block_table[b + 1] * s.block_stride + head_offset, block_bytes);
    }
    const scalar_t* kb = k_cache + block_table[b] * s.block_stride + head_offset;  // [block_size, head_dim]
    const scalar_t* vb = v_cache + block_table[b] * s.block_stride + head_offset;
    const int64_t start = b * s.block_size;
    const int64_t num_tokens = std::min(s.block_size, seq_len - start);
    int64_t* limits = w.limits.data();
    for (int64_t r = 0; r < num_rows; ++r) {
      limits[r] = std::min(num_tokens, first_pos + r / s.group - start + 1);
    }
    // Keys transposed once for the whole tile (stale slots past num_tokens are read but masked).
    const int64_t num_visible = std::min(num_tokens, last_pos - start + 1);  // tokens any row may see
    if (use_bf16_dot) {
#if defined(__AVX512BF16__) && defined(CPU_CAPABILITY_AVX512)
      const auto* kb16 = reinterpret_cast<const at::BFloat16*>(kb);
      const auto* vb16 = reinterpret_cast<const at::BFloat16*>(vb);
      pack_key_pairs(kb16, s, w.k_pairs.data());
      score_block_bf16(w.q_pairs.data(), w.k_pairs.data(), num_rows, s, w.p.data());
      softmax_block(w.p.data(), limits, num_rows, scale, s, w.m.data(), w.l.data(), w.corr.data());
      pack_prob_pairs(w.p.data(), num_rows, s, w.p_pairs.data());
      pack_value_pairs(vb16, num_visible, s, w.v_pairs.data());
      weigh_block_bf16(w.p_pairs.data(), w.v_pairs.data(), num_visible, w.corr.data(), num_rows, s, w.o.data());
#endif
      continue;
    }
    for (int64_t t = 0; t < s.block_size; ++t) {
      for (int64_t d = 0; d < s.head_dim; ++d) w.kt[d * s.block_size + t] = static_cast<float>(kb[t * s.head_dim + d]);
    }
    score_block(w.q.data(), w.kt.data(), num_rows, s, w.p.data());
    softmax_block(w.p.data(), limits, num_rows, 1.f, s, w.m.data(), w.l.data(), w.corr.data());
    const float* v = reinterpret_cast<const float*>(vb);
    if constexpr (!std::is_same_v<scalar_t, float>) {
      to_float(vb, w.v.data(), num_tokens * s.head_dim);
      v = w.v.data();
    }
    weigh_block(w.p.data(), v, num_visible, w.corr.data(), num_rows, s, w.o.data());
  }
  for (int64_t r = 0; r < num_rows; ++r) {
    const float inv_sum = 1.f / reduce_add(Vec::loadu(w.l.data() + r * Vec::size()));  // >= its own key's
    const float* o = w.o.data() + r * s.head_dim;
    scalar_t* dst = out + row_offset(r);
    for (int64_t d = 0; d < s.head_dim; ++d) dst[d] = static_cast<scalar_t>(o[d] * inv_sum);
  }
}

}  // namespace

// Writes attention for the query rows of the sequences in `seq_indices` into `out`, leaving
// every other row alone. query, out: [num_tokens, num_heads, head_dim]; block_tables:
// [num_seqs, max_num_blocks] int32; seq_lens: [num_seqs] int32; query_start_loc:
// [num_seqs + 1] int32; seq_indices: int32, the sequences to compute.
void paged_prefill_attention(
    torch::Tensor out, torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_tables,
    torch::Tensor seq_lens, torch::Tensor query_start_loc, torch::Tensor seq_indices, double scale) {
  TORCH_CHECK(query.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "bad shapes");
  TORCH_CHECK(out.sizes() == query.sizes() && out.is_contiguous(), "out must be a contiguous tensor shaped like query");
  TORCH_CHECK(query.device().is_cpu() && k_cache.device().is_cpu(), "CPU tensors only");
  const auto dtype = query.scalar_type();
  TORCH_CHECK(out.scalar_type() == dtype && k_cache.scalar_type() == dtype && v_cache.scalar_type() == dtype,
              "query, out and caches must share a dtype");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf, "fp32, bf16 or fp16 only");
  for (const auto* t : {&block_tables, &seq_lens, &query_start_loc, &seq_indices}) {
    TORCH_CHECK(t->scalar_type() == torch::kInt32, "block_tables, seq_lens, query_start_loc, seq_indices: int32");
  }
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  query = query.contiguous();
  block_tables = block_tables.contiguous();
  seq_lens = seq_lens.contiguous();
  query_start_loc = query_start_loc.contiguous();
  seq_indices = seq_indices.contiguous();
  const int64_t num_tokens = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t num_kv_heads = k_cache.size(1), block_size = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == head_dim && num_heads % num_kv_heads == 0, "head shapes disagree");
  const int64_t num_seqs = seq_lens.size(0), max_num_blocks = block_tables.size(1);
  TORCH_CHECK(block_tables.size(0) == num_seqs && query_start_loc.size(0) == num_seqs + 1, "one row per sequence");
  const int64_t group = num_heads / num_kv_heads;
  TORCH_CHECK(group <= kTileRows, "GQA group larger than a tile");
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* starts = query_start_loc.data_ptr<int32_t>();
  const int32_t* seqs = seq_indices.data_ptr<int32_t>();
  const int64_t num_cache_blocks = k_cache.size(0);

  // Checked up front (the kernel reads through these without bounds checks), and cut into
  // tasks: the tile's queries are consecutive, so its causal extent is its last query's.
  const int64_t tile_queries = std::max<int64_t>(1, kTileRows / group);
  std::vector<Task> tasks;
  for (int64_t i = 0; i < seq_indices.size(0); ++i) {
    const int64_t seq = seqs[i];
    TORCH_CHECK(seq >= 0 && seq < num_seqs, "sequence index out of range");
    const int64_t query_len = starts[seq + 1] - starts[seq], seq_len = lens[seq];
    TORCH_CHECK(starts[seq] >= 0 && query_len >= 1 && starts[seq + 1] <= num_tokens, "bad query_start_loc");
    TORCH_CHECK(seq_len >= query_len && seq_len <= max_num_blocks * block_size, "seq_len outside its block table");
    for (int64_t b = 0; b < (seq_len + block_size - 1) / block_size; ++b) {
      const int32_t block_id = tables[seq * max_num_blocks + b];
      TORCH_CHECK(block_id >= 0 && block_id < num_cache_blocks, "block id outside the cache");
    }
    for (int64_t first = 0; first < query_len; first += tile_queries) {
      const int64_t n = std::min(tile_queries, query_len - first);
      const int64_t context = seq_len - query_len + first + n;
      for (int64_t h = 0; h < num_kv_heads; ++h) tasks.push_back({seq, h, first, n, n * context});
    }
  }
  if (tasks.empty()) return;
  // Largest first, dealt round-robin: causal tiles differ in cost, and a contiguous split
  // would give one thread all the long ones.
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& b) { return a.cost > b.cost; });
  const Shape shape{num_heads, group, head_dim, block_size, num_kv_heads * block_size * head_dim,
                    block_size * head_dim};
  const int64_t num_workers = std::min<int64_t>(at::get_num_threads(), tasks.size());

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "paged_prefill_attention", [&] {
    const scalar_t* q = query.data_ptr<scalar_t>();
    const scalar_t* k = k_cache.data_ptr<scalar_t>();
    const scalar_t* v = v_cache.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, num_workers, 1, [&](int64_t begin, int64_t end) {
      Scratch scratch(shape);
      for (int64_t worker = begin; worker < end; ++worker) {
        for (size_t i = worker; i < tasks.size(); i += num_workers) {
          const Task& task = tasks[i];
          prefill_task<scalar_t>(task, q, k, v, tables + task.seq * max_num_blocks, lens[task.seq], starts[task.seq],
                                 starts[task.seq + 1] - starts[task.seq], shape, static_cast<float>(scale), scratch, o);
        }
      }
    });
  });
}
