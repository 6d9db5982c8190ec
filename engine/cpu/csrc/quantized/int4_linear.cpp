// W4A8 linear layers on AVX512_VNNI's vpdpbusd, in llama.cpp's Q4_1 format: blocks of 32
// inputs, each with a scale d and a minimum m (fp16), the weights 4-bit codes q in [0, 15]
// with w = d * q + m (engine/cpu/int4_linear.py packs them, from any checkpoint or straight
// from a GGUF's Q4_1 blocks).
//
//   y[t, n] = sum_b sx[t, b] * (d[n, b] * sum_{k in b} q[n, k] * qx[t, k] + m[n, b] * sum_{k in b} qx[t, k])
//
// Activations are quantized here, one scale per (token, block of 32): qx = round(x * 127 /
// max|x|), as llama.cpp's Q8_1 does. The codes are unsigned, so they are vpdpbusd's unsigned
// side as they are, with no offset to correct; the minimum's term needs each block's sum of
// qx, kept per (token, block) beside its scale. A decode step reads 0.625 bytes a weight
// (0.31 of bf16's), the single user's bound on a CPU.
//
// Weights are packed into panels of 32 output rows, each panel contiguous:
//   panels: [out_features / 32, num_blocks * 4, 32] 32-bit words; word (p, 4 b + i, j) holds
//   the codes of row 32 p + j for inputs 8 i .. 8 i + 7 of block b: byte c's low nibble is
//   input 8 i + c, its high nibble input 8 i + 4 + c (two quads of inputs in one word);
//   dm: [out_features / 32, num_blocks, 2, 32] fp16: a panel's d, then its m, block by block.
// One 64-byte load gives 16 rows' codes for 8 inputs: masking gives the low quad, a shift and
// mask the high one, each one vpdpbusd against the token's 4 bytes broadcast. A block's int32
// sums are exact (at most 32 * 15 * 127); its epilogue adds sx * (d * sum + m * sum qx) into
// fp32 accumulators. Up to kMaxRows tokens share each weight load; more take further passes.
#include "share_out.h"  // from engine/cpu/csrc/, copied beside this file for the build
#include "vnni_io.h"

#include <torch/types.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace {

constexpr int64_t kPanel = 32;  // output rows per panel: two zmm registers of sums
constexpr int64_t kBlock = 32;  // inputs per weight (d, m) and per activation scale
constexpr int64_t kWordsPerBlock = 4;  // a row's 32 codes: 4 words of 8 nibbles
constexpr int64_t kQuadsPerBlock = kBlock / 4;
constexpr int kMaxRows = 4;  // tokens per pass: 8 int32 and 8 fp32 accumulators in registers
constexpr int64_t kChunksPerThread = 8;  // run_panels' share-out
constexpr int64_t kPrefetchBlocks = 8;  // 4 KB ahead in the panel, into L2 (as the int8 panels)

#ifdef TOKENLOOM_HAS_VNNI

using tokenloom_vnni::lanes;
using tokenloom_vnni::load_floats_masked;
using tokenloom_vnni::store_outputs;

// One token: qx per block into `out` ([num_blocks * 32] int8, zeros past in_features), its
// scale max|x| / 127 (1 for an all-zero block) and scale * sum qx (the minimum's factor).
template <typename in_t>
void quantize_row(const in_t* x, int64_t in_features, int64_t num_blocks, int8_t* out, float* scales,
                  float* scaled_sums) {
  for (int64_t b = 0; b < num_blocks; ++b) {
    const int64_t k0 = b * kBlock;
    const __m512 v0 = load_floats_masked(x + k0, lanes(in_features - k0));
    const __m512 v1 = load_floats_masked(x + k0 + 16, lanes(in_features - k0 - 16));
    const float max_abs = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    const __m512 inv = _mm512_set1_ps(max_abs > 0.f ? 127.f / max_abs : 0.f);
    // Round to nearest even (the MXCSR default), as torch.round does in the reference.
    const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, inv));
    const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, inv));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + k0), _mm512_cvtsepi32_epi8(q0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + k0 + 16), _mm512_cvtsepi32_epi8(q1));
    const float scale = max_abs > 0.f ? max_abs / 127.f : 1.f;
    scales[b] = scale;
    scaled_sums[b] = scale * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1)));
  }
}

template <typename in_t>
void quantize_rows(const in_t* x, int64_t num_tokens, int64_t in_features, int64_t num_blocks, int8_t* out,
                   float* scales, float* scaled_sums) {
  tokenloom_cpu::parallel_for(0, num_tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      quantize_row(x + t * in_features, in_features, num_blocks, out + t * num_blocks * kBlock,
                   scales + t * num_blocks, scaled_sums + t * num_blocks);
    }
  });
}

struct Activations {
  const uint32_t* quads;  // [rows][num_blocks * 8]
  const float* scales;  // [rows][num_blocks]
  const float* scaled_sums;  // [rows][num_blocks]
};

inline __m512 load_halves(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// out[r][n0 .. n0 + 32) for rows [0, kRows) of `x`, over one panel.
template <int kRows, typename out_t>
void panel_rows(Activations x, int64_t num_blocks, const uint32_t* panel, const at::Half* dm, const float* bias,
                int64_t num_valid, out_t* out, int64_t out_stride) {
  const int64_t num_quads = num_blocks * kQuadsPerBlock;
  const bool prefetch = tokenloom_vnni::prefetches(kRows);
  const __m512i low_nibbles = _mm512_set1_epi8(0x0f);
  __m512 acc[kRows][2];
#pragma GCC unroll 4
  for (int r = 0; r < kRows; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t b = 0; b < num_blocks; ++b) {
    const uint32_t* w = panel + b * kWordsPerBlock * kPanel;
    const char* ahead = reinterpret_cast<const char*>(w + kPrefetchBlocks * kWordsPerBlock * kPanel);
    if (prefetch) {
#pragma GCC unroll 8
      for (int line = 0; line < 8; ++line) _mm_prefetch(ahead + 64 * line, _MM_HINT_T1);
    }
    const int64_t q0 = b * kQuadsPerBlock;
    // Low and high quads sum apart: a lone token's adds then form four chains, not two.
    __m512i lo_sums[kRows][2], hi_sums[kRows][2];
#pragma GCC unroll 4
    for (int r = 0; r < kRows; ++r) lo_sums[r][0] = lo_sums[r][1] = hi_sums[r][0] = hi_sums[r][1] = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int i = 0; i < kWordsPerBlock; ++i) {
      const __m512i w0 = _mm512_loadu_si512(w + i * kPanel);
      const __m512i w1 = _mm512_loadu_si512(w + i * kPanel + 16);
      const __m512i lo0 = _mm512_and_si512(w0, low_nibbles), lo1 = _mm512_and_si512(w1, low_nibbles);
      const __m512i hi0 = _mm512_and_si512(_mm512_srli_epi32(w0, 4), low_nibbles);
      const __m512i hi1 = _mm512_and_si512(_mm512_srli_epi32(w1, 4), low_nibbles);
#pragma GCC unroll 4
      for (int r = 0; r < kRows; ++r) {
        const __m512i xa = _mm512_set1_epi32(x.quads[r * num_quads + q0 + 2 * i]);
        const __m512i xb = _mm512_set1_epi32(x.quads[r * num_quads + q0 + 2 * i + 1]);
        lo_sums[r][0] = _mm512_dpbusd_epi32(lo_sums[r][0], lo0, xa);
        lo_sums[r][1] = _mm512_dpbusd_epi32(lo_sums[r][1], lo1, xa);
        hi_sums[r][0] = _mm512_dpbusd_epi32(hi_sums[r][0], hi0, xb);
        hi_sums[r][1] = _mm512_dpbusd_epi32(hi_sums[r][1], hi1, xb);
      }
    }
    // The block's epilogue: sx * (d * sum + m * sum qx), in fp32.
    const at::Half* block_dm = dm + b * 2 * kPanel;
    const __m512 d[2] = {load_halves(block_dm), load_halves(block_dm + 16)};
    const __m512 m[2] = {load_halves(block_dm + kPanel), load_halves(block_dm + kPanel + 16)};
#pragma GCC unroll 4
    for (int r = 0; r < kRows; ++r) {
      const __m512 xs = _mm512_set1_ps(x.scales[r * num_blocks + b]);
      const __m512 xm = _mm512_set1_ps(x.scaled_sums[r * num_blocks + b]);
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        const __m512 sum = _mm512_cvtepi32_ps(_mm512_add_epi32(lo_sums[r][h], hi_sums[r][h]));
        acc[r][h] = _mm512_fmadd_ps(sum, _mm512_mul_ps(d[h], xs), acc[r][h]);
        acc[r][h] = _mm512_fmadd_ps(m[h], xm, acc[r][h]);
      }
    }
  }
  const __mmask16 valid[2] = {lanes(num_valid), lanes(num_valid - 16)};
#pragma GCC unroll 2
  for (int h = 0; h < 2; ++h) {
    const __m512 bias_h = bias != nullptr ? _mm512_loadu_ps(bias + 16 * h) : _mm512_setzero_ps();
#pragma GCC unroll 4
    for (int r = 0; r < kRows; ++r) {
      store_outputs(out + r * out_stride + 16 * h, valid[h], _mm512_add_ps(acc[r][h], bias_h));
    }
  }
}

template <typename out_t>
using PanelRowsFn = void (*)(Activations, int64_t, const uint32_t*, const at::Half*, const float*, int64_t, out_t*,
                             int64_t);
template <typename out_t>
constexpr PanelRowsFn<out_t> kPanelRows[kMaxRows] = {panel_rows<1, out_t>, panel_rows<2, out_t>,
                                                     panel_rows<3, out_t>, panel_rows<4, out_t>};

template <typename out_t>
void run_panels(Activations x, int64_t num_tokens, int64_t num_blocks, const uint32_t* panels, const at::Half* dm,
                const float* bias, int64_t num_panels, int64_t out_features, out_t* out) {
  const int64_t num_quads = num_blocks * kQuadsPerBlock;
  tokenloom_cpu::share_out<kChunksPerThread>(num_panels, [&](int64_t p) {
    const int64_t n0 = p * kPanel;
    for (int64_t r0 = 0; r0 < num_tokens; r0 += kMaxRows) {
      const int64_t rows = std::min<int64_t>(kMaxRows, num_tokens - r0);
      const Activations block{x.quads + r0 * num_quads, x.scales + r0 * num_blocks, x.scaled_sums + r0 * num_blocks};
      kPanelRows<out_t>[rows - 1](block, num_blocks, panels + p * num_blocks * kWordsPerBlock * kPanel,
                                  dm + p * num_blocks * 2 * kPanel, bias == nullptr ? nullptr : bias + n0,
                                  out_features - n0, out + r0 * out_features + n0, out_features);
    }
  });
}

#endif  // TOKENLOOM_HAS_VNNI

}  // namespace

int64_t q4_block_size() { return kBlock; }

namespace {

// x (contiguous) quantized into bytes [num_tokens, num_blocks * 32], scales and scaled sums
// [num_tokens, num_blocks]: quantize_activations_q4's arrays, wherever the caller keeps them.
void quantize_into_q4(const torch::Tensor& x, int64_t num_blocks, int8_t* bytes, float* scales, float* scaled_sums) {
#ifdef TOKENLOOM_HAS_VNNI
  if (x.scalar_type() == at::kFloat) {
    quantize_rows(x.data_ptr<float>(), x.size(0), x.size(1), num_blocks, bytes, scales, scaled_sums);
  } else {
    quantize_rows(x.data_ptr<at::BFloat16>(), x.size(0), x.size(1), num_blocks, bytes, scales, scaled_sums);
  }
#endif
}

}  // namespace

// x: [num_tokens, in_features] bf16 or fp32 -> (qx [num_tokens, num_blocks * 32] int8, zeros
// past in_features; scales [num_tokens, num_blocks] fp32; scale * sum qx [num_tokens, num_blocks]
// fp32). The kernel's own activation quantization, exposed for tests.
std::vector<torch::Tensor> quantize_activations_q4(torch::Tensor x, int64_t num_blocks) {
  TORCH_CHECK(tokenloom_vnni::has_vnni(), "int4 linears need a CPU with AVX512_VNNI");
  tokenloom_vnni::check_activations(x);
  TORCH_CHECK(num_blocks * kBlock >= x.size(1) && (num_blocks - 1) * kBlock < x.size(1),
              "num_blocks must be in_features / 32, rounded up");
  x = x.contiguous();
  auto bytes = torch::empty({x.size(0), num_blocks * kBlock}, x.options().dtype(at::kChar));
  auto scales = torch::empty({x.size(0), num_blocks}, x.options().dtype(at::kFloat));
  auto scaled_sums = torch::empty({x.size(0), num_blocks}, x.options().dtype(at::kFloat));
  quantize_into_q4(x, num_blocks, bytes.data_ptr<int8_t>(), scales.data_ptr<float>(), scaled_sums.data_ptr<float>());
  return {bytes, scales, scaled_sums};
}

// x: [num_tokens, in_features] bf16 or fp32; panels: [padded_out / 32, num_blocks * 4, 32] int32
// and dm: [padded_out / 32, num_blocks, 2, 32] fp16 (engine.cpu.int4_linear's layout); bias:
// [padded_out] fp32 or empty. Returns [num_tokens, out_features] in x's dtype, or with out_fp32
// in fp32 (logits).
torch::Tensor int4_linear(const torch::Tensor& x_in, const torch::Tensor& panels, const torch::Tensor& dm,
                          const torch::Tensor& bias, int64_t out_features, bool out_fp32) {
  TORCH_CHECK(tokenloom_vnni::has_vnni(), "int4 linears need a CPU with AVX512_VNNI");
  tokenloom_vnni::check_activations(x_in);
  TORCH_CHECK(panels.dim() == 3 && panels.scalar_type() == torch::kInt32 && panels.size(2) == kPanel &&
                  panels.size(1) % kWordsPerBlock == 0 && panels.is_contiguous(),
              "panels: [padded_out / 32, num_blocks * 4, 32] int32, contiguous");
  const int64_t num_tokens = x_in.size(0), in_features = x_in.size(1);
  const int64_t num_panels = panels.size(0), num_blocks = panels.size(1) / kWordsPerBlock;
  const int64_t padded_out = num_panels * kPanel;
  TORCH_CHECK(num_blocks * kBlock >= in_features && (num_blocks - 1) * kBlock < in_features,
              "x's features disagree with the weight's");
  TORCH_CHECK(out_features <= padded_out && out_features > padded_out - kPanel, "out_features disagrees with the panels");
  TORCH_CHECK(dm.scalar_type() == torch::kHalf && dm.dim() == 4 && dm.size(0) == num_panels && dm.size(1) == num_blocks &&
                  dm.size(2) == 2 && dm.size(3) == kPanel && dm.is_contiguous(),
              "dm: [padded_out / 32, num_blocks, 2, 32] fp16, contiguous");
  const bool has_bias = bias.numel() > 0;
  if (has_bias) {
    TORCH_CHECK(bias.scalar_type() == torch::kFloat && bias.numel() == padded_out && bias.is_contiguous(),
                "bias: [padded_out] fp32");
  }
  auto out = torch::empty({num_tokens, out_features}, x_in.options().dtype(out_fp32 ? at::kFloat : x_in.scalar_type()));
  if (num_tokens == 0 || num_panels == 0) return out;
#ifdef TOKENLOOM_HAS_VNNI
  // [num_tokens, num_blocks * 32] int8, [num_tokens, num_blocks] fp32 twice
  const auto scratch = tokenloom_vnni::activation_scratch(num_tokens, num_blocks, kBlock);
  quantize_into_q4(x_in.contiguous(), num_blocks, scratch.bytes, static_cast<float*>(scratch.first),
                   static_cast<float*>(scratch.second));
  const Activations xq{reinterpret_cast<const uint32_t*>(scratch.bytes), static_cast<const float*>(scratch.first),
                       static_cast<const float*>(scratch.second)};
  const uint32_t* w = reinterpret_cast<const uint32_t*>(panels.data_ptr<int32_t>());
  const at::Half* scales = dm.data_ptr<at::Half>();
  const float* b = has_bias ? bias.data_ptr<float>() : nullptr;
  if (out.scalar_type() == at::kFloat) {
    run_panels(xq, num_tokens, num_blocks, w, scales, b, num_panels, out_features, out.data_ptr<float>());
  } else {
    run_panels(xq, num_tokens, num_blocks, w, scales, b, num_panels, out_features, out.data_ptr<at::BFloat16>());
  }
#endif
  return out;
}
