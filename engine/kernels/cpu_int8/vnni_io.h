// What the int8 and int4 matmuls share (int8_linear.cpp, int4_linear.cpp): the VNNI build
// switch, a token's inputs loaded as fp32 under a mask, the output store (fp32, or bf16 rounded
// to nearest even as torch's cast does) and the check of the activations they take.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <type_traits>

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512F__)
#define TOKENLOOM_HAS_VNNI 1
#include <immintrin.h>
#endif

namespace tokenloom_vnni {

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
