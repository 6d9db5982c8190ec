// A tied embedding's rows read back out of the LM head's quantized panels (int8 or int4), in one
// call: the Python reference (engine/cpu/int8_linear.py and int4_linear.py, dequantize_rows)
// takes a dozen torch ops for the one row a decode step looks up. Same values, bit for bit:
// int8 q * scale is one rounding; int4 d * q is exact in fp32 (an 11-bit by 4-bit product), so
// d * q + m rounds once, fused or not.
#include <torch/types.h>

#include <cstdint>

namespace {

constexpr int64_t kPanel = 32;
constexpr int64_t kBlock = 32;  // int4: inputs per (d, m)

void check_rows(const torch::Tensor& panels, const torch::Tensor& rows, int64_t out_features) {
  TORCH_CHECK(panels.dim() == 3 && panels.scalar_type() == torch::kInt32 && panels.size(2) == kPanel &&
                  panels.is_contiguous(), "panels: [padded_out / 32, words, 32] int32, contiguous");
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == torch::kLong, "rows: [n] int64");
  if (rows.numel() > 0) {
    TORCH_CHECK(rows.min().item<int64_t>() >= 0 && rows.max().item<int64_t>() < out_features, "rows out of range");
  }
}

}  // namespace

// panels: [padded_out / 32, num_groups * group / 4, 32] int32 (bytes q + 128), scales: [padded_out / 32,
// num_groups, 32] fp32 (group 64, or a GGUF Q8_0's 32); rows: [n] int64 -> [n, in_features] fp32,
// q * its group's scale.
torch::Tensor int8_rows(const torch::Tensor& panels, const torch::Tensor& scales, const torch::Tensor& rows,
                        int64_t in_features, int64_t out_features) {
  check_rows(panels, rows, out_features);
  const int64_t num_words = panels.size(1), num_groups = scales.size(1);
  TORCH_CHECK(scales.scalar_type() == torch::kFloat && scales.is_contiguous() && num_groups > 0 &&
                  num_words % num_groups == 0, "scales disagree with the panels");
  const int64_t group = num_words / num_groups * 4;
  TORCH_CHECK((group == 64 || group == 32) && in_features <= num_groups * group, "scales disagree with the panels");
  auto out = torch::empty({rows.numel(), in_features}, panels.options().dtype(torch::kFloat));
  const int32_t* words = panels.data_ptr<int32_t>();
  const float* s = scales.data_ptr<float>();
  const int64_t* ids = rows.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows.numel(); ++r) {
    const int64_t p = ids[r] / kPanel, j = ids[r] % kPanel;
    float* dst = out.data_ptr<float>() + r * in_features;
    for (int64_t k = 0; k < in_features; ++k) {
      const uint32_t word = static_cast<uint32_t>(words[(p * num_words + k / 4) * kPanel + j]);
      const int q = static_cast<int>((word >> (8 * (k % 4))) & 0xff) - 128;
      dst[k] = static_cast<float>(q) * s[(p * num_groups + k / group) * kPanel + j];
    }
  }
  return out;
}

// panels: [padded_out / 32, num_blocks * 4, 32] int32 (codes, two quads a word), dm: [padded_out / 32,
// num_blocks, 2, 32] fp16; rows: [n] int64 -> [n, in_features] fp32, d * q + m.
torch::Tensor int4_rows(const torch::Tensor& panels, const torch::Tensor& dm, const torch::Tensor& rows,
                        int64_t in_features, int64_t out_features) {
  check_rows(panels, rows, out_features);
  const int64_t num_words = panels.size(1), num_blocks = dm.size(1);
  TORCH_CHECK(dm.scalar_type() == torch::kHalf && dm.dim() == 4 && dm.is_contiguous() && num_words == num_blocks * 4 &&
                  in_features <= num_blocks * kBlock, "dm disagrees with the panels");
  auto out = torch::empty({rows.numel(), in_features}, panels.options().dtype(torch::kFloat));
  const int32_t* words = panels.data_ptr<int32_t>();
  const at::Half* scales = dm.data_ptr<at::Half>();
  const int64_t* ids = rows.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows.numel(); ++r) {
    const int64_t p = ids[r] / kPanel, j = ids[r] % kPanel;
    float* dst = out.data_ptr<float>() + r * in_features;
    for (int64_t k = 0; k < in_features; ++k) {
      const int64_t b = k / kBlock, within = k % kBlock, i = within / 8, c = within % 4;
      const uint32_t word = static_cast<uint32_t>(words[(p * num_words + b * 4 + i) * kPanel + j]);
      const uint32_t byte = (word >> (8 * c)) & 0xff;
      const float code = static_cast<float>(within % 8 < 4 ? byte & 15 : byte >> 4);
      const float d = static_cast<float>(scales[((p * num_blocks + b) * 2) * kPanel + j]);
      const float m = static_cast<float>(scales[((p * num_blocks + b) * 2 + 1) * kPanel + j]);
      dst[k] = d * code + m;
    }
  }
  return out;
}
