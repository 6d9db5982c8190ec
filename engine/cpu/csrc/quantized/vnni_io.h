// What the int8 and int4 matmuls share (int8_linear.cpp, int4_linear.cpp): the VNNI build
// switch, a token's inputs loaded as fp32 under a mask, the output store (fp32, or bf16 rounded
// to nearest even as torch's cast does), the check of the activations they take and the
// scratch their quantized activations go to.
#pragma once

#include <torch/types.h>

#include <atomic>
#include <cstdint>
#include <type_traits>
#include <vector>

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512F__)
#define TOKENLOOM_HAS_VNNI 1
#include <immintrin.h>
#endif

namespace tokenloom_vnni {

// Whether one-token calls take the panels' software prefetches (set_one_token_prefetch; the
// host's choice, as the GGUF kernels' and the bf16 slabs' is: engine/cpu/prefetch_tuner.py).
// Calls of more rows keep them.
inline std::atomic<bool> g_one_token_prefetch{true};

inline bool prefetches(int num_rows) {
  return num_rows > 1 || g_one_token_prefetch.load(std::memory_order_relaxed);
}

inline bool has_vnni() {
#ifdef TOKENLOOM_HAS_VNNI
  return true;
#else
  return false;
#endif
}

inline void check_activations(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu() && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "x: 2-D bf16 or fp32 on the CPU");
}

// A call's quantized activations: the bytes, then two [num_tokens, num_groups] arrays of 4-byte
// values, each at a 64-byte boundary, in memory the calling thread keeps from call to call.
// Three tensors made and freed in every call (allocation, dispatch, reference counts) cost a
// one-token step of the default model about as much as quantizing its activations did.
struct ActivationScratch {
  int8_t* bytes;
  void* first;  // [num_tokens, num_groups] 4-byte values
  void* second;  // [num_tokens, num_groups] 4-byte values
};

inline ActivationScratch activation_scratch(int64_t num_tokens, int64_t num_groups, int64_t group) {
  static thread_local std::vector<uint8_t> buffer;
  const auto round_up = [](size_t n) { return (n + 63) / 64 * 64; };
  const size_t num_bytes = round_up(static_cast<size_t>(num_tokens * num_groups * group));
  const size_t num_values = round_up(static_cast<size_t>(num_tokens * num_groups) * 4);
  if (buffer.size() < num_bytes + 2 * num_values + 64) buffer.resize(num_bytes + 2 * num_values + 64);
  uint8_t* base = reinterpret_cast<uint8_t*>(round_up(reinterpret_cast<uintptr_t>(buffer.data())));
  return {reinterpret_cast<int8_t*>(base), base + num_bytes, base + num_bytes + num_values};
}

#ifdef TOKENLOOM_HAS_VNNI

inline __m512 load_floats_masked(const float* x, __mmask16 m) { return _mm512_maskz_loadu_ps(m, x); }
inline __m512 load_floats_masked(const at::BFloat16* x, __mmask16 m) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, x)), 16));
}

// The first n of 16 lanes.
inline __mmask16 lanes(int64_t n) { return n >= 16 ? (__mmask16)0xffff : n <= 0 ? (__mmask16)0 : (__mmask16)((1u << n) - 1); }

// y's lanes under `valid` to dst, in fp32 or rounded to bf16 (nearest even, as torch's float -> bf16 cast).
template <typename out_t>
inline void store_outputs(out_t* dst, __mmask16 valid, __m512 y) {
  if constexpr (std::is_same_v<out_t, float>) {
    _mm512_mask_storeu_ps(dst, valid, y);
  } else {
    const __m512i bits = _mm512_castps_si512(y);
    const __m512i rounding = _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                                              _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1)));
    _mm256_mask_storeu_epi16(dst, valid, _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_add_epi32(bits, rounding), 16)));
  }
}

#endif  // TOKENLOOM_HAS_VNNI

}  // namespace tokenloom_vnni
