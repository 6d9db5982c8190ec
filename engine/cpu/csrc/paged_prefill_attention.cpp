// Paged prefill attention for the CPU: query chunks longer than one token (a whole
// prompt, a chunk after earlier context, a question after a cached prefix) attend
// causally to their sequence's context, read in place through the block table. The
// torch path gathered every context block into a copy per layer and ran SDPA with a
// mask tensor, which on this project's CPUs reached about a quarter of the matmul rate.
// A sliding-window layer passes its window: a query at position p sees keys
// p - window < k <= p, and a tile skips the blocks before its first query's window.
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
#include "attention_tiles.h"

namespace {

struct Task {
  int64_t seq, kv_head, first_query, num_queries;
};

template <typename scalar_t>
void prefill_task(const Task& task, const scalar_t* query, const scalar_t* k_cache, const scalar_t* v_cache,
                  const int32_t* block_table, int64_t seq_len, int64_t query_start, int64_t query_len,
                  const Shape& s, float scale, int64_t window, Scratch& w, scalar_t* out) {
  const int64_t num_rows = task.num_queries * s.group;
  const int64_t first_pos = seq_len - query_len + task.first_query;  // context position of the tile's first query
  const int64_t last_pos = first_pos + task.num_queries - 1;
  // Row r is query j = r / group, head g = r % group of this KV head.
  for (int64_t r = 0; r < num_rows; ++r) {
    w.row_offsets[r] =
        ((query_start + task.first_query + r / s.group) * s.num_heads + task.kv_head * s.group + r % s.group) *
        s.head_dim;
  }
  const bool bf16_dot = uses_bf16_dot<scalar_t>(s);
  begin_tile(query, w.row_offsets.data(), num_rows, bf16_dot, scale, s, w);
  const int64_t num_blocks = last_pos / s.block_size + 1;
  const int64_t first_block = window > 0 ? std::max<int64_t>(0, first_pos - window + 1) / s.block_size : 0;
  const int64_t head_offset = task.kv_head * s.head_stride;
  const int64_t step = blocks_per_step(bf16_dot, s);
  for (int64_t b = first_block; b < num_blocks; b += step) {
    const int64_t n = std::min(step, num_blocks - b);
    for (int64_t j = b + n; j < std::min(b + 2 * n, num_blocks); ++j) {
      prefetch_block(k_cache, v_cache, block_table[j], head_offset, s);
    }
    const int64_t start = b * s.block_size;
    const int64_t num_tokens = std::min(n * s.block_size, seq_len - start);
    for (int64_t r = 0; r < num_rows; ++r) {
      w.limits[r] = std::min(num_tokens, first_pos + r / s.group - start + 1);
      if (window > 0) w.firsts[r] = first_pos + r / s.group - window + 1 - start;
    }
    const int64_t num_visible = std::min(num_tokens, last_pos - start + 1);  // tokens any row may see
    attend_blocks(k_cache, v_cache, block_table + b, n, head_offset, num_tokens, num_visible, 0, num_rows, bf16_dot,
                  scale, s, w);
  }
  end_tile(w.row_offsets.data(), num_rows, s, w, out);
}

}  // namespace

// Writes attention for the query rows of the sequences in `seq_indices` into `out`, leaving
// every other row alone. query, out: [num_tokens, num_heads, head_dim]; block_tables:
// [num_seqs, max_num_blocks] int32; seq_lens: [num_seqs] int32; query_start_loc:
// [num_seqs + 1] int32; seq_indices: int32, the sequences to compute; window: a sliding
// window's size, 0 or less for none.
void paged_prefill_attention(
    torch::Tensor out, torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_tables,
    torch::Tensor seq_lens, torch::Tensor query_start_loc, torch::Tensor seq_indices, double scale, int64_t window) {
  const Inputs in = check_inputs(out, query, k_cache, v_cache, {&block_tables, &seq_lens, &query_start_loc, &seq_indices});
  const int32_t* seqs = seq_indices.data_ptr<int32_t>();
  // Cut into tasks: a tile's queries are consecutive, so its causal extent is its last query's.
  const int64_t tile_queries = std::max<int64_t>(1, kTileRows / in.group);
  std::vector<Task> tasks;
  std::vector<int64_t> costs;
  for (int64_t i = 0; i < seq_indices.size(0); ++i) {
    const int64_t seq = seqs[i];
    const int64_t query_len = check_sequence(in, seq, k_cache.size(0), window), seq_len = in.lens[seq];
    for (int64_t first = 0; first < query_len; first += tile_queries) {
      const int64_t n = std::min(tile_queries, query_len - first);
      const int64_t context = seq_len - query_len + first + n;
      for (int64_t h = 0; h < in.num_kv_heads; ++h) {
        tasks.push_back({seq, h, first, n});
        costs.push_back(n * (window > 0 ? std::min(context, window + n) : context));
      }
    }
  }
  run_tasks(tasks, costs, in.shape, query, k_cache, v_cache, out,
            [&](const Task& task, Scratch& scratch, const auto* q, const auto* k, const auto* v, auto* o) {
              prefill_task(task, q, k, v, in.tables + task.seq * in.max_num_blocks, in.lens[task.seq],
                           in.starts[task.seq], in.starts[task.seq + 1] - in.starts[task.seq], in.shape,
                           static_cast<float>(scale), window, scratch, o);
            });
}
