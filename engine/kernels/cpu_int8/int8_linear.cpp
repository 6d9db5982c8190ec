// W8A8 linear layers on AVX512_VNNI's vpdpbusd (engine/models/int8_linear.py packs the weights
// and decides where this runs).
//
//   y[t, n] = sx[t] * sw[n] * sum_k qx[t, k] * qw[n, k]  (+ bias[n])
//
// Weights are int8, symmetric, one scale per output feature, quantized once at load time.
// Activations are quantized here, per token (symmetric: qx = round(x * 127 / max|x|)).
// vpdpbusd multiplies unsigned bytes by signed ones, so each activation byte is stored
// as u = qx + 128, and the sum then holds 128 * sum_k qw[n, k] too: `compensation[n]`,
// computed at packing time, is subtracted in the epilogue. Four products per 32-bit lane
// of at most 255 * 127 each: an int32 sum cannot overflow below 16,000 input features.
//
// Weights are packed into panels of 32 output features, each panel contiguous:
//   panels: [out_features / 32, in_features / 4, 32] 32-bit words; word (p, q, j) = the
//   four int8 weights (4q .. 4q + 3) of output feature 32 p + j (features and inputs
//   padded with zeros up to those multiples).
// A panel streams from memory front to back (one 64-byte line per 16 features and 4
// inputs); one vpdpbusd adds four products for 16 outputs, with the token's 4 bytes
// broadcast, so there are no horizontal sums. Up to kMaxRows tokens share each weight
// load, in registers; more tokens take further passes over the panel, which is then in
// cache. Sums are int32 and exact; the scales are applied once, in fp32, and the output
// is rounded to the activations' dtype once (or left in fp32: logits).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <type_traits>

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512F__)
#define TOKENLOOM_HAS_VNNI 1
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kPanel = 32;  // output features per panel: two zmm registers of int32 sums
constexpr int kMaxRows = 8;  // tokens per pass: 16 sums in registers
constexpr int64_t kChunksPerThread = 8;  // run_panels' share-out
constexpr int64_t kPrefetchQuads = 32;  // 4 KB ahead in the panel, into L2 (as the bf16 slabs do)

#ifdef TOKENLOOM_HAS_VNNI

inline __m512 load_floats(const float* x) { return _mm512_loadu_ps(x); }
inline __m512 load_floats(const at::BFloat16* x) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x))), 16));
}
inline __m512 load_floats_masked(const float* x, __mmask16 m) { return _mm512_maskz_loadu_ps(m, x); }
inline __m512 load_floats_masked(const at::BFloat16* x, __mmask16 m) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, x)), 16));
}

// One token: its bytes u = round(x * 127 / amax) + 128 into `out` (padded to num_quads * 4
// with 128, i.e. zeros), and returns its scale amax / 127 (1 for an all-zero row).
template <typename in_t>
float quantize_row(const in_t* x, int64_t in_features, int64_t num_quads, uint8_t* out) {
  __m512 amax = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= in_features; k += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(load_floats(x + k)));
  const __mmask16 tail = (__mmask16)((1u << (in_features - k)) - 1);
  if (tail) amax = _mm512_max_ps(amax, _mm512_abs_ps(load_floats_masked(x + k, tail)));
  const float max_abs = _mm512_reduce_max_ps(amax);
  const float scale = max_abs > 0.f ? max_abs / 127.f : 1.f;
  const __m512 inv = _mm512_set1_ps(max_abs > 0.f ? 127.f / max_abs : 0.f);
  const __m512i offset = _mm512_set1_epi32(128);
  // Round to nearest even (the MXCSR default), as torch.round does in the reference.
  for (k = 0; k + 16 <= in_features; k += 16) {
    const __m512i q = _mm512_add_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(load_floats(x + k), inv)), offset);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + k), _mm512_cvtusepi32_epi8(q));
  }
  if (tail) {
    const __m512i q = _mm512_add_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(load_floats_masked(x + k, tail), inv)), offset);
    _mm_mask_storeu_epi8(out + k, tail, _mm512_cvtusepi32_epi8(q));
  }
  for (int64_t p = in_features; p < num_quads * 4; ++p) out[p] = 128;
  return scale;
}

// out[r][n0 .. n0 + 32) for rows [0, kRows) of x_quads ([rows][num_quads] words).
template <int kRows, typename out_t>
void panel_rows(const uint32_t* x_quads, int64_t num_quads, const float* x_scales, const int32_t* panel,
                const int32_t* compensation, const float* w_scales, const float* bias, int64_t num_valid,
                out_t* out, int64_t out_stride) {
  __m512i acc[kRows][2];
#pragma GCC unroll 8
  for (int r = 0; r < kRows; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_si512();
  if constexpr (kRows == 1) {
    // One token waits on each add's latency: four sums, over even and odd quads.
    __m512i odd0 = _mm512_setzero_si512(), odd1 = _mm512_setzero_si512();
    int64_t q = 0;
    for (; q + 2 <= num_quads; q += 2) {
      _mm_prefetch(reinterpret_cast<const char*>(panel + (q + kPrefetchQuads) * kPanel), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(panel + (q + kPrefetchQuads) * kPanel + 16), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(panel + (q + kPrefetchQuads + 1) * kPanel), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(panel + (q + kPrefetchQuads + 1) * kPanel + 16), _MM_HINT_T1);
      const __m512i x0 = _mm512_set1_epi32(x_quads[q]), x1 = _mm512_set1_epi32(x_quads[q + 1]);
      acc[0][0] = _mm512_dpbusd_epi32(acc[0][0], x0, _mm512_loadu_si512(panel + q * kPanel));
      acc[0][1] = _mm512_dpbusd_epi32(acc[0][1], x0, _mm512_loadu_si512(panel + q * kPanel + 16));
      odd0 = _mm512_dpbusd_epi32(odd0, x1, _mm512_loadu_si512(panel + (q + 1) * kPanel));
      odd1 = _mm512_dpbusd_epi32(odd1, x1, _mm512_loadu_si512(panel + (q + 1) * kPanel + 16));
    }
    for (; q < num_quads; ++q) {
      const __m512i x0 = _mm512_set1_epi32(x_quads[q]);
      acc[0][0] = _mm512_dpbusd_epi32(acc[0][0], x0, _mm512_loadu_si512(panel + q * kPanel));
      acc[0][1] = _mm512_dpbusd_epi32(acc[0][1], x0, _mm512_loadu_si512(panel + q * kPanel + 16));
    }
    acc[0][0] = _mm512_add_epi32(acc[0][0], odd0);
    acc[0][1] = _mm512_add_epi32(acc[0][1], odd1);
  } else {
    for (int64_t q = 0; q < num_quads; ++q) {
      _mm_prefetch(reinterpret_cast<const char*>(panel + (q + kPrefetchQuads) * kPanel), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(panel + (q + kPrefetchQuads) * kPanel + 16), _MM_HINT_T1);
      const __m512i w0 = _mm512_loadu_si512(panel + q * kPanel);
      const __m512i w1 = _mm512_loadu_si512(panel + q * kPanel + 16);
#pragma GCC unroll 8
      for (int r = 0; r < kRows; ++r) {
        const __m512i x = _mm512_set1_epi32(x_quads[r * num_quads + q]);
        acc[r][0] = _mm512_dpbusd_epi32(acc[r][0], x, w0);
        acc[r][1] = _mm512_dpbusd_epi32(acc[r][1], x, w1);
      }
    }
  }
  // Epilogue: (sum - 128 * sum_k qw) in fp32, times both scales, plus the bias.
  const __mmask16 valid[2] = {
      (__mmask16)(num_valid >= 16 ? 0xffff : (1u << num_valid) - 1),
      (__mmask16)(num_valid >= 32 ? 0xffff : num_valid <= 16 ? 0 : (1u << (num_valid - 16)) - 1)};
#pragma GCC unroll 2
  for (int h = 0; h < 2; ++h) {
    const __m512i comp = _mm512_loadu_si512(compensation + 16 * h);
    const __m512 ws = _mm512_loadu_ps(w_scales + 16 * h);
    const __m512 b = bias != nullptr ? _mm512_loadu_ps(bias + 16 * h) : _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int r = 0; r < kRows; ++r) {
      const __m512 sums = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r][h], comp));
      const __m512 y = _mm512_fmadd_ps(sums, _mm512_mul_ps(ws, _mm512_set1_ps(x_scales[r])), b);
      out_t* dst = out + r * out_stride + 16 * h;
      if constexpr (std::is_same_v<out_t, float>) {
        _mm512_mask_storeu_ps(dst, valid[h], y);
      } else {
        // Round to nearest even, as torch's float -> bf16 cast does.
        const __m512i bits = _mm512_castps_si512(y);
        const __m512i rounding = _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                                                  _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1)));
        const __m256i hi = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_add_epi32(bits, rounding), 16));
        _mm256_mask_storeu_epi16(dst, valid[h], hi);
      }
    }
  }
}

template <typename out_t>
using PanelRowsFn = void (*)(const uint32_t*, int64_t, const float*, const int32_t*, const int32_t*, const float*,
                             const float*, int64_t, out_t*, int64_t);
template <typename out_t>
constexpr PanelRowsFn<out_t> kPanelRows[kMaxRows] = {
    panel_rows<1, out_t>, panel_rows<2, out_t>, panel_rows<3, out_t>, panel_rows<4, out_t>,
    panel_rows<5, out_t>, panel_rows<6, out_t>, panel_rows<7, out_t>, panel_rows<8, out_t>};

// Panels are handed out in chunks from a shared counter (as the bf16 slabs are): a thread
// that loses its core for a while leaves its remaining chunks to the other.
template <typename out_t>
void run_panels(const uint32_t* x_quads, const float* x_scales, int64_t num_tokens, int64_t num_quads,
                const int32_t* panels, const int32_t* compensation, const float* w_scales, const float* bias,
                int64_t num_panels, int64_t out_features, out_t* out) {
  const int64_t num_threads = std::min<int64_t>(at::get_num_threads(), num_panels);
  const int64_t chunk = std::max<int64_t>(1, num_panels / (num_threads * kChunksPerThread));
  std::atomic<int64_t> next_panel{0};
  at::parallel_for(0, num_threads, 1, [&](int64_t, int64_t) {
    for (int64_t first = next_panel.fetch_add(chunk); first < num_panels; first = next_panel.fetch_add(chunk)) {
      for (int64_t p = first; p < std::min(first + chunk, num_panels); ++p) {
        const int64_t n0 = p * kPanel;
        for (int64_t r0 = 0; r0 < num_tokens; r0 += kMaxRows) {
          const int64_t rows = std::min<int64_t>(kMaxRows, num_tokens - r0);
          kPanelRows<out_t>[rows - 1](x_quads + r0 * num_quads, num_quads, x_scales + r0, panels + p * num_quads * kPanel,
                                      compensation + n0, w_scales + n0, bias == nullptr ? nullptr : bias + n0,
                                      out_features - n0, out + r0 * out_features + n0, out_features);
        }
      }
    }
  });
}

template <typename in_t>
void quantize_rows(const in_t* x, int64_t num_tokens, int64_t in_features, int64_t num_quads, uint8_t* out,
                   float* scales) {
  at::parallel_for(0, num_tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      scales[t] = quantize_row(x + t * in_features, in_features, num_quads, out + t * num_quads * 4);
    }
  });
}

#endif  // TOKENLOOM_HAS_VNNI

void check_input(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu() && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "x: 2-D bf16 or fp32 on the CPU");
}

}  // namespace

bool has_int8_linear() {
#ifdef TOKENLOOM_HAS_VNNI
  return true;
#else
  return false;
#endif
}

// x: [num_tokens, in_features] bf16 or fp32 -> (bytes [num_tokens, num_quads * 4] uint8, each
// qx + 128, padded with 128; scales [num_tokens] fp32). The kernel's own activation quantization,
// exposed for tests.
std::vector<torch::Tensor> quantize_activations(torch::Tensor x, int64_t num_quads) {
  TORCH_CHECK(has_int8_linear(), "int8 linears need a CPU with AVX512_VNNI");
  check_input(x);
  TORCH_CHECK(num_quads * 4 >= x.size(1), "num_quads * 4 must cover the input features");
  x = x.contiguous();
  auto bytes = torch::empty({x.size(0), num_quads * 4}, x.options().dtype(at::kByte));
  auto scales = torch::empty({x.size(0)}, x.options().dtype(at::kFloat));
#ifdef TOKENLOOM_HAS_VNNI
  if (x.scalar_type() == at::kFloat) {
    quantize_rows(x.data_ptr<float>(), x.size(0), x.size(1), num_quads, bytes.data_ptr<uint8_t>(), scales.data_ptr<float>());
  } else {
    quantize_rows(x.data_ptr<at::BFloat16>(), x.size(0), x.size(1), num_quads, bytes.data_ptr<uint8_t>(),
                  scales.data_ptr<float>());
  }
#endif
  return {bytes, scales};
}

// x: [num_tokens, in_features] bf16 or fp32; panels: [padded_out / 32, num_quads, 32] int32
// (engine.models.int8_linear.pack_panels' layout); compensation: [padded_out] int32;
// w_scales: [padded_out] fp32; bias: [padded_out] fp32 or empty. Returns [num_tokens,
// out_features] in x's dtype, or with out_fp32 in fp32 (logits).
torch::Tensor int8_linear(torch::Tensor x, torch::Tensor panels, torch::Tensor compensation, torch::Tensor w_scales,
                          torch::Tensor bias, int64_t out_features, bool out_fp32) {
  TORCH_CHECK(has_int8_linear(), "int8 linears need a CPU with AVX512_VNNI");
  check_input(x);
  TORCH_CHECK(panels.dim() == 3 && panels.scalar_type() == torch::kInt32 && panels.size(2) == kPanel &&
                  panels.is_contiguous(), "panels: [padded_out / 32, num_quads, 32] int32, contiguous");
  const int64_t num_tokens = x.size(0), in_features = x.size(1);
  const int64_t num_panels = panels.size(0), num_quads = panels.size(1), padded_out = num_panels * kPanel;
  TORCH_CHECK(num_quads * 4 >= in_features && num_quads * 4 < in_features + 4, "x's features disagree with the weight's");
  TORCH_CHECK(out_features <= padded_out && out_features > padded_out - kPanel, "out_features disagrees with the panels");
  TORCH_CHECK(compensation.scalar_type() == torch::kInt32 && compensation.numel() == padded_out &&
                  compensation.is_contiguous(), "compensation: [padded_out] int32");
  TORCH_CHECK(w_scales.scalar_type() == torch::kFloat && w_scales.numel() == padded_out && w_scales.is_contiguous(),
              "w_scales: [padded_out] fp32");
  const bool has_bias = bias.numel() > 0;
  if (has_bias) {
    TORCH_CHECK(bias.scalar_type() == torch::kFloat && bias.numel() == padded_out && bias.is_contiguous(),
                "bias: [padded_out] fp32");
  }
  auto out = torch::empty({num_tokens, out_features}, x.options().dtype(out_fp32 ? at::kFloat : x.scalar_type()));
  if (num_tokens == 0 || num_panels == 0) return out;
#ifdef TOKENLOOM_HAS_VNNI
  auto quantized = quantize_activations(x, num_quads);  // [num_tokens, num_quads * 4] uint8, [num_tokens] fp32
  const uint32_t* x_quads = reinterpret_cast<const uint32_t*>(quantized[0].data_ptr<uint8_t>());
  const float* x_scales = quantized[1].data_ptr<float>();
  const int32_t* w = panels.data_ptr<int32_t>();
  const int32_t* comp = compensation.data_ptr<int32_t>();
  const float* ws = w_scales.data_ptr<float>();
  const float* b = has_bias ? bias.data_ptr<float>() : nullptr;
  if (out.scalar_type() == at::kFloat) {
    run_panels(x_quads, x_scales, num_tokens, num_quads, w, comp, ws, b, num_panels, out_features, out.data_ptr<float>());
  } else {
    run_panels(x_quads, x_scales, num_tokens, num_quads, w, comp, ws, b, num_panels, out_features,
               out.data_ptr<at::BFloat16>());
  }
#endif
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("has_int8_linear", &has_int8_linear, "whether this build has the int8 kernels (AVX512_VNNI)");
  m.def("quantize_activations", &quantize_activations, "per-token symmetric int8, stored as u8 = q + 128 (CPU)");
  m.def("int8_linear", &int8_linear, "W8A8 linear on vpdpbusd, weights in 32-feature panels (CPU)");
}
