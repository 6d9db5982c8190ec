// Structured outputs' grammar mask on fp32 logits, in place: in each listed row, the
// tokens whose bit is 0 in the row's bitmask get -inf (xgrammar's layout: bit b of
// int32 word w is token 32 * w + b, 1 = allowed).
//
// Why a kernel: xgrammar's CPU apply visits every token one by one; a word that is all
// ones (32 allowed tokens) is skipped here and one that is all zeros is a plain fill,
// so a row costs about one pass of stores over its banned tokens.
#include <torch/types.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <limits>

// logits: [num_rows, vocab_size] fp32; bitmask: [>= max(rows) + 1, ceil(vocab_size / 32)] int32;
// rows: [n] int64, the rows of both to apply.
void apply_token_bitmask(torch::Tensor logits, torch::Tensor bitmask, torch::Tensor rows) {
  TORCH_CHECK(logits.device().is_cpu() && logits.dim() == 2 && logits.scalar_type() == at::kFloat &&
                  logits.is_contiguous(), "logits: contiguous [num_rows, vocab_size] fp32 on the CPU");
  const int64_t vocab_size = logits.size(1), num_words = (vocab_size + 31) / 32;
  TORCH_CHECK(bitmask.device().is_cpu() && bitmask.dim() == 2 && bitmask.scalar_type() == at::kInt &&
                  bitmask.size(1) == num_words && bitmask.stride(1) == 1,
              "bitmask: [rows, ceil(vocab_size / 32)] int32, rows contiguous");
  TORCH_CHECK(rows.scalar_type() == at::kLong, "rows: int64");
  rows = rows.contiguous();
  const int64_t n = rows.numel();
  const int64_t* row_ids = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(row_ids[i] >= 0 && row_ids[i] < logits.size(0) && row_ids[i] < bitmask.size(0),
                "row ", row_ids[i], " is outside the logits or the bitmask");
  }
  float* x = logits.data_ptr<float>();
  const int32_t* bits = bitmask.data_ptr<int32_t>();
  const int64_t bitmask_stride = bitmask.stride(0);
  constexpr float kBanned = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float* __restrict__ row = x + row_ids[i] * vocab_size;
      const uint32_t* __restrict__ words = reinterpret_cast<const uint32_t*>(bits + row_ids[i] * bitmask_stride);
      const int64_t num_full_words = vocab_size / 32;
      for (int64_t w = 0; w < num_full_words; ++w) {
        const uint32_t word = words[w];
        if (word == 0xFFFFFFFFu) continue;
        float* __restrict__ out = row + w * 32;
        // A fixed trip count with no branch, so the compiler vectorizes both loops.
        if (word == 0u) {
          for (int b = 0; b < 32; ++b) out[b] = kBanned;
        } else {
          for (int b = 0; b < 32; ++b) out[b] = (word >> b) & 1u ? out[b] : kBanned;
        }
      }
      for (int64_t v = num_full_words * 32; v < vocab_size; ++v) {  // a vocabulary that ends mid-word
        if (!((words[num_full_words] >> (v - num_full_words * 32)) & 1u)) row[v] = kBanned;
      }
    }
  });
}
