// AVX2 helpers shared by the CPU kernels (runtime/csrc/*.cpp).
#pragma once
#include <immintrin.h>

#include <cstdint>

namespace deepinfer_simd {

// Eight bf16 values widened to fp32: bf16 is fp32's upper half, so a zero-extend and a 16-bit shift.
inline __m256 load_bf16(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// The horizontal sum of one vector.
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The eight horizontal sums of a[0..8) in one vector, [sum a[0], .., sum a[7]]: one hadd tree, ~4x fewer
// instructions than eight hsum calls.
inline __m256 hsum8(const __m256* a) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

}  // namespace deepinfer_simd
