// One token per row of fp32 logits, for engine/sample/sampler.py's common case on the CPU
// (no top-k, top-p or min-p):
//   greedy rows (temperature 0): the first index of the row's highest logit, as torch.argmax;
//   the others: inverse-CDF sampling from softmax(logits / temperature) with the row's
//   uniform u in [0, 1): the first token whose cumulative mass reaches (1 - u) of the
//   row's total, so never a token of probability 0.
//
// Why a kernel: in torch, softmax, cumsum and, for greedy rows, argmax are each a pass
// over every row's vocabulary (docs/performance.md, "Sampling"). Here a row is a max pass, one pass of
// exp that also sums chunk by chunk, and a scan through the chunk sums to the one chunk
// where the target falls.
#include "vec_capability.h"
#include "vec_reduce.h"

#include <torch/types.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

using tokenloom_cpu::reduce_add;
using tokenloom_cpu::row_max;
using tokenloom_cpu::Vec;

// Elements per partial sum: the scan adds these one by one, then walks one chunk element by element.
constexpr int64_t kChunk = 256;
static_assert(kChunk % 16 == 0, "a chunk holds whole vectors of any width used here");

// The first index holding `value` (the row's max); torch.argmax's choice among ties. A NaN
// max is torch's answer too: the first NaN.
int64_t first_index_of(const float* x, int64_t n, float value) {
  if (std::isnan(value)) {
    for (int64_t i = 0; i < n; ++i) {
      if (std::isnan(x[i])) return i;
    }
    return 0;
  }
  int64_t i = 0;
  const int all_lanes = (1 << Vec::size()) - 1;
  for (; i + Vec::size() <= n; i += Vec::size()) {
    // zero_mask marks the lanes that compared unequal; stop at the vector holding a match.
    if ((Vec::loadu(x + i) == Vec(value)).zero_mask() != all_lanes) break;
  }
  for (; i < n; ++i) {
    if (x[i] == value) return i;
  }
  return n - 1;
}

// Inverse-CDF draw from exp((x - max) / temperature); `e` and `chunk_sums` are scratch.
int64_t draw(const float* x, int64_t n, float max_logit, float temperature, float u, float* e, float* chunk_sums) {
  const Vec shift(max_logit), inv_t(1.f / temperature);
  const int64_t num_chunks = (n + kChunk - 1) / kChunk;
  float total = 0.f;
  for (int64_t c = 0; c < num_chunks; ++c) {
    const int64_t end = std::min(n, (c + 1) * kChunk);
    int64_t i = c * kChunk;
    Vec acc(0.f);
    for (; i + Vec::size() <= end; i += Vec::size()) {
      const Vec p = ((Vec::loadu(x + i) - shift) * inv_t).exp();  // banned tokens (-inf) give 0
      p.store(e + i);
      acc = acc + p;
    }
    float sum = reduce_add(acc);
    for (; i < end; ++i) {
      e[i] = std::exp((x[i] - max_logit) / temperature);
      sum += e[i];
    }
    chunk_sums[c] = sum;
    total += sum;
  }
  // The walk adds the same chunk sums in the same order, so it reaches `total` exactly
  // and target <= total always falls in some chunk; inside it, elements add in another
  // order than the vector sum did, so a rounding shortfall takes the chunk's last live token.
  const float target = (1.f - u) * total;
  float running = 0.f;
  for (int64_t c = 0; c < num_chunks; ++c) {
    if (running + chunk_sums[c] < target && c + 1 < num_chunks) {
      running += chunk_sums[c];
      continue;
    }
    const int64_t begin = c * kChunk, end = std::min(n, begin + kChunk);
    int64_t last_live = -1;
    for (int64_t i = begin; i < end; ++i) {
      if (e[i] <= 0.f) continue;
      last_live = i;
      running += e[i];
      if (running >= target) return i;
    }
    if (last_live >= 0) return last_live;
    running += chunk_sums[c];  // an all-zero chunk (its sum rounded up to reach the target)
  }
  return first_index_of(x, n, max_logit);  // no live token at all: every logit -inf, or NaNs
}

}  // namespace

// logits: [num_rows, vocab_size] fp32; temperatures, uniforms: [num_rows] fp32 (temperature
// 0: greedy, its uniform unused). Returns [num_rows] int64 token ids.
torch::Tensor sample_rows(torch::Tensor logits, torch::Tensor temperatures, torch::Tensor uniforms) {
  TORCH_CHECK(logits.device().is_cpu() && logits.dim() == 2 && logits.scalar_type() == at::kFloat,
              "logits: [num_rows, vocab_size] fp32 on the CPU");
  const int64_t num_rows = logits.size(0), vocab_size = logits.size(1);
  TORCH_CHECK(vocab_size > 0, "logits: an empty vocabulary");
  TORCH_CHECK(temperatures.scalar_type() == at::kFloat && temperatures.numel() == num_rows &&
                  uniforms.scalar_type() == at::kFloat && uniforms.numel() == num_rows,
              "temperatures and uniforms: [num_rows] fp32");
  logits = logits.contiguous();
  temperatures = temperatures.contiguous();
  uniforms = uniforms.contiguous();
  auto out = torch::empty({num_rows}, logits.options().dtype(at::kLong));
  const float* x = logits.data_ptr<float>();
  const float* t = temperatures.data_ptr<float>();
  const float* u = uniforms.data_ptr<float>();
  int64_t* ids = out.data_ptr<int64_t>();
  at::parallel_for(0, num_rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> e, chunk_sums;
    for (int64_t r = begin; r < end; ++r) {
      const float* row = x + r * vocab_size;
      const float max_logit = row_max(row, vocab_size);
      if (t[r] == 0.f || !std::isfinite(max_logit)) {  // greedy; or no finite max to scale by
        ids[r] = first_index_of(row, vocab_size, max_logit);
        continue;
      }
      e.resize(vocab_size);
      chunk_sums.resize((vocab_size + kChunk - 1) / kChunk);
      ids[r] = draw(row, vocab_size, max_logit, t[r], u[r], e.data(), chunk_sums.data());
    }
  });
  return out;
}
