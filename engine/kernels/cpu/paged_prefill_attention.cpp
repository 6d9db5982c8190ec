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

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cstring>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
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
  std::vector<uint32_t> q_pairs, k_pairs;
  std::vector<int64_t> limits;
  Scratch(const Shape& s) :
      q(kTileRows * s.head_dim), kt(s.head_dim * s.block_size), v(s.block_size * s.head_dim),
      p(kTileRows * s.block_size), o(kTileRows * s.head_dim), m(kTileRows), l(kTileRows), corr(kTileRows),
      q_pairs(kTileRows * s.head_dim / 2 + 1), k_pairs(s.head_dim / 2 * s.block_size + 1), limits(kTileRows) {}
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

inline void prefetch_rows(const void* start, int64_t num_bytes) {
  const char* p = static_cast<const char*>(start);
  for (int64_t offset = 0; offset < num_bytes; offset += 64) __builtin_prefetch(p + offset);
}

// raw[r * block_size + t] = q[r] . k[t] for rows [0, num_rows), from the transposed fp32 block
// kt[d * block_size + t] and the fp32 (pre-scaled) query rows.
void score_block(const float* q, const float* kt, int64_t num_rows, const Shape& s, float* raw) {
  for (int64_t t0 = 0; t0 < s.block_size; t0 += Vec::size()) {
    const int64_t count = vec_count(s.block_size - t0);
    for (int64_t r0 = 0; r0 < num_rows; r0 += kRowChunk) {
      const int64_t rows = std::min<int64_t>(kRowChunk, num_rows - r0);
      Vec acc[kRowChunk];
      for (int r = 0; r < kRowChunk; ++r) acc[r] = Vec(0.f);
      for (int64_t d = 0; d < s.head_dim; ++d) {
        const Vec k = load(kt + d * s.block_size + t0, count);
        const float* qd = q + r0 * s.head_dim + d;
        for (int r = 0; r < kRowChunk; ++r) {
          if (r < rows) acc[r] = at::vec::fmadd(Vec(qd[r * s.head_dim]), k, acc[r]);
        }
      }
      for (int64_t r = 0; r < rows; ++r) store(acc[r], raw + (r0 + r) * s.block_size + t0, count);
    }
  }
}

#if defined(__AVX512BF16__) && defined(CPU_CAPABILITY_AVX512)
constexpr bool kHasBf16Dot = true;
// The same from bf16 pairs: k_pairs[p * block_size + t] holds elements 2p, 2p+1 of token t's
// key, q_pairs[r * head_dim / 2 + p] those of row r's query; one vdpbf16ps adds both
// products for 16 tokens. Needs block_size % 16 == 0. Scores come out unscaled.
void score_block_bf16(const uint32_t* q_pairs, const uint32_t* k_pairs, int64_t num_rows, const Shape& s,
                      float* raw) {
  const int64_t num_pairs = s.head_dim / 2;
  for (int64_t t0 = 0; t0 < s.block_size; t0 += 16) {
    for (int64_t r0 = 0; r0 < num_rows; r0 += kRowChunk) {
      const int64_t rows = std::min<int64_t>(kRowChunk, num_rows - r0);
      __m512 acc[kRowChunk];
      for (int r = 0; r < kRowChunk; ++r) acc[r] = _mm512_setzero_ps();
      for (int64_t p = 0; p < num_pairs; ++p) {
        const __m512bh k = (__m512bh)_mm512_loadu_si512(k_pairs + p * s.block_size + t0);
        const uint32_t* qp = q_pairs + r0 * num_pairs + p;
        for (int r = 0; r < kRowChunk; ++r) {
          if (r < rows) acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_set1_epi32(qp[r * num_pairs]), k);
        }
      }
      for (int64_t r = 0; r < rows; ++r) _mm512_storeu_ps(raw + (r0 + r) * s.block_size + t0, acc[r]);
    }
  }
}
#else
constexpr bool kHasBf16Dot = false;
#endif

// Online softmax over one block for each row: raw scores in `p` become probabilities
// relative to the row's new running max; corr[r] is what the row's earlier sums scale by.
void softmax_block(float* p, const int64_t* limits, int64_t num_rows, float scale, const Shape& s, float* m,
                   float* l, float* corr) {
  for (int64_t r = 0; r < num_rows; ++r) {
    float* row = p + r * s.block_size;
    const int64_t limit = limits[r];  // keys of this block the row may see
    if (limit <= 0) {
      corr[r] = 1.f;
      continue;
    }
    Vec block_max(kMasked);
    for (int64_t t0 = 0; t0 < limit; t0 += Vec::size()) {
      const int64_t count = vec_count(limit - t0);
      const Vec x = load(row + t0, count) * Vec(scale);
      store(x, row + t0, count);
      block_max = at::vec::maximum(block_max, Vec::set(Vec(kMasked), x, count));
    }
    float new_max = kMasked;
    alignas(64) float lanes[Vec::size()];
    block_max.store(lanes);
    for (int64_t i = 0; i < Vec::size(); ++i) new_max = std::max(new_max, lanes[i]);
    new_max = std::max(new_max, m[r]);
    Vec sums(0.f);
    for (int64_t t0 = 0; t0 < limit; t0 += Vec::size()) {
      const int64_t count = vec_count(limit - t0);
      const Vec e = Vec::set(Vec(0.f), (load(row + t0, count) - Vec(new_max)).exp_u20(), count);
      store(e, row + t0, count);
      sums = sums + e;
    }
    sums.store(lanes);
    float sum = 0.f;
    for (int64_t i = 0; i < Vec::size(); ++i) sum += lanes[i];
    corr[r] = std::exp(m[r] - new_max);
    l[r] = l[r] * corr[r] + sum;
    m[r] = new_max;
  }
}

// o[r] = o[r] * corr[r] + sum over the row's visible tokens t of p[r][t] * v[t].
void weigh_block(const float* p, const float* v, const int64_t* limits, const float* corr, int64_t num_rows,
                 const Shape& s, float* o) {
  for (int64_t r = 0; r < num_rows; ++r) {
    if (limits[r] <= 0) continue;
    const float* pr = p + r * s.block_size;
    float* orow = o + r * s.head_dim;
    for (int64_t d0 = 0; d0 < s.head_dim; d0 += Vec::size()) {
      const int64_t count = vec_count(s.head_dim - d0);
      Vec acc = load(orow + d0, count) * Vec(corr[r]);
      for (int64_t t = 0; t < limits[r]; ++t) acc = at::vec::fmadd(Vec(pr[t]), load(v + t * s.head_dim + d0, count), acc);
      store(acc, orow + d0, count);
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
    use_bf16_dot = s.block_size % 16 == 0 && s.head_dim % 2 == 0;
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
  std::fill(w.l.begin(), w.l.begin() + num_rows, 0.f);
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
    if (use_bf16_dot) {
      const uint32_t* kw = reinterpret_cast<const uint32_t*>(kb);  // [block_size, head_dim / 2] pairs
      const int64_t num_pairs = s.head_dim / 2;
      for (int64_t t = 0; t < s.block_size; ++t) {
        for (int64_t p = 0; p < num_pairs; ++p) w.k_pairs[p * s.block_size + t] = kw[t * num_pairs + p];
      }
#if defined(__AVX512BF16__) && defined(CPU_CAPABILITY_AVX512)
      score_block_bf16(w.q_pairs.data(), w.k_pairs.data(), num_rows, s, w.p.data());
#endif
    } else {
      for (int64_t t = 0; t < s.block_size; ++t) {
        for (int64_t d = 0; d < s.head_dim; ++d) w.kt[d * s.block_size + t] = static_cast<float>(kb[t * s.head_dim + d]);
      }
      score_block(w.q.data(), w.kt.data(), num_rows, s, w.p.data());
    }
    softmax_block(w.p.data(), limits, num_rows, use_bf16_dot ? scale : 1.f, s, w.m.data(), w.l.data(), w.corr.data());
    const float* v = reinterpret_cast<const float*>(vb);
    if constexpr (!std::is_same_v<scalar_t, float>) {
      to_float(vb, w.v.data(), num_tokens * s.head_dim);
      v = w.v.data();
    }
    weigh_block(w.p.data(), v, limits, w.corr.data(), num_rows, s, w.o.data());
  }
  for (int64_t r = 0; r < num_rows; ++r) {
    const float inv_sum = 1.f / w.l[r];  // every row sees at least its own key
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
