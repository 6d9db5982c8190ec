// Fused element-wise ops for the eager CPU path: one pass over memory instead of
// one torch op (and one Python call) each.
//   add_rms_norm      residual += x; x = rmsnorm(residual) * weight, in place (vLLM's fused_add_rms_norm)
//   rms_norm          out = rmsnorm(x) * weight (the first layer, which has no residual yet)
//   silu_and_mul      [T, 2I] gate|up -> [T, I] silu(gate) * up
//   rotary_store_kv   rotate q and k (neox, rotate halves), write k and v into the paged cache,
//                     return rotated q
//
// Every op gives the same bits as the torch code it replaces (engine/models/layers.py) in
// fp32 and in bf16/fp16: math in fp32, rounded to the model dtype wherever the torch code
// rounds (each torch op on bf16 returns bf16). Two things make that hold:
//  * no FMA contraction: the pragma below comes before every include so inlined header
//    code agrees with it (the build passes no -ffast-math to any kernel).
//  * RMSNorm's sum of squares follows ATen's cascade_sum order (aten/src/ATen/native/cpu/
//    SumKernel.cpp) for a vector width passed in as `lanes`; SiLU's exp is ATen's own
//    (SLEEF's expf u10) on the elements ATen vectorizes, glibc's expf on its scalar tail.
//    Which widths this torch build uses is probed once from Python (engine/cpu/fused.py).
#pragma GCC optimize("fp-contract=off")

#include "share_out.h"  // tokenloom_cpu::parallel_for: a decode step's work pool
#include <torch/types.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#include <sleef.h>
#endif

namespace {

// Element-wise work per task below this many elements stays on one thread: a
// parallel region costs a few microseconds, as much as a small step's whole op,
// and far more on a busy host, where a barrier can wait out another process's
// time slice. ATen's own grain (at::internal::GRAIN_SIZE), so these ops fork no
// more often than the torch ops they replace.
constexpr int64_t kMinElementsPerTask = at::internal::GRAIN_SIZE;

int64_t grain_size(int64_t row_elements) {
  return std::max<int64_t>(1, kMinElementsPerTask / std::max<int64_t>(1, row_elements));
}

// Conversions to and from fp32, rounding exactly as c10 and ATen's vectors do
// (round to nearest even); written on raw bits so the compiler vectorizes them.
template <typename scalar_t>
struct Cvt {
  static float load(scalar_t x) { return static_cast<float>(x); }
  static scalar_t store(float x) { return static_cast<scalar_t>(x); }
};

template <>
struct Cvt<float> {
  static float load(float x) { return x; }
  static float store(float x) { return x; }
};

template <>
struct Cvt<c10::BFloat16> {
  static float load(c10::BFloat16 x) {
    const uint32_t bits = static_cast<uint32_t>(x.x) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof(f));
    return f;
  }
  static c10::BFloat16 store(float f) {
    uint32_t bits;
    std::memcpy(&bits, &f, sizeof(bits));
    const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    return c10::BFloat16(static_cast<uint16_t>(f != f ? 0x7fc0u : rounded), c10::BFloat16::from_bits());
  }
};

// The value as the model dtype holds it: what a torch op on that dtype returns.
template <typename scalar_t>
inline float round_to(float x) {
  return Cvt<scalar_t>::load(Cvt<scalar_t>::store(x));
}

int64_t ceil_log2(int64_t x) {  // ATen's utils::CeilLog2
  if (x <= 2) return 1;
  return 64 - __builtin_clzll(static_cast<uint64_t>(x - 1));
}

// sum(x[i]^2), in the order of ATen's sum over a contiguous row: vectors of L lanes
// read as a (-1, 4) array, each column summed with a 4-level cascade (multi_row_sum),
// leftover vectors into column 0, the columns added, then the scalars past the last
// full vector and the lanes one by one (vectorized_inner_sum). L == 1 is its scalar
// path (rows shorter than a vector).
template <int L>
float sum_of_squares(const float* x, int64_t n) {
  constexpr int64_t kIlp = 4, kNumLevels = 4;
  const int64_t num_vecs = n / L;
  const int64_t size = num_vecs / kIlp;
  const int64_t level_power = std::max<int64_t>(4, ceil_log2(size) / kNumLevels);
  const int64_t level_step = int64_t{1} << level_power;
  const int64_t level_mask = level_step - 1;
  float acc[kNumLevels][kIlp][L] = {};
  auto add_vec = [x](float* a, int64_t vec) {
    const float* v = x + vec * L;
    for (int l = 0; l < L; ++l) a[l] += v[l] * v[l];
  };
  int64_t i = 0;
  while (i + level_step <= size) {
    for (int64_t j = 0; j < level_step; ++j, ++i)
      for (int64_t k = 0; k < kIlp; ++k) add_vec(acc[0][k], i * kIlp + k);
    for (int64_t j = 1; j < kNumLevels; ++j) {
      for (int64_t k = 0; k < kIlp; ++k)
        for (int l = 0; l < L; ++l) {
          acc[j][k][l] += acc[j - 1][k][l];
          acc[j - 1][k][l] = 0.f;
        }
      if ((i & (level_mask << (j * level_power))) != 0) break;
    }
  }
  for (; i < size; ++i)
    for (int64_t k = 0; k < kIlp; ++k) add_vec(acc[0][k], i * kIlp + k);
  for (int64_t j = 1; j < kNumLevels; ++j)
    for (int64_t k = 0; k < kIlp; ++k)
      for (int l = 0; l < L; ++l) acc[0][k][l] += acc[j][k][l];
  for (int64_t vec = size * kIlp; vec < num_vecs; ++vec) add_vec(acc[0][0], vec);
  for (int64_t k = 1; k < kIlp; ++k)
    for (int l = 0; l < L; ++l) acc[0][0][l] += acc[0][k][l];
  if (L == 1) return acc[0][0][0];
  float total = 0.f;
  for (int64_t h = num_vecs * L; h < n; ++h) total += x[h] * x[h];
  for (int l = 0; l < L; ++l) total += acc[0][0][l];
  return total;
}

float aten_sum_of_squares(const float* x, int64_t n, int64_t lanes) {
  if (lanes == 16 && n >= 16) return sum_of_squares<16>(x, n);
  if (lanes == 8 && n >= 8) return sum_of_squares<8>(x, n);
  if (lanes == 4 && n >= 4) return sum_of_squares<4>(x, n);
  return sum_of_squares<1>(x, n);
}

// One row: normalise `row` (fp32, already in the model dtype's precision) into out.
// Matches RMSNorm.forward: x * rsqrt(mean(x^2) + eps) in fp32, rounded to the dtype,
// then times the weight in the dtype. mean is sum / n, as ATen's CPU mean computes it.
template <typename scalar_t>
void norm_row(const float* row, const scalar_t* weight, int64_t n, float eps, int64_t lanes, scalar_t* out) {
  const float mean = aten_sum_of_squares(row, n, lanes) / static_cast<float>(n);
  const float inv_rms = 1.f / std::sqrt(mean + eps);
  for (int64_t h = 0; h < n; ++h)
    out[h] = Cvt<scalar_t>::store(Cvt<scalar_t>::load(weight[h]) * round_to<scalar_t>(row[h] * inv_rms));
}

void check_norm_args(const torch::Tensor& x, const torch::Tensor& weight) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [num_tokens, hidden] with contiguous rows");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous(), "weight must be [hidden]");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "weight and x must share a dtype");
}

#if defined(__AVX512F__)
constexpr int64_t kExpLanes = 16;  // SLEEF's 16-lane expf, as ATen's AVX512 Vectorized<float>::exp
#elif defined(__AVX2__)
constexpr int64_t kExpLanes = 8;  // SLEEF's 8-lane expf, as ATen's AVX2 Vectorized<float>::exp
#endif

// silu(g) = g / (1 + exp(-g)), as ATen computes it: vectorized over the first
// `vector_end` elements of a row, glibc's expf on the rest.
inline void silu_rows(const float* g, int64_t n, int64_t vector_end, float* out) {
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 one = _mm512_set1_ps(1.f);
  for (; i + kExpLanes <= vector_end; i += kExpLanes) {
    const __m512 x = _mm512_loadu_ps(g + i);
    const __m512 neg = _mm512_xor_ps(_mm512_set1_ps(-0.f), x);
    _mm512_storeu_ps(out + i, _mm512_div_ps(x, _mm512_add_ps(one, Sleef_expf16_u10(neg))));
  }
#elif defined(__AVX2__)
  // glibc's scalar expf took 30 us of a 1B model's one-token step per layer (docs/cpu-kernels.md)
  const __m256 one = _mm256_set1_ps(1.f);
  for (; i + kExpLanes <= vector_end; i += kExpLanes) {
    const __m256 x = _mm256_loadu_ps(g + i);
    const __m256 neg = _mm256_xor_ps(_mm256_set1_ps(-0.f), x);
    _mm256_storeu_ps(out + i, _mm256_div_ps(x, _mm256_add_ps(one, Sleef_expf8_u10(neg))));
  }
#else
  (void)vector_end;
#endif
  for (; i < n; ++i) out[i] = g[i] / (1.f + std::exp(-g[i]));
}

}  // namespace

// x: [num_tokens, hidden], residual: same; weight: [hidden]. In place: residual += x,
// then x = rmsnorm(residual) * weight. lanes: ATen's fp32 vector width (its sum order).
void add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps, int64_t lanes) {
  check_norm_args(x, weight);
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.stride(1) == 1, "residual must match x");
  TORCH_CHECK(residual.scalar_type() == x.scalar_type(), "residual and x must share a dtype");
  const int64_t num_tokens = x.size(0), hidden = x.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm", [&] {
    scalar_t* xs = x.data_ptr<scalar_t>();
    scalar_t* rs = residual.data_ptr<scalar_t>();
    const scalar_t* w = weight.data_ptr<scalar_t>();
    const int64_t x_stride = x.stride(0), r_stride = residual.stride(0);
    tokenloom_cpu::parallel_for(0, num_tokens, grain_size(hidden), [&](int64_t begin, int64_t end) {
      std::vector<float> row(hidden);
      for (int64_t t = begin; t < end; ++t) {
        scalar_t* xt = xs + t * x_stride;
        scalar_t* rt = rs + t * r_stride;
        for (int64_t h = 0; h < hidden; ++h) {
          rt[h] = Cvt<scalar_t>::store(Cvt<scalar_t>::load(xt[h]) + Cvt<scalar_t>::load(rt[h]));
          row[h] = Cvt<scalar_t>::load(rt[h]);
        }
        norm_row<scalar_t>(row.data(), w, hidden, static_cast<float>(eps), lanes, xt);
      }
    });
  });
}

// x: [num_tokens, hidden] -> [num_tokens, hidden] rmsnorm(x) * weight.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps, int64_t lanes) {
  check_norm_args(x, weight);
  const int64_t num_tokens = x.size(0), hidden = x.size(1);
  auto out = torch::empty({num_tokens, hidden}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    const scalar_t* xs = x.data_ptr<scalar_t>();
    const scalar_t* w = weight.data_ptr<scalar_t>();
    scalar_t* os = out.data_ptr<scalar_t>();
    const int64_t x_stride = x.stride(0);
    tokenloom_cpu::parallel_for(0, num_tokens, grain_size(hidden), [&](int64_t begin, int64_t end) {
      std::vector<float> row(hidden);
      for (int64_t t = begin; t < end; ++t) {
        for (int64_t h = 0; h < hidden; ++h) row[h] = Cvt<scalar_t>::load(xs[t * x_stride + h]);
        norm_row<scalar_t>(row.data(), w, hidden, static_cast<float>(eps), lanes, os + t * hidden);
      }
    });
  });
  return out;
}

// Pieces each token's row is cut into in a decode step's work pool: one per pool thread, so a
// one-token step's SiLU*up (otherwise the master's alone, the other thread idle) runs on both.
// Outside a pool a row stays one task (a fork costs more than the row).
int64_t silu_pieces(int64_t num_tokens, int64_t inter, int64_t step) {
  const tokenloom_cpu::WorkPool* pool = tokenloom_cpu::active_pool();
  if (pool == nullptr || num_tokens >= pool->num_threads()) return 1;
  return std::max<int64_t>(1, std::min<int64_t>(pool->num_threads(), inter / step));
}

// gate_up: [num_tokens, 2 * inter] -> [num_tokens, inter] silu(gate) * up, both rounded
// to the dtype like F.silu(gate) * up. lanes: ATen's fp32 vector width, which sets how
// much of each row ATen's silu vectorizes (two vectors of the dtype per iteration).
// A row may go in pieces (silu_pieces) cut at multiples of that step, so every element
// takes the same path (vector or the row's scalar tail) as in one piece: the same bits.
torch::Tensor silu_and_mul(torch::Tensor gate_up, int64_t lanes) {
  TORCH_CHECK(gate_up.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0,
              "gate_up must be [num_tokens, 2 * inter] with contiguous rows");
  const int64_t num_tokens = gate_up.size(0), inter = gate_up.size(1) / 2;
  auto out = torch::empty({num_tokens, inter}, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "silu_and_mul", [&] {
    // ATen's Vectorized<scalar_t> holds lanes * 4 / sizeof(scalar_t) elements.
    const int64_t step = 2 * lanes * static_cast<int64_t>(sizeof(float) / sizeof(scalar_t));
    const int64_t vector_end = inter / step * step;
    const int64_t num_pieces = silu_pieces(num_tokens, inter, step);
    const int64_t piece = (inter / num_pieces + step - 1) / step * step;  // a multiple of step
    const scalar_t* in = gate_up.data_ptr<scalar_t>();
    scalar_t* os = out.data_ptr<scalar_t>();
    const int64_t in_stride = gate_up.stride(0);
    const int64_t grain = num_pieces > 1 ? 1 : grain_size(2 * inter);
    tokenloom_cpu::parallel_for(0, num_tokens * num_pieces, grain, [&](int64_t begin, int64_t end) {
      std::vector<float> gate(std::min(piece, inter)), act(std::min(piece, inter));
      for (int64_t item = begin; item < end; ++item) {
        const int64_t t = item / num_pieces, first = item % num_pieces * piece;
        const int64_t n = std::min(piece, inter - first);
        if (n <= 0) continue;
        const scalar_t* g = in + t * in_stride + first;
        const scalar_t* u = g + inter;
        for (int64_t i = 0; i < n; ++i) gate[i] = Cvt<scalar_t>::load(g[i]);
        silu_rows(gate.data(), n, std::clamp<int64_t>(vector_end - first, 0, n), act.data());
        scalar_t* o = os + t * inter + first;
        for (int64_t i = 0; i < n; ++i)
          o[i] = Cvt<scalar_t>::store(round_to<scalar_t>(act[i]) * Cvt<scalar_t>::load(u[i]));
      }
    });
  });
  return out;
}

namespace {

// x * cos + rotate_half(x) * sin for one head, each product and the sum rounded to
// the dtype as the three torch ops do. cos and sin repeat their first half.
template <typename scalar_t>
inline void rotate_head(const scalar_t* x, const scalar_t* cos, const scalar_t* sin, int64_t head_dim, scalar_t* out) {
  const int64_t half = head_dim / 2;
  for (int64_t d = 0; d < head_dim; ++d) {
    const float other = d < half ? -Cvt<scalar_t>::load(x[d + half]) : Cvt<scalar_t>::load(x[d - half]);
    const float a = round_to<scalar_t>(Cvt<scalar_t>::load(x[d]) * Cvt<scalar_t>::load(cos[d]));
    const float b = round_to<scalar_t>(other * Cvt<scalar_t>::load(sin[d]));
    out[d] = Cvt<scalar_t>::store(a + b);
  }
}

}  // namespace

// qkv: [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim], q|k|v per row (the qkv
// matmul's output); cos, sin: [num_tokens, head_dim] in the dtype; slot_mapping:
// [num_tokens] int64, negative = padding, written nowhere; caches: [num_blocks,
// num_kv_heads, block_size, head_dim]. Rotates q and k, writes k and v into their
// slots, returns rotated q: [num_tokens, num_heads, head_dim]. Rotated k also replaces k in
// qkv itself, so a prompt computed whole in this step can attend to its own keys without
// reading them back from the cache.
torch::Tensor rotary_store_kv(
    torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor slot_mapping,
    torch::Tensor k_cache, torch::Tensor v_cache, int64_t num_heads, int64_t num_kv_heads) {
  TORCH_CHECK(qkv.device().is_cpu() && k_cache.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "caches must be [num_blocks, num_kv_heads, block_size, head_dim]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  const int64_t num_tokens = qkv.size(0), head_dim = k_cache.size(3), block_size = k_cache.size(2);
  TORCH_CHECK(k_cache.size(1) == num_kv_heads && head_dim % 2 == 0, "cache heads disagree");
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && qkv.size(1) == (num_heads + 2 * num_kv_heads) * head_dim,
              "qkv must be [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim] with contiguous rows");
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.dim() == 2 && cos.size(0) == num_tokens && cos.size(1) == head_dim &&
              cos.is_contiguous() && sin.is_contiguous(), "cos and sin must be contiguous [num_tokens, head_dim]");
  const auto dtype = qkv.scalar_type();
  TORCH_CHECK(cos.scalar_type() == dtype && sin.scalar_type() == dtype && k_cache.scalar_type() == dtype &&
              v_cache.scalar_type() == dtype, "qkv, cos, sin and the caches must share a dtype");
  TORCH_CHECK(slot_mapping.scalar_type() == torch::kInt64 && slot_mapping.dim() == 1 && slot_mapping.size(0) == num_tokens,
              "slot_mapping must be [num_tokens] int64");
  slot_mapping = slot_mapping.contiguous();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t num_slots = k_cache.size(0) * block_size;
  // Checked up front: the loop below writes through these without bounds checks.
  for (int64_t t = 0; t < num_tokens; ++t) TORCH_CHECK(slots[t] < num_slots, "slot ", slots[t], " outside the cache");

  auto q_out = torch::empty({num_tokens, num_heads, head_dim}, qkv.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "rotary_store_kv", [&] {
    scalar_t* in = qkv.data_ptr<scalar_t>();
    const scalar_t* cs = cos.data_ptr<scalar_t>();
    const scalar_t* sn = sin.data_ptr<scalar_t>();
    scalar_t* qo = q_out.data_ptr<scalar_t>();
    scalar_t* kc = k_cache.data_ptr<scalar_t>();
    scalar_t* vc = v_cache.data_ptr<scalar_t>();
    const int64_t in_stride = qkv.stride(0);
    const int64_t row = (num_heads + 2 * num_kv_heads) * head_dim;
    tokenloom_cpu::parallel_for(0, num_tokens, grain_size(row), [&](int64_t begin, int64_t end) {
      std::vector<scalar_t> k_rotated(num_kv_heads * head_dim);
      for (int64_t t = begin; t < end; ++t) {
        const scalar_t* q = in + t * in_stride;
        scalar_t* k = in + t * in_stride + num_heads * head_dim;
        const scalar_t* v = k + num_kv_heads * head_dim;
        const scalar_t* c = cs + t * head_dim;
        const scalar_t* s = sn + t * head_dim;
        for (int64_t h = 0; h < num_heads; ++h)
          rotate_head(q + h * head_dim, c, s, head_dim, qo + (t * num_heads + h) * head_dim);
        for (int64_t h = 0; h < num_kv_heads; ++h)
          rotate_head(k + h * head_dim, c, s, head_dim, k_rotated.data() + h * head_dim);
        std::memcpy(k, k_rotated.data(), num_kv_heads * head_dim * sizeof(scalar_t));
        if (slots[t] < 0) continue;  // a padding row
        const int64_t block = slots[t] / block_size, offset = slots[t] % block_size;
        for (int64_t h = 0; h < num_kv_heads; ++h) {
          const int64_t dst = ((block * num_kv_heads + h) * block_size + offset) * head_dim;
          std::memcpy(kc + dst, k + h * head_dim, head_dim * sizeof(scalar_t));
          std::memcpy(vc + dst, v + h * head_dim, head_dim * sizeof(scalar_t));
        }
      }
    });
  });
  return q_out;
}
