// LoRA adapters inside the decode stack (decode_stack.cpp): after an adapted projection,
// y[rows of slot s] += ((x[rows] · A_sᵀ) · B_s) · scale_s, one shrink and one expand per slot of
// the step (S-LoRA's and Punica's SGMV), as engine/lora/lora_layers.py's LoRALinear computes it.
// A and B are the adapter pool's own tensors (engine/lora/adapter_pool.py), held by reference:
// loading an adapter into a slot writes into them, and the stack sees it without a copy. The pool
// keeps B as [slots, P * R, out] (each adapter's B transposed once, as it is loaded), so the expand
// streams B's rows along the output features with no horizontal sums.
//
// fp32 (the activations of fp32, int8, int4 and GGUF models) runs the kernel below: the shrink
// shares out (group, rank row) items, each a dot product over the input per row of the group; the
// expand shares out (group, 64 output features) items, each row's outputs accumulated in vectors
// over the rank. Other dtypes take ATen's matmuls, LoRALinear's own ops.
#pragma once

#include "vec_reduce.h"  // first: it picks ATen's vector width
#include "share_out.h"

#include <ATen/ATen.h>
#include <torch/types.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <vector>

namespace tokenloom_cpu {

// One adapted projection's pool tensors; both empty where the pool adapts nothing (an MoE's MLP).
struct LoRAWeights {
  torch::Tensor a;  // [max_loras, W = P * max_rank, in]
  torch::Tensor b;  // [max_loras, W, out]

  bool is_adapted() const { return a.defined() && a.numel() > 0; }
};

// One step's rows grouped by slot (engine.lora.lora_layers.group_rows); rows of the base are in none.
struct LoRAGroups {
  std::vector<int64_t> slots;
  std::vector<torch::Tensor> rows;  // [n] int64 row indices each; empty: every row of the step
  std::vector<double> scales;  // each group's slot's lora_alpha / r (or / sqrt(r))
  std::vector<std::vector<int64_t>> row_ids;  // `rows` as lists (make_lora_groups)

  bool empty() const { return slots.empty(); }
};

inline LoRAGroups make_lora_groups(std::vector<int64_t> slots, std::vector<torch::Tensor> rows,
                                   std::vector<double> scales, int64_t num_rows) {
  TORCH_CHECK(rows.size() == slots.size() && scales.size() == slots.size(), "one row set and one scale per LoRA slot");
  LoRAGroups groups{std::move(slots), std::move(rows), std::move(scales), {}};
  for (const torch::Tensor& rows_g : groups.rows) {
    std::vector<int64_t> ids(rows_g.numel() == 0 ? num_rows : rows_g.numel());
    if (rows_g.numel() == 0) {
      std::iota(ids.begin(), ids.end(), 0);
    } else {
      const torch::Tensor r = rows_g.to(at::kLong).contiguous();
      std::copy(r.data_ptr<int64_t>(), r.data_ptr<int64_t>() + r.numel(), ids.begin());
      for (int64_t id : ids) TORCH_CHECK(id >= 0 && id < num_rows, "LoRA row ", id, " out of ", num_rows);
    }
    groups.row_ids.push_back(std::move(ids));
  }
  return groups;
}

namespace lora_detail {

inline float dot(const float* x, const float* a, int64_t n) {
  Vec acc0(0.f), acc1(0.f);
  int64_t i = 0;
  for (; i + 2 * Vec::size() <= n; i += 2 * Vec::size()) {
    acc0 = at::vec::fmadd(Vec::loadu(x + i), Vec::loadu(a + i), acc0);
    acc1 = at::vec::fmadd(Vec::loadu(x + i + Vec::size()), Vec::loadu(a + i + Vec::size()), acc1);
  }
  float sum = reduce_add(acc0 + acc1);
  for (; i < n; ++i) sum += x[i] * a[i];
  return sum;
}

constexpr int64_t kOutChunk = 8 * Vec::size();  // the expand's output features per item: 8 accumulators
// The least work (multiply-adds) one thread takes: a small step's adapters (one user's row: ~50K a
// projection) run on the calling thread, with no parallel region to fork and join, which on a busy
// machine cost more than the work.
constexpr int64_t kMinChunkMacs = 1 << 17;

// parallel_for's grain for items of `item_macs` multiply-adds each.
inline int64_t grain_for(int64_t item_macs) {
  return std::max<int64_t>(1, kMinChunkMacs / std::max<int64_t>(item_macs, 1));
}

// y[o0 .. o1) += Σ_w t[w] · b[w, o0 .. o1), b's rows `out` apart.
inline void expand_row(float* y, const float* t, const float* b, int64_t rank, int64_t out, int64_t o0, int64_t o1) {
  int64_t o = o0;
  if (o1 - o0 == kOutChunk) {
    Vec acc[8];
    for (int k = 0; k < 8; ++k) acc[k] = Vec::loadu(y + o + k * Vec::size());
    for (int64_t w = 0; w < rank; ++w) {
      const Vec tw(t[w]);
      const float* bw = b + w * out + o;
      for (int k = 0; k < 8; ++k) acc[k] = at::vec::fmadd(tw, Vec::loadu(bw + k * Vec::size()), acc[k]);
    }
    for (int k = 0; k < 8; ++k) acc[k].store(y + o + k * Vec::size());
    return;
  }
  for (; o < o1; ++o) {  // the last, partial chunk
    float sum = y[o];
    for (int64_t w = 0; w < rank; ++w) sum += t[w] * b[w * out + o];
    y[o] = sum;
  }
}

}  // namespace lora_detail

// y: [num_rows, out] fp32, added to in place; x: [num_rows, in] fp32, the projection's input.
inline void add_lora_fp32(torch::Tensor& y, const torch::Tensor& x, const LoRAWeights& weights,
                          const LoRAGroups& groups) {
  const int64_t num_rows = x.size(0), in = x.size(1), out = y.size(1);
  const int64_t rank = weights.a.size(1), num_groups = static_cast<int64_t>(groups.slots.size());
  TORCH_CHECK(weights.a.size(2) == in && weights.b.size(1) == rank && weights.b.size(2) == out,
              "LoRA weights do not fit the projection");
  const torch::Tensor xc = x.contiguous();
  const float* xp = xc.data_ptr<float>();
  const float* ap = weights.a.data_ptr<float>();
  const float* bp = weights.b.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  std::vector<float> t(num_rows * rank);  // [num_rows, W]: each adapted row's x · Aᵀ · scale
  int64_t num_adapted = 0;
  for (const auto& ids : groups.row_ids) num_adapted += static_cast<int64_t>(ids.size());
  const int64_t rows_per_group = (num_adapted + num_groups - 1) / num_groups;
  // Shrink: item (group, rank row w), A's row read once for the group's rows.
  parallel_for(0, num_groups * rank, lora_detail::grain_for(rows_per_group * in), [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t g = item / rank, w = item % rank;
      const float* a_row = ap + (groups.slots[g] * rank + w) * in;
      const float scale = static_cast<float>(groups.scales[g]);
      for (int64_t r : groups.row_ids[g]) t[r * rank + w] = lora_detail::dot(xp + r * in, a_row, in) * scale;
    }
  });
  // Expand: item (group, chunk of output features), B's chunk read once for the group's rows.
  const int64_t num_chunks = (out + lora_detail::kOutChunk - 1) / lora_detail::kOutChunk;
  const int64_t chunk_macs = rows_per_group * lora_detail::kOutChunk * rank;
  parallel_for(0, num_groups * num_chunks, lora_detail::grain_for(chunk_macs), [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t g = item / num_chunks, o0 = (item % num_chunks) * lora_detail::kOutChunk;
      const int64_t o1 = std::min(out, o0 + lora_detail::kOutChunk);
      const float* b = bp + groups.slots[g] * rank * out;  // [W, out]
      for (int64_t r : groups.row_ids[g]) {
        lora_detail::expand_row(yp + r * out, t.data() + r * rank, b, rank, out, o0, o1);
      }
    }
  });
}

// y: [num_rows, out] (the base projection's output; replaced by the sum off the fast path); x:
// [num_rows, in], its input.
inline void add_lora(torch::Tensor& y, const torch::Tensor& x, const LoRAWeights& weights, const LoRAGroups& groups) {
  if (groups.empty() || !weights.is_adapted()) return;
  const bool is_fp32 = x.scalar_type() == at::kFloat && y.scalar_type() == at::kFloat &&
                       weights.a.scalar_type() == at::kFloat && weights.b.scalar_type() == at::kFloat;
  if (is_fp32 && y.is_contiguous() && weights.a.is_contiguous() && weights.b.is_contiguous()) {
    add_lora_fp32(y, x, weights, groups);
    return;
  }
  for (size_t g = 0; g < groups.slots.size(); ++g) {
    const torch::Tensor a = weights.a.select(0, groups.slots[g]);  // [W, in]
    const torch::Tensor b = weights.b.select(0, groups.slots[g]);  // [W, out]
    const torch::Tensor& rows = groups.rows[g];
    if (rows.numel() == 0) {
      y = y + at::mm(at::mm(x, a.t()), b) * groups.scales[g];  // [n, W] -> [n, out]
    } else {
      y = y.index_add(0, rows, at::mm(at::mm(x.index_select(0, rows), a.t()), b) * groups.scales[g]);
    }
  }
}

}  // namespace tokenloom_cpu
