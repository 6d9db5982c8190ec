// Paged decode attention for the CPU, for decodes whose sequences share a cached prefix
// (a system prompt: their block tables start with the same blocks). The decode kernel
// (paged_decode_attention.cpp) reads and scores a shared block once per sequence; here
// the group's query rows form one tile (attention_tiles.h), so each shared block is read,
// transposed and scored once per group, as a prompt's block is for its queries. Then each
// member's own blocks, for its rows only. A decode sees its whole context: no mask.
#include "attention_tiles.h"

namespace {

// Members [first_member, first_member + num_members) of a list of decodes that share their
// first shared_blocks blocks.
struct SharedTask {
  int64_t kv_head, first_member, num_members, shared_blocks;
};

// One tile: rows of task.num_members decodes (each the GQA group of this KV head) over the
// shared blocks together, then each member's own blocks for its rows.
template <typename scalar_t>
void shared_decode_task(const SharedTask& task, const int32_t* members, const scalar_t* query,
                        const scalar_t* k_cache, const scalar_t* v_cache, const int32_t* tables,
                        int64_t max_num_blocks, const int32_t* lens, const int32_t* starts, const Shape& s,
                        float scale, Scratch& w, scalar_t* out) {
  const int64_t num_rows = task.num_members * s.group;
  for (int64_t r = 0; r < num_rows; ++r) {
    const int64_t seq = members[task.first_member + r / s.group];
    w.row_offsets[r] = (starts[seq] * s.num_heads + task.kv_head * s.group + r % s.group) * s.head_dim;
  }
  const bool bf16_dot = uses_bf16_dot<scalar_t>(s);
  begin_tile(query, w.row_offsets.data(), num_rows, bf16_dot, scale, s, w);
  const int64_t head_offset = task.kv_head * s.head_stride;
  const int32_t* shared_table = tables + members[task.first_member] * max_num_blocks;
  const int64_t step = blocks_per_step(bf16_dot, s);
  for (int64_t b = 0; b < task.shared_blocks; b += step) {
    const int64_t n = std::min(step, task.shared_blocks - b);
    for (int64_t j = b + n; j < std::min(b + 2 * n, task.shared_blocks); ++j) {
      prefetch_block(k_cache, v_cache, shared_table[j], head_offset, s);
    }
    std::fill(w.limits.begin(), w.limits.begin() + num_rows, n * s.block_size);
    attend_blocks(k_cache, v_cache, shared_table + b, n, head_offset, n * s.block_size, n * s.block_size, 0, num_rows,
                  bf16_dot, scale, s, w);
  }
  for (int64_t i = 0; i < task.num_members; ++i) {
    const int64_t seq = members[task.first_member + i], seq_len = lens[seq];
    const int32_t* table = tables + seq * max_num_blocks;
    const int64_t num_blocks = (seq_len + s.block_size - 1) / s.block_size;
    for (int64_t b = task.shared_blocks; b < num_blocks; b += step) {
      const int64_t n = std::min(step, num_blocks - b);
      const int64_t num_tokens = std::min(n * s.block_size, seq_len - b * s.block_size);
      std::fill(w.limits.begin() + i * s.group, w.limits.begin() + (i + 1) * s.group, num_tokens);
      attend_blocks(k_cache, v_cache, table + b, n, head_offset, num_tokens, num_tokens, i * s.group, s.group,
                    bf16_dot, scale, s, w);
    }
  }
  end_tile(w.row_offsets.data(), num_rows, s, w, out);
}


}  // namespace

// Decode rows (one query each) of sequences in groups that share their first blocks, written
// into `out`; every other row is left alone. members: int32, the sequences, group by group;
// group_starts: [num_groups + 1] int32 offsets into members; shared_blocks: [num_groups]
// int32, how many leading blocks the group's members share (read through the first
// member's block table; each member's last token lies past them). Other arguments as
// paged_prefill_attention's.
void paged_shared_decode_attention(
    torch::Tensor out, torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_tables,
    torch::Tensor seq_lens, torch::Tensor query_start_loc, torch::Tensor members, torch::Tensor group_starts,
    torch::Tensor shared_blocks, double scale) {
  const Inputs in = check_inputs(out, query, k_cache, v_cache,
                                 {&block_tables, &seq_lens, &query_start_loc, &members, &group_starts, &shared_blocks});
  const int32_t* seqs = members.data_ptr<int32_t>();
  const int32_t* bounds = group_starts.data_ptr<int32_t>();
  const int32_t* shared = shared_blocks.data_ptr<int32_t>();
  const int64_t num_groups = shared_blocks.size(0);
  TORCH_CHECK(group_starts.size(0) == num_groups + 1 && bounds[0] == 0 && bounds[num_groups] == members.size(0),
              "group_starts must cut members into shared_blocks' groups");
  const int64_t tile_members = std::max<int64_t>(1, kTileRows / in.group);
  std::vector<SharedTask> tasks;
  std::vector<int64_t> costs;
  for (int64_t g = 0; g < num_groups; ++g) {
    TORCH_CHECK(bounds[g] < bounds[g + 1], "empty group");
    TORCH_CHECK(shared[g] >= 0, "negative shared_blocks");
    int64_t group_cost = 0;
    for (int64_t i = bounds[g]; i < bounds[g + 1]; ++i) {
      TORCH_CHECK(check_sequence(in, seqs[i], k_cache.size(0)) == 1, "a member is not a decode");
      TORCH_CHECK(shared[g] * in.block_size < in.lens[seqs[i]], "shared blocks reach a member's last token");
      group_cost += in.lens[seqs[i]];
    }
    for (int64_t first = bounds[g]; first < bounds[g + 1]; first += tile_members) {
      const int64_t n = std::min<int64_t>(tile_members, bounds[g + 1] - first);
      for (int64_t h = 0; h < in.num_kv_heads; ++h) {
        tasks.push_back({h, first, n, shared[g]});
        costs.push_back(group_cost * n / (bounds[g + 1] - bounds[g]));
      }
    }
  }
  run_tasks(tasks, costs, in.shape, query, k_cache, v_cache, out,
            [&](const SharedTask& task, Scratch& scratch, const auto* q, const auto* k, const auto* v, auto* o) {
              shared_decode_task(task, seqs, q, k, v, in.tables, in.max_num_blocks, in.lens, in.starts, in.shape,
                                 static_cast<float>(scale), scratch, o);
            });
}
