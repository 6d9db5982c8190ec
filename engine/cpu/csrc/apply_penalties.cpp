// Repetition, frequency and presence penalties in place, one pass over each penalised row:
//   seen = prompt_mask[slot] | counts[slot] > 0
//   x = seen ? (x > 0 ? x / repetition : x * repetition) : x      (where repetition != 1)
//   x = x - frequency * count;  x = x - presence * (count > 0)
// the same operations, in the same order, as the torch code in engine/sample/penalties.py, so both
// give the same bits: no FMA contraction here.
#pragma GCC optimize("fp-contract=off")

#include <torch/types.h>
#include <ATen/Parallel.h>

#include <cstdint>

// logits: [num_rows, vocab] fp32; rows, slots: [n] int64; counts: [num_slots, vocab] fp32;
// prompt_mask: [num_slots, vocab] bool; repetition, frequency, presence: [n] fp32.
void apply_penalties(torch::Tensor logits, torch::Tensor rows, torch::Tensor slots, torch::Tensor counts,
                     torch::Tensor prompt_mask, torch::Tensor repetition, torch::Tensor frequency,
                     torch::Tensor presence) {
  TORCH_CHECK(logits.device().is_cpu() && logits.dim() == 2 && logits.scalar_type() == at::kFloat &&
                  logits.is_contiguous(), "logits: contiguous [num_rows, vocab_size] fp32 on the CPU");
  const int64_t vocab_size = logits.size(1), n = rows.numel();
  TORCH_CHECK(counts.scalar_type() == at::kFloat && counts.is_contiguous() && counts.size(1) == vocab_size &&
                  prompt_mask.scalar_type() == at::kBool && prompt_mask.is_contiguous() &&
                  prompt_mask.size(1) == vocab_size, "counts, prompt_mask: [num_slots, vocab_size] fp32, bool");
  TORCH_CHECK(rows.scalar_type() == at::kLong && slots.scalar_type() == at::kLong && slots.numel() == n &&
                  repetition.numel() == n && frequency.numel() == n && presence.numel() == n,
              "rows, slots: [n] int64; penalties: [n] fp32");
  rows = rows.contiguous(); slots = slots.contiguous();
  repetition = repetition.contiguous(); frequency = frequency.contiguous(); presence = presence.contiguous();
  float* x = logits.data_ptr<float>();
  const float* c = counts.data_ptr<float>();
  const bool* m = prompt_mask.data_ptr<bool>();
  const int64_t* row_ids = rows.data_ptr<int64_t>();
  const int64_t* slot_ids = slots.data_ptr<int64_t>();
  const float* rep = repetition.data_ptr<float>();
  const float* freq = frequency.data_ptr<float>();
  const float* pres = presence.data_ptr<float>();
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float* __restrict__ row = x + row_ids[i] * vocab_size;
      const float* __restrict__ count = c + slot_ids[i] * vocab_size;
      const uint8_t* __restrict__ in_prompt = reinterpret_cast<const uint8_t*>(m + slot_ids[i] * vocab_size);
      const float r = rep[i], f = freq[i], p = pres[i];
      if (r != 1.f) {
        for (int64_t v = 0; v < vocab_size; ++v) {  // branch-free, so it vectorizes
          const float value = row[v];
          const float penalised = value > 0.f ? value / r : value * r;
          const bool seen = (in_prompt[v] != 0) | (count[v] > 0.f);
          row[v] = seen ? penalised : value;
        }
      }
      if (f != 0.f || p != 0.f) {
        for (int64_t v = 0; v < vocab_size; ++v) {
          const float value = row[v] - count[v] * f;
          row[v] = value - (count[v] > 0.f ? p : 0.f);
        }
      }
    }
  });
}
