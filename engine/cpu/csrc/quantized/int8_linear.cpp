// W8A8 linear layers on AVX512_VNNI's vpdpbusd, with scales per group of 64 inputs, or of 32
// for a GGUF's Q8_0 blocks packed as they are (engine/cpu/int8_linear.py packs the weights
// and decides where this runs).
//
//   y[t, n] = sum_g sx[t, g] * sw[n, g] * sum_{k in g} qx[t, k] * qw[n, k]  (+ bias[n])
//
// One scale per output row and token over a whole row lets one outlier input set the
// step for every other: greedy decoding then drifts far from fp32. Groups of 64 along K
// bound that to the group. Weights are int8, symmetric, one scale per (row, group),
// quantized once at load time (K padded with zeros to a multiple of 64). Activations are
// quantized here, one scale per (token, group): qx = round(x * 127 / max|x| over the group).
// The group is the weight's: the scales' shape against the panels' says which (kGroup or kGgufGroup).
//
// vpdpbusd multiplies unsigned bytes by signed ones. The weights are the unsigned side,
// stored as u = qw + 128, so each group's sum also holds 128 * sum_{k in g} qx[t, k]: a
// correction per (token, group), computed while quantizing the activations, subtracted
// exactly in int32. (Offsetting the weights instead would need a correction per row and
// group held beside the weights: more bytes streamed per decode step.)
//
// Weights are packed into panels of 32 output rows, each panel contiguous:
//   panels: [out_features / 32, num_quads, 32] 32-bit words; word (p, q, j) = the four
//   bytes u of inputs 4q .. 4q + 3 of row 32 p + j; num_quads = group / 4 per group;
//   w_scales: [out_features / 32, num_groups, 32] fp32, a panel's scales group by group.
// A panel streams front to back; one vpdpbusd adds four products for 16 rows, with the
// token's 4 bytes broadcast, so there are no horizontal sums. Each group's int32 sums are
// exact (at most 64 * 255 * 127); its epilogue adds (sum - correction) * sw * sx into fp32
// accumulators. Up to kMaxRows tokens share each weight load; more take further passes
// over the panel, then in cache. The output is rounded to the activations' dtype once (or
// left in fp32: logits).
#include "share_out.h"  // from engine/cpu/csrc/, copied beside this file for the build
#include "vnni_io.h"

#include <torch/csrc/utils/pybind.h>
#include <torch/types.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace {

constexpr int64_t kPanel = 32;  // output rows per panel: two zmm registers of sums
constexpr int64_t kGroup = 64;  // inputs per scale: what load-time quantization makes
constexpr int64_t kGgufGroup = 32;  // a GGUF Q8_0 block's inputs per scale
constexpr int kMaxRows = 6;  // tokens per pass: 12 int32 and 12 fp32 accumulators in registers
constexpr int64_t kChunksPerThread = 8;  // run_panels' share-out
constexpr int64_t kPrefetchQuads = 32;  // 4 KB ahead in the panel, into L2 (as the bf16 slabs do)

#ifdef TOKENLOOM_HAS_VNNI

using tokenloom_vnni::lanes;
using tokenloom_vnni::load_floats_masked;
using tokenloom_vnni::store_outputs;

// One token: qx per group into `out` ([num_groups * group] int8, zeros past in_features), its
// scale max|x| / 127 (1 for an all-zero group) and its correction 128 * sum qx.
template <int64_t group, typename in_t>
void quantize_row(const in_t* x, int64_t in_features, int64_t num_groups, int8_t* out, float* scales,
                  int32_t* corrections) {
  constexpr int kChunks = group / 16;
  for (int64_t g = 0; g < num_groups; ++g) {
    const int64_t k0 = g * group;
    __m512 v[kChunks];
    __m512 amax = _mm512_setzero_ps();
#pragma GCC unroll 4
    for (int c = 0; c < kChunks; ++c) {
      v[c] = load_floats_masked(x + k0 + 16 * c, lanes(in_features - k0 - 16 * c));
      amax = _mm512_max_ps(amax, _mm512_abs_ps(v[c]));
    }
    const float max_abs = _mm512_reduce_max_ps(amax);
    const __m512 inv = _mm512_set1_ps(max_abs > 0.f ? 127.f / max_abs : 0.f);
    __m512i sum = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int c = 0; c < kChunks; ++c) {
      // Round to nearest even (the MXCSR default), as torch.round does in the reference.
      const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(v[c], inv));
      sum = _mm512_add_epi32(sum, q);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + k0 + 16 * c), _mm512_cvtsepi32_epi8(q));
    }
    scales[g] = max_abs > 0.f ? max_abs / 127.f : 1.f;
    corrections[g] = 128 * _mm512_reduce_add_epi32(sum);
  }
}

template <int64_t group, typename in_t>
void quantize_rows(const in_t* x, int64_t num_tokens, int64_t in_features, int64_t num_groups, int8_t* out,
                   float* scales, int32_t* corrections) {
  tokenloom_cpu::parallel_for(0, num_tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      quantize_row<group>(x + t * in_features, in_features, num_groups, out + t * num_groups * group,
                          scales + t * num_groups, corrections + t * num_groups);
    }
  });
}

// The quantized activations of a pass: rows of words, and per (row, group) scale and correction.
struct Activations {
  const uint32_t* quads;  // [rows][num_quads]
  const float* scales;  // [rows][num_groups]
  const int32_t* corrections;  // [rows][num_groups]
};

// out[r][n0 .. n0 + 32) for rows [0, kRows) of `x`, over one panel.
template <int kRows, int64_t group, typename out_t>
void panel_rows(Activations x, int64_t num_groups, const uint32_t* panel, const float* w_scales, const float* bias,
                int64_t num_valid, out_t* out, int64_t out_stride) {
  constexpr int64_t kQuadsPerGroup = group / 4;
  const int64_t num_quads = num_groups * kQuadsPerGroup;
  const bool prefetch = tokenloom_vnni::prefetches(kRows);
  __m512 acc[kRows][2];
#pragma GCC unroll 8
  for (int r = 0; r < kRows; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t g = 0; g < num_groups; ++g) {
    const uint32_t* w = panel + g * kQuadsPerGroup * kPanel;
    const int64_t q0 = g * kQuadsPerGroup;
    __m512i sums[kRows][2];
#pragma GCC unroll 8
    for (int r = 0; r < kRows; ++r) sums[r][0] = sums[r][1] = _mm512_setzero_si512();
    if constexpr (kRows == 1) {
      // One token waits on each add's latency: four sums, over even and odd quads.
      __m512i odd0 = _mm512_setzero_si512(), odd1 = _mm512_setzero_si512();
#pragma GCC unroll 8
      for (int64_t q = 0; q < kQuadsPerGroup; q += 2) {
        if (prefetch) {
          _mm_prefetch(reinterpret_cast<const char*>(w + (q + kPrefetchQuads) * kPanel), _MM_HINT_T1);
          _mm_prefetch(reinterpret_cast<const char*>(w + (q + kPrefetchQuads) * kPanel + 16), _MM_HINT_T1);
          _mm_prefetch(reinterpret_cast<const char*>(w + (q + kPrefetchQuads + 1) * kPanel), _MM_HINT_T1);
          _mm_prefetch(reinterpret_cast<const char*>(w + (q + kPrefetchQuads + 1) * kPanel + 16), _MM_HINT_T1);
        }
        const __m512i x0 = _mm512_set1_epi32(x.quads[q0 + q]), x1 = _mm512_set1_epi32(x.quads[q0 + q + 1]);
        sums[0][0] = _mm512_dpbusd_epi32(sums[0][0], _mm512_loadu_si512(w + q * kPanel), x0);
        sums[0][1] = _mm512_dpbusd_epi32(sums[0][1], _mm512_loadu_si512(w + q * kPanel + 16), x0);
        odd0 = _mm512_dpbusd_epi32(odd0, _mm512_loadu_si512(w + (q + 1) * kPanel), x1);
        odd1 = _mm512_dpbusd_epi32(odd1, _mm512_loadu_si512(w + (q + 1) * kPanel + 16), x1);
      }
      sums[0][0] = _mm512_add_epi32(sums[0][0], odd0);
      sums[0][1] = _mm512_add_epi32(sums[0][1], odd1);
    } else {
      for (int64_t q = 0; q < kQuadsPerGroup; ++q) {
        _mm_prefetch(reinterpret_cast<const char*>(w + (q + kPrefetchQuads) * kPanel), _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char*>(w + (q + kPrefetchQuads) * kPanel + 16), _MM_HINT_T1);
        const __m512i w0 = _mm512_loadu_si512(w + q * kPanel);
        const __m512i w1 = _mm512_loadu_si512(w + q * kPanel + 16);
#pragma GCC unroll 8
        for (int r = 0; r < kRows; ++r) {
          const __m512i xr = _mm512_set1_epi32(x.quads[r * num_quads + q0 + q]);
          sums[r][0] = _mm512_dpbusd_epi32(sums[r][0], w0, xr);
          sums[r][1] = _mm512_dpbusd_epi32(sums[r][1], w1, xr);
        }
      }
    }
    // The group's epilogue: (sum - 128 * sum qx), exact in int32, then both scales in fp32.
    const __m512 ws0 = _mm512_loadu_ps(w_scales + g * kPanel);
    const __m512 ws1 = _mm512_loadu_ps(w_scales + g * kPanel + 16);
#pragma GCC unroll 8
    for (int r = 0; r < kRows; ++r) {
      const __m512i correction = _mm512_set1_epi32(x.corrections[r * num_groups + g]);
      const __m512 xs = _mm512_set1_ps(x.scales[r * num_groups + g]);
      acc[r][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(sums[r][0], correction)),
                                  _mm512_mul_ps(ws0, xs), acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(sums[r][1], correction)),
                                  _mm512_mul_ps(ws1, xs), acc[r][1]);
    }
  }
  const __mmask16 valid[2] = {lanes(num_valid), lanes(num_valid - 16)};
#pragma GCC unroll 2
  for (int h = 0; h < 2; ++h) {
    const __m512 b = bias != nullptr ? _mm512_loadu_ps(bias + 16 * h) : _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int r = 0; r < kRows; ++r) {
      store_outputs(out + r * out_stride + 16 * h, valid[h], _mm512_add_ps(acc[r][h], b));
    }
  }
}

template <typename out_t>
using PanelRowsFn = void (*)(Activations, int64_t, const uint32_t*, const float*, const float*, int64_t, out_t*,
                             int64_t);
template <int64_t group, typename out_t>
constexpr PanelRowsFn<out_t> kPanelRows[kMaxRows] = {panel_rows<1, group, out_t>, panel_rows<2, group, out_t>,
                                                     panel_rows<3, group, out_t>, panel_rows<4, group, out_t>,
                                                     panel_rows<5, group, out_t>, panel_rows<6, group, out_t>};

// Each panel's outputs for every token, the panels shared out as the bf16 slabs are (share_out.h).
template <int64_t group, typename out_t>
void run_panels(Activations x, int64_t num_tokens, int64_t num_groups, const uint32_t* panels, const float* w_scales,
                const float* bias, int64_t num_panels, int64_t out_features, out_t* out) {
  const int64_t num_quads = num_groups * group / 4;
  tokenloom_cpu::share_out<kChunksPerThread>(num_panels, [&](int64_t p) {
    const int64_t n0 = p * kPanel;
    for (int64_t r0 = 0; r0 < num_tokens; r0 += kMaxRows) {
      const int64_t rows = std::min<int64_t>(kMaxRows, num_tokens - r0);
      const Activations block{x.quads + r0 * num_quads, x.scales + r0 * num_groups, x.corrections + r0 * num_groups};
      kPanelRows<group, out_t>[rows - 1](block, num_groups, panels + p * num_quads * kPanel,
                                         w_scales + p * num_groups * kPanel, bias == nullptr ? nullptr : bias + n0,
                                         out_features - n0, out + r0 * out_features + n0, out_features);
    }
  });
}

// f(std::integral_constant<int64_t, G>{}) for the run-time group G, 64 or 32 (check_group's):
// the kernels take the group as a template argument, so its loops unroll.
template <typename F>
void with_group(int64_t group, F&& f) {
  if (group == kGroup) {
    f(std::integral_constant<int64_t, kGroup>{});
  } else {
    f(std::integral_constant<int64_t, kGgufGroup>{});
  }
}

#endif  // TOKENLOOM_HAS_VNNI

}  // namespace

bool has_int8_linear() { return tokenloom_vnni::has_vnni(); }

int64_t group_size() { return kGroup; }

namespace {

void check_group(int64_t group) {
  TORCH_CHECK(group == kGroup || group == kGgufGroup, "int8 groups are 64 inputs (or a GGUF Q8_0's 32), not ", group);
}

// x (contiguous) quantized into bytes [num_tokens, num_groups * group], scales and corrections
// [num_tokens, num_groups]: quantize_activations' arrays, wherever the caller keeps them.
void quantize_into(const torch::Tensor& x, int64_t num_groups, int64_t group, int8_t* bytes, float* scales,
                   int32_t* corrections) {
#ifdef TOKENLOOM_HAS_VNNI
  with_group(group, [&](auto group_constant) {
    constexpr int64_t g = decltype(group_constant)::value;
    if (x.scalar_type() == at::kFloat) {
      quantize_rows<g>(x.data_ptr<float>(), x.size(0), x.size(1), num_groups, bytes, scales, corrections);
    } else {
      quantize_rows<g>(x.data_ptr<at::BFloat16>(), x.size(0), x.size(1), num_groups, bytes, scales, corrections);
    }
  });
#endif
}

}  // namespace

// x: [num_tokens, in_features] bf16 or fp32 -> (qx [num_tokens, num_groups * group] int8, zeros
// past in_features; scales [num_tokens, num_groups] fp32; corrections [num_tokens, num_groups]
// int32, 128 * each group's sum of qx). The kernel's own activation quantization, exposed for tests.
std::vector<torch::Tensor> quantize_activations(torch::Tensor x, int64_t num_groups, int64_t group) {
  TORCH_CHECK(has_int8_linear(), "int8 linears need a CPU with AVX512_VNNI");
  tokenloom_vnni::check_activations(x);
  check_group(group);
  TORCH_CHECK(num_groups * group >= x.size(1) && (num_groups - 1) * group < x.size(1),
              "num_groups must be in_features / group, rounded up");
  x = x.contiguous();
  auto bytes = torch::empty({x.size(0), num_groups * group}, x.options().dtype(at::kChar));
  auto scales = torch::empty({x.size(0), num_groups}, x.options().dtype(at::kFloat));
  auto corrections = torch::empty({x.size(0), num_groups}, x.options().dtype(at::kInt));
  quantize_into(x, num_groups, group, bytes.data_ptr<int8_t>(), scales.data_ptr<float>(),
                corrections.data_ptr<int32_t>());
  return {bytes, scales, corrections};
}

// x: [num_tokens, in_features] bf16 or fp32; panels: [padded_out / 32, num_groups * group / 4, 32]
// int32 and w_scales: [padded_out / 32, num_groups, 32] fp32 (engine.cpu.int8_linear's
// layout; group 64, or 32 for a GGUF's Q8_0 blocks); bias: [padded_out] fp32 or empty. Returns
// [num_tokens, out_features] in x's dtype, or with out_fp32 in fp32 (logits).
torch::Tensor int8_linear(torch::Tensor x, torch::Tensor panels, torch::Tensor w_scales, torch::Tensor bias,
                          int64_t out_features, bool out_fp32) {
  TORCH_CHECK(has_int8_linear(), "int8 linears need a CPU with AVX512_VNNI");
  tokenloom_vnni::check_activations(x);
  TORCH_CHECK(panels.dim() == 3 && panels.scalar_type() == torch::kInt32 && panels.size(2) == kPanel &&
                  panels.is_contiguous(), "panels: [padded_out / 32, num_groups * group / 4, 32] int32, contiguous");
  const int64_t num_tokens = x.size(0), in_features = x.size(1);
  const int64_t num_panels = panels.size(0), num_groups = w_scales.dim() == 3 ? w_scales.size(1) : 0;
  TORCH_CHECK(w_scales.scalar_type() == torch::kFloat && w_scales.dim() == 3 && w_scales.size(0) == num_panels &&
                  num_groups > 0 && w_scales.size(2) == kPanel && w_scales.is_contiguous() &&
                  panels.size(1) % num_groups == 0,
              "w_scales: [padded_out / 32, num_groups, 32] fp32, contiguous, a whole number of quads a group");
  const int64_t group = panels.size(1) / num_groups * 4;
  check_group(group);
  const int64_t padded_out = num_panels * kPanel;
  TORCH_CHECK(num_groups * group >= in_features && (num_groups - 1) * group < in_features,
              "x's features disagree with the weight's");
  TORCH_CHECK(out_features <= padded_out && out_features > padded_out - kPanel, "out_features disagrees with the panels");
  const bool has_bias = bias.numel() > 0;
  if (has_bias) {
    TORCH_CHECK(bias.scalar_type() == torch::kFloat && bias.numel() == padded_out && bias.is_contiguous(),
                "bias: [padded_out] fp32");
  }
  auto out = torch::empty({num_tokens, out_features}, x.options().dtype(out_fp32 ? at::kFloat : x.scalar_type()));
  if (num_tokens == 0 || num_panels == 0) return out;
#ifdef TOKENLOOM_HAS_VNNI
  // [num_tokens, num_groups * group] int8, [num_tokens, num_groups] fp32, [num_tokens, num_groups] int32
  const auto scratch = tokenloom_vnni::activation_scratch(num_tokens, num_groups, group);
  quantize_into(x.contiguous(), num_groups, group, scratch.bytes, static_cast<float*>(scratch.first),
                static_cast<int32_t*>(scratch.second));
  const Activations xq{reinterpret_cast<const uint32_t*>(scratch.bytes), static_cast<const float*>(scratch.first),
                       static_cast<const int32_t*>(scratch.second)};
  const uint32_t* w = reinterpret_cast<const uint32_t*>(panels.data_ptr<int32_t>());
  const float* ws = w_scales.data_ptr<float>();
  const float* b = has_bias ? bias.data_ptr<float>() : nullptr;
  with_group(group, [&](auto group_constant) {
    constexpr int64_t g = decltype(group_constant)::value;
    if (out.scalar_type() == at::kFloat) {
      run_panels<g>(xq, num_tokens, num_groups, w, ws, b, num_panels, out_features, out.data_ptr<float>());
    } else {
      run_panels<g>(xq, num_tokens, num_groups, w, ws, b, num_panels, out_features, out.data_ptr<at::BFloat16>());
    }
  });
#endif
  return out;
}

// int4_linear.cpp (this module's other kernel: Q4_1-style W4A8)
int64_t q4_block_size();
std::vector<torch::Tensor> quantize_activations_q4(torch::Tensor x, int64_t num_blocks);
torch::Tensor int4_linear(const torch::Tensor& x, const torch::Tensor& panels, const torch::Tensor& dm,
                          const torch::Tensor& bias, int64_t out_features, bool out_fp32);

// embedding_rows.cpp (a tied embedding's rows read back out of the head's panels)
torch::Tensor int8_rows(const torch::Tensor& panels, const torch::Tensor& scales, const torch::Tensor& rows,
                        int64_t in_features, int64_t out_features);
torch::Tensor int4_rows(const torch::Tensor& panels, const torch::Tensor& dm, const torch::Tensor& rows,
                        int64_t in_features, int64_t out_features);

// Both kernels as torch ops, `tokenloom_int8::linear` and `::linear_q4`, for C++ callers in
// another shared library (engine/cpu/csrc/decode_stack.cpp) to reach through the dispatcher.
namespace {
torch::Tensor int8_linear_op(const torch::Tensor& x, const torch::Tensor& panels, const torch::Tensor& w_scales,
                             const torch::Tensor& bias, int64_t out_features, bool out_fp32) {
  return int8_linear(x, panels, w_scales, bias, out_features, out_fp32);
}
}  // namespace

TORCH_LIBRARY(tokenloom_int8, m) {
  m.def("linear(Tensor x, Tensor panels, Tensor w_scales, Tensor bias, int out_features, bool out_fp32) -> Tensor");
  m.def("linear_q4(Tensor x, Tensor panels, Tensor dm, Tensor bias, int out_features, bool out_fp32) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenloom_int8, CPU, m) {
  m.impl("linear", &int8_linear_op);
  m.impl("linear_q4", &int4_linear);
}

// The decode steps' work pool of the other kernels' library (its work_pool_address), which
// this library's share_out and parallel_for then use when called from that pool's master.
void use_work_pool(int64_t address) {
  tokenloom_cpu::work_pool_slot() = reinterpret_cast<tokenloom_cpu::WorkPool*>(address);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("use_work_pool", &use_work_pool, "share out on the decode steps' work pool at this address (work_pool.h)");
  m.def("set_one_token_prefetch", [](bool on) { tokenloom_vnni::g_one_token_prefetch.store(on, std::memory_order_relaxed); },
        "whether one-token calls of the int8 and int4 panels prefetch their weights in software (the host's choice)");
  m.def("one_token_prefetch", [] { return tokenloom_vnni::g_one_token_prefetch.load(std::memory_order_relaxed); },
        "the switch set_one_token_prefetch sets");
  m.def("has_int8_linear", &has_int8_linear, "whether this build has the int8 kernels (AVX512_VNNI)");
  m.def("group_size", &group_size, "inputs per scale, weights' and activations' alike (load-time quantization's)");
  m.def("quantize_activations", &quantize_activations, "symmetric int8 per (token, group of 64 or 32), with corrections (CPU)",
        py::arg("x"), py::arg("num_groups"), py::arg("group") = kGroup);
  m.def("int8_linear", &int8_linear, "W8A8 linear on vpdpbusd, scales per group of 64 (or 32) inputs (CPU)");
  m.def("q4_block_size", &q4_block_size, "inputs per int4 block: the weights' (d, m) and the activations' scale");
  m.def("quantize_activations_q4", &quantize_activations_q4, "symmetric int8 per (token, block of 32), with scale * sum (CPU)");
  m.def("int8_rows", &int8_rows, "rows of an int8 weight read back from its panels, fp32 (a tied embedding's)");
  m.def("int4_rows", &int4_rows, "rows of an int4 weight read back from its panels, fp32 (a tied embedding's)");
  m.def("int4_linear", &int4_linear, "W4A8 linear on vpdpbusd in Q4_1's format: d and m per block of 32 inputs (CPU)");
}
