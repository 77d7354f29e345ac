// SIMD building blocks shared by Tandem's CPU kernels (AVX512 when compiled with it).
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

// 8-wide AVX2 + FMA versions of the decode kernel's steps where the CPU has no AVX512 (Zen 2/3,
// most Intel client cores): its portable loops ran at a fifth of the read bandwidth there.
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define TANDEM_AVX2 1
#endif

// Hot helpers are forced inline so a compile-time size propagates into their loops.
#if defined(__GNUC__)
#define TANDEM_INLINE inline __attribute__((always_inline))
#else
#define TANDEM_INLINE inline
#endif

// dpbf16 (bf16 pair dot products) in the attention kernels; -DTANDEM_NO_DPBF16 widens bf16 to float
// and uses FMAs instead, which is faster on CPUs where dpbf16 issues at a fraction of the FMA rate.
#if defined(__AVX512BF16__) && !defined(TANDEM_NO_DPBF16)
#define TANDEM_DPBF16 1
#endif

namespace tandem_ops {

using bf16 = c10::BFloat16;

#if defined(__AVX512F__)

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }

// An int8 KV row's values as floats, unscaled (the row's scale is applied once per token).
inline __m512 load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

inline __m512 load16(const bf16* p) {
  // bf16 is the top half of a float: widen to 32 bits and shift.
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// exp(x) for x <= 0 (the argument is always score - running max). Range reduction to
// r in [-ln2/2, ln2/2] and a degree-7 Taylor polynomial: ~1 ulp, far cheaper than scalar expf.
inline __m512 exp512(__m512 x) {
  const __m512 log2e = _mm512_set1_ps(1.44269504088896341f);
  const __m512 ln2_hi = _mm512_set1_ps(0.693359375f);
  const __m512 ln2_lo = _mm512_set1_ps(-2.12194440e-4f);
  x = _mm512_max_ps(x, _mm512_set1_ps(-88.0f));
  __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(k, ln2_hi, x);
  r = _mm512_fnmadd_ps(k, ln2_lo, r);
  __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, k);
}

inline __mmask16 lane_mask(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1u);
}

inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }

inline __m512 load16(const bf16* p, __mmask16 m) {
  __m256i raw = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// Round to the storage type: float stores as is; bf16 rounds to nearest even, as c10 does
// (NaN stays NaN), so a kernel and its PyTorch fallback agree to the bit.
inline __m512 round_as(__m512 x, const float*) { return x; }

inline __m256i to_bf16_bits(__m512 x) {
#if defined(__AVX512BF16__)
  return (__m256i)_mm512_cvtneps_pbh(x);
#else
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(r);
#endif
}

inline __m512 round_as(__m512 x, const bf16*) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16_bits(x)), 16));
}

inline void store16(float* p, __m512 x, __mmask16 m = 0xFFFF) { _mm512_mask_storeu_ps(p, m, x); }

inline void store16(bf16* p, __m512 x, __mmask16 m = 0xFFFF) { _mm256_mask_storeu_epi16(p, m, to_bf16_bits(x)); }

#endif  // __AVX512F__

#if defined(TANDEM_AVX2)

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

// An int8 KV row's values as floats, unscaled (the row's scale is applied once per token).
inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

inline __m256 load8(const bf16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

// exp(x) for x <= 0, as exp512: range reduction and a degree-7 Taylor polynomial; 2^k is built in the
// exponent bits (k >= -127 after the clamp; k = -127 gives 0, below any weight that matters).
inline __m256 exp256(__m256 x) {
  const __m256 log2e = _mm256_set1_ps(1.44269504088896341f);
  const __m256 ln2_hi = _mm256_set1_ps(0.693359375f);
  const __m256 ln2_lo = _mm256_set1_ps(-2.12194440e-4f);
  x = _mm256_max_ps(x, _mm256_set1_ps(-88.0f));
  const __m256 k = _mm256_round_ps(_mm256_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(k, ln2_hi, x);
  r = _mm256_fnmadd_ps(k, ln2_lo, r);
  __m256 p = _mm256_set1_ps(1.0f / 5040.0f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

inline float reduce_add8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

inline float reduce_max8(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

// Lanes [0, n) set (n clamped to [0, 8]): a mask for _mm256_maskload_ps and blends.
inline __m256i lane_mask8(int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::min<int64_t>(n, 8))),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

#endif  // TANDEM_AVX2

}  // namespace tandem_ops
