// The tiles both CPU attention kernels are built of: paged_prefill_attention.cpp (query
// chunks) and paged_shared_decode_attention.cpp (decodes that share a cached prefix).
// Included by those two files only; everything here is in an anonymous namespace, one
// copy per file.
//
// Cache layout is the torch backend's, head-major blocks:
//   k_cache, v_cache: [num_blocks, num_kv_heads, block_size, head_dim]
// A tile is up to kTileRows query rows of one KV head (each row a query head of the GQA
// group), so each K/V block is read and converted once per tile and used by every row.
// Per step of blocks, flash-attention style: scores for the tile, an online softmax
// (running max and sum per row, fp32), then the probability-weighted V rows added into
// fp32 accumulators. Keys past a row's visible count, and before its first visible key
// (a sliding window), are masked by count, never by a mask tensor.
//
// Scores without horizontal sums: the K block is laid out transposed once per tile
// ([head_dim][block_size] in fp32, or [head_dim / 2][block_size] bf16 pairs for the
// AVX512_BF16 dot product), so one vector FMA gives a row's score against a whole
// vector of tokens.
#pragma once

#include "vec_capability.h"
#include "vec_reduce.h"

#include <torch/types.h>
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
constexpr float kMasked = -1e30f;  // not -inf: a row masked so far keeps exp(m - new_max) finite, never inf - inf

struct Shape {
  int64_t num_heads, group, head_dim, block_size, block_stride, head_stride;
};

// Per-thread scratch, sized for the largest tile.
struct Scratch {
  std::vector<float> q, kt, v, p, o, m, l, corr;
  std::vector<uint32_t> q_pairs, k_pairs, v_pairs, p_pairs;
  std::vector<int64_t> limits, firsts, row_offsets;
  // width: the most tokens one softmax step takes (kTileTokens on the bf16 path)
  Scratch(const Shape& s, int64_t width) :
      q(kTileRows * s.head_dim), kt(s.head_dim * s.block_size), v(s.block_size * s.head_dim),
      p(kTileRows * width), o(kTileRows * s.head_dim), m(kTileRows), l(kTileRows * Vec::size()), corr(kTileRows),
      q_pairs(kTileRows * s.head_dim / 2 + 1), k_pairs(s.head_dim / 2 * width + 1),
      v_pairs(width / 2 * s.head_dim + 1), p_pairs(kTileRows * width / 2 + 1), limits(kTileRows),
      firsts(kTileRows), row_offsets(kTileRows) {}
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
// relative to the row's new running max (0 outside the row's visible keys [firsts[r],
// limits[r])); corr[r] is what the row's earlier sums scale by. Each row's running sum
// stays a vector (l[r * lanes...]) and is reduced once, at the end.
void softmax_block(float* p, const int64_t* limits, const int64_t* firsts, int64_t num_rows, float scale,
                   const Shape& s, float* m, float* l, float* corr) {
  for (int64_t r = 0; r < num_rows; ++r) {
    float* row = p + r * s.block_size;
    const int64_t limit = std::max<int64_t>(0, limits[r]);  // keys of this block the row may see ...
    const int64_t first = std::clamp<int64_t>(firsts[r], 0, limit);  // ... from this one (its window's start)
    if (limit == first) {
      corr[r] = 1.f;
      std::fill(row, row + s.block_size, 0.f);
      continue;
    }
    Vec block_max(kMasked);
    for (int64_t t0 = 0; t0 < limit; t0 += Vec::size()) {
      const int64_t count = vec_count(limit - t0);
      const Vec x = load(row + t0, count) * Vec(scale);
      store(x, row + t0, count);
      Vec visible = Vec::set(Vec(kMasked), x, count);
      if (t0 < first) visible = Vec::set(visible, Vec(kMasked), std::min<int64_t>(first - t0, count));
      block_max = at::vec::maximum(block_max, visible);
    }
    const float new_max = std::max(reduce_max(block_max), m[r]);
    corr[r] = std::exp(m[r] - new_max);
    m[r] = new_max;
    Vec sums = Vec::loadu(l + r * Vec::size()) * Vec(corr[r]);
    for (int64_t t0 = 0; t0 < s.block_size; t0 += Vec::size()) {
      const int64_t count = vec_count(s.block_size - t0);
      const int64_t visible = std::clamp<int64_t>(limit - t0, 0, count);
      Vec e = Vec::set(Vec(0.f), (load(row + t0, count) - Vec(new_max)).exp_u20(), visible);
      if (t0 < first) e = Vec::set(e, Vec(0.f), std::min<int64_t>(first - t0, count));
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

// Which tile path a dtype and shape take: bf16 pairs where the CPU has the bf16 dot product.
template <typename scalar_t>
bool uses_bf16_dot(const Shape& s) {
  if constexpr (std::is_same_v<scalar_t, at::BFloat16> && kHasBf16Dot) {
    return s.block_size % 16 == 0 && s.head_dim % 32 == 0;
  }
  return false;
}

// Loads the tile's query rows (row r from query + row_offsets[r]) and clears the running
// max, sums and outputs of rows [0, num_rows).
template <typename scalar_t>
void begin_tile(const scalar_t* query, const int64_t* row_offsets, int64_t num_rows, bool bf16_dot, float scale,
                const Shape& s, Scratch& w) {
  for (int64_t r = 0; r < num_rows; ++r) {
    if (bf16_dot) {
      std::memcpy(w.q_pairs.data() + r * (s.head_dim / 2), query + row_offsets[r], s.head_dim * sizeof(scalar_t));
    } else {
      float* q = w.q.data() + r * s.head_dim;
      to_float(query + row_offsets[r], q, s.head_dim);
      for (int64_t d = 0; d < s.head_dim; ++d) q[d] *= scale;
    }
  }
  std::fill(w.o.begin(), w.o.begin() + num_rows * s.head_dim, 0.f);
  std::fill(w.m.begin(), w.m.begin() + num_rows, kMasked);
  std::fill(w.firsts.begin(), w.firsts.begin() + num_rows, 0);  // no window unless the caller sets one
  std::fill(w.l.begin(), w.l.begin() + num_rows * Vec::size(), 0.f);
}

// How many blocks one online-softmax step takes. The softmax's per-row work (a max, an
// exp, the rescale of the sums) is paid per step, so the bf16 path takes blocks together,
// kTileTokens tokens at a time: with 16-token blocks it had cost about as much as the dot
// products themselves. The fp32 path goes block by block.
constexpr int64_t kTileTokens = 64;

inline int64_t blocks_per_step(bool bf16_dot, const Shape& s) {
  return bf16_dot ? std::max<int64_t>(1, kTileTokens / s.block_size) : 1;
}

// Consecutive K/V blocks (block_ids[0, num_blocks), holding num_tokens context tokens) for
// tile rows [row0, row0 + num_rows): scores, the online softmax with keys
// [w.firsts[row0 + r], w.limits[row0 + r]) visible to row r (counted from the first block's
// start), and the weighted values.
// Keys are transposed once for all the rows (stale slots past num_tokens are read but
// masked); num_visible is the most keys any of the rows may see.
template <typename scalar_t>
void attend_blocks(const scalar_t* k_cache, const scalar_t* v_cache, const int32_t* block_ids, int64_t num_blocks,
                   int64_t head_offset, int64_t num_tokens, int64_t num_visible, int64_t row0, int64_t num_rows,
                   bool bf16_dot, float scale, const Shape& s, Scratch& w) {
  float* p = w.p.data() + row0 * s.block_size * num_blocks;
  float* m = w.m.data() + row0;
  float* l = w.l.data() + row0 * Vec::size();
  float* corr = w.corr.data() + row0;
  float* o = w.o.data() + row0 * s.head_dim;
  const int64_t* limits = w.limits.data() + row0;
  const int64_t* firsts = w.firsts.data() + row0;
  if (bf16_dot) {
#if defined(__AVX512BF16__) && defined(CPU_CAPABILITY_AVX512)
    Shape tile = s;  // the blocks side by side, as one wide block
    tile.block_size = s.block_size * num_blocks;
    p = w.p.data() + row0 * tile.block_size;
    for (int64_t j = 0; j < num_blocks; ++j) {
      const auto* kb = reinterpret_cast<const at::BFloat16*>(k_cache + block_ids[j] * s.block_stride + head_offset);
      pack_key_pairs(kb, s, tile.block_size, w.k_pairs.data() + j * s.block_size);
    }
    score_block_bf16(w.q_pairs.data() + row0 * (s.head_dim / 2), w.k_pairs.data(), num_rows, tile, p);
    softmax_block(p, limits, firsts, num_rows, scale, tile, m, l, corr);
    pack_prob_pairs(p, num_rows, tile, w.p_pairs.data());
    for (int64_t j = 0; j * s.block_size < num_visible; ++j) {
      const auto* vb = reinterpret_cast<const at::BFloat16*>(v_cache + block_ids[j] * s.block_stride + head_offset);
      pack_value_pairs(vb, std::min(s.block_size, num_visible - j * s.block_size), s,
                       w.v_pairs.data() + j * (s.block_size / 2) * s.head_dim);
    }
    weigh_block_bf16(w.p_pairs.data(), w.v_pairs.data(), num_visible, corr, num_rows, tile, o);
#endif
    return;
  }
  TORCH_CHECK(num_blocks == 1, "the fp32 tile takes one block a step");
  const scalar_t* kb = k_cache + block_ids[0] * s.block_stride + head_offset;
  const scalar_t* vb = v_cache + block_ids[0] * s.block_stride + head_offset;
  for (int64_t t = 0; t < s.block_size; ++t) {
    for (int64_t d = 0; d < s.head_dim; ++d) w.kt[d * s.block_size + t] = static_cast<float>(kb[t * s.head_dim + d]);
  }
  score_block(w.q.data() + row0 * s.head_dim, w.kt.data(), num_rows, s, p);
  softmax_block(p, limits, firsts, num_rows, 1.f, s, m, l, corr);
  const float* v = reinterpret_cast<const float*>(vb);
  if constexpr (!std::is_same_v<scalar_t, float>) {
    to_float(vb, w.v.data(), num_tokens * s.head_dim);
    v = w.v.data();
  }
  weigh_block(p, v, num_visible, corr, num_rows, s, o);
}

// Writes rows [0, num_rows) of the tile, normalized, to out + row_offsets[r].
template <typename scalar_t>
void end_tile(const int64_t* row_offsets, int64_t num_rows, const Shape& s, Scratch& w, scalar_t* out) {
  for (int64_t r = 0; r < num_rows; ++r) {
    const float inv_sum = 1.f / reduce_add(Vec::loadu(w.l.data() + r * Vec::size()));  // >= its own key's
    const float* o = w.o.data() + r * s.head_dim;
    scalar_t* dst = out + row_offsets[r];
    for (int64_t d = 0; d < s.head_dim; ++d) dst[d] = static_cast<scalar_t>(o[d] * inv_sum);
  }
}

template <typename scalar_t>
void prefetch_block(const scalar_t* k_cache, const scalar_t* v_cache, int64_t block_id, int64_t head_offset,
                    const Shape& s) {
  const int64_t block_bytes = s.block_size * s.head_dim * sizeof(scalar_t);
  prefetch_rows(k_cache + block_id * s.block_stride + head_offset, block_bytes);
  prefetch_rows(v_cache + block_id * s.block_stride + head_offset, block_bytes);
}


}  // namespace

namespace {

// The arguments both entry points share, checked: the kernels read through them without bounds checks.
struct Inputs {
  int64_t num_tokens, num_heads, head_dim, num_kv_heads, block_size, num_seqs, max_num_blocks, group;
  const int32_t *lens, *tables, *starts;
  Shape shape;
};

Inputs check_inputs(const torch::Tensor& out, torch::Tensor& query, const torch::Tensor& k_cache,
                    const torch::Tensor& v_cache, std::vector<torch::Tensor*> int_args) {
  TORCH_CHECK(query.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "bad shapes");
  TORCH_CHECK(out.sizes() == query.sizes() && out.is_contiguous(), "out must be a contiguous tensor shaped like query");
  TORCH_CHECK(query.device().is_cpu() && k_cache.device().is_cpu(), "CPU tensors only");
  const auto dtype = query.scalar_type();
  TORCH_CHECK(out.scalar_type() == dtype && k_cache.scalar_type() == dtype && v_cache.scalar_type() == dtype,
              "query, out and caches must share a dtype");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf, "fp32, bf16 or fp16 only");
  for (auto* t : int_args) {
    TORCH_CHECK(t->scalar_type() == torch::kInt32, "block tables, lengths and indices must be int32");
    *t = t->contiguous();
  }
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  query = query.contiguous();
  // int_args[0..2]: block_tables, seq_lens, query_start_loc
  const torch::Tensor &block_tables = *int_args[0], &seq_lens = *int_args[1], &query_start_loc = *int_args[2];
  Inputs in;
  in.num_tokens = query.size(0), in.num_heads = query.size(1), in.head_dim = query.size(2);
  in.num_kv_heads = k_cache.size(1), in.block_size = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == in.head_dim && in.num_heads % in.num_kv_heads == 0, "head shapes disagree");
  in.num_seqs = seq_lens.size(0), in.max_num_blocks = block_tables.size(1);
  TORCH_CHECK(block_tables.size(0) == in.num_seqs && query_start_loc.size(0) == in.num_seqs + 1,
              "one row per sequence");
  in.group = in.num_heads / in.num_kv_heads;
  TORCH_CHECK(in.group <= kTileRows, "GQA group larger than a tile");
  in.lens = seq_lens.data_ptr<int32_t>();
  in.tables = block_tables.data_ptr<int32_t>();
  in.starts = query_start_loc.data_ptr<int32_t>();
  in.shape = Shape{in.num_heads, in.group, in.head_dim, in.block_size, in.num_kv_heads * in.block_size * in.head_dim,
                   in.block_size * in.head_dim};
  return in;
}

// Checks sequence `seq`'s query rows, length and the block ids it reads (with a sliding
// window, those from its first query's window on); returns its query length.
int64_t check_sequence(const Inputs& in, int64_t seq, int64_t num_cache_blocks, int64_t window = 0) {
  TORCH_CHECK(seq >= 0 && seq < in.num_seqs, "sequence index out of range");
  const int64_t query_len = in.starts[seq + 1] - in.starts[seq], seq_len = in.lens[seq];
  TORCH_CHECK(in.starts[seq] >= 0 && query_len >= 1 && in.starts[seq + 1] <= in.num_tokens, "bad query_start_loc");
  TORCH_CHECK(seq_len >= query_len && seq_len <= in.max_num_blocks * in.block_size, "seq_len outside its block table");
  const int64_t first_block =
      window > 0 ? std::max<int64_t>(0, seq_len - query_len - window + 1) / in.block_size : 0;
  for (int64_t b = first_block; b < (seq_len + in.block_size - 1) / in.block_size; ++b) {
    const int32_t block_id = in.tables[seq * in.max_num_blocks + b];
    TORCH_CHECK(block_id >= 0 && block_id < num_cache_blocks, "block id outside the cache");
  }
  return query_len;
}

// Runs run(task, scratch, q, k, v, o) for every task on the intra-op threads, with the
// tensors' data as pointers of their dtype (q, k, v and o: query, k_cache, v_cache, out),
// largest task first, dealt round-robin: tasks differ in cost, and a contiguous split
// would give one thread all the long ones.
template <typename TaskT, typename Fn>
void run_tasks(const std::vector<TaskT>& tasks, const std::vector<int64_t>& costs, const Shape& shape,
               const torch::Tensor& query, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
               const torch::Tensor& out, Fn run) {
  if (tasks.empty()) return;
  std::vector<int64_t> order(tasks.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return costs[a] > costs[b]; });
  const int64_t num_workers = std::min<int64_t>(at::get_num_threads(), tasks.size());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged attention tiles", [&] {
    const scalar_t* q = query.data_ptr<scalar_t>();
    const scalar_t* k = k_cache.data_ptr<scalar_t>();
    const scalar_t* v = v_cache.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, num_workers, 1, [&](int64_t begin, int64_t end) {
      Scratch scratch(shape, std::max(shape.block_size, kTileTokens));
      for (int64_t worker = begin; worker < end; ++worker) {
        for (size_t i = worker; i < order.size(); i += num_workers) run(tasks[order[i]], scratch, q, k, v, o);
      }
    });
  });
}

}  // namespace
