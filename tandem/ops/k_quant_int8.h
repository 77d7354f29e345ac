// The K-quants' int8-activation arithmetic shared by their kernels (quant_linear_k8.cpp: decode tiles
// and the entry point; quant_linear_k8_panel.cpp: prompts' panels): x quantized per 256 (ggml's Q8_K),
// a block's scales, its chunks as unsigned bytes, and each output's float steps (Outputs), so that every
// path gives an output the same value.
#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "gguf_blocks.h"
#include "int8_blocks.h"

namespace tandem_ops {
namespace k8 {

using namespace gguf;

constexpr int64_t kSuper = 256;

// x's rows quantized per 256: int8 values, a scale per block, and the sums of each 16 values.
struct Q8K {
  std::vector<int8_t> q;
  std::vector<float> d;          // [rows, blocks]
  std::vector<float> d_by_block;  // [blocks, rows]: a tile's rows' scales in one load
  std::vector<int16_t> bsum16;  // [rows, blocks, 16]
  int64_t nb = 0;
};

inline Q8K quantize_rows(const at::Tensor& x) {
  const int64_t K = x.size(1);
  Q8K r;
  r.nb = K / kSuper;
  r.q.resize(x.size(0) * K);
  r.d.resize(x.size(0) * r.nb);
  r.d_by_block.resize(x.size(0) * r.nb);
  r.bsum16.resize(x.size(0) * r.nb * 16);
  int8_blocks::for_each_row(x, [&](const auto* row, int64_t m) {
    for (int64_t b = m * r.nb; b < (m + 1) * r.nb; ++b) {
      int8_t* q = r.q.data() + b * kSuper;
      r.d[b] = int8_blocks::quantize_block(row + (b - m * r.nb) * kSuper, kSuper, q);
      r.d_by_block[(b - m * r.nb) * x.size(0) + m] = r.d[b];
      for (int64_t g = 0; g < 16; ++g) {
        int32_t sum = 0;
        for (int64_t i = 16 * g; i < 16 * g + 16; ++i) sum += q[i];
        r.bsum16[b * 16 + g] = static_cast<int16_t>(sum);
      }
    }
  });
  return r;
}

// A block's integer sub-block scales (and, for Q4_K and Q5_K, mins) and its float multipliers.
template <int64_t QT>
struct KScales {
  int16_t sc[16];   // Q4_K, Q5_K: per sub-block of 32 (8 used); Q6_K: per group of 16
  int16_t min[8];   // Q4_K, Q5_K
  float d, dmin;
};

template <int64_t QT>
inline KScales<QT> k_scales(const uint8_t* b) {
  KScales<QT> s;
  if constexpr (QT == kQ6_K) {
    for (int g = 0; g < 16; ++g) s.sc[g] = static_cast<int8_t>(b[192 + g]);
    s.d = half_at(b + 208);
    s.dmin = 0.0f;
  } else {
    uint8_t sm[16];  // the eight scales, then the eight mins
    k_scales_mins(b + 4, sm, sm + 8);
#if defined(TANDEM_QUANT_AVX2)
    const __m256i wide = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sm)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(s.sc), _mm256_castsi256_si128(wide));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(s.min), _mm256_extracti128_si256(wide, 1));
#else
    for (int j = 0; j < 8; ++j) s.sc[j] = sm[j], s.min[j] = sm[8 + j];
#endif
    s.d = half_at(b);
    s.dmin = half_at(b + 2);
  }
  return s;
}

// The offset term's float factor before x's scale: dmin, or for Q6_K 32 d (its quants' -32).
template <int64_t QT>
inline float offset_factor(const KScales<QT>& s) {
  return QT == kQ6_K ? 32.0f * s.d : s.dmin;
}

#if defined(TANDEM_QUANT_AVX2)
// Chunk c's 32 quants as unsigned bytes (Q6_K's without the -32, which the bsums carry).
template <int64_t QT>
inline __m256i unsigned_quants(const uint8_t* b, int c) {
  if constexpr (QT == kQ6_K) return _mm256_add_epi8(chunk_quants<QT>(b, c), _mm256_set1_epi8(32));
  return chunk_quants<QT>(b, c);
}

// The int16 multipliers of a chunk's 16 pair sums: its scale (Q4_K, Q5_K), or its two groups' (Q6_K:
// pair sums 0-7 are weights 0-15).
template <int64_t QT>
inline __m256i chunk_scales(const KScales<QT>& s, int c) {
  if constexpr (QT == kQ6_K) return _mm256_set_m128i(_mm_set1_epi16(s.sc[2 * c + 1]), _mm_set1_epi16(s.sc[2 * c]));
  return _mm256_set1_epi16(s.sc[c]);
}

// acc + the pair sums p times the scales s, pairwise added (vpmaddwd then vpaddd, or one vpdpwssd with
// VNNI: the same exact integers).
inline __m256i dot_add(__m256i acc, __m256i p, __m256i s) {
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
  return _mm256_dpwssd_epi32(acc, p, s);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(p, s));
#endif
}

// The multipliers of x's 16 group sums in the offset term, once per block: Q4_K, Q5_K: each sub-block's
// min, for both of its groups of 16; Q6_K: each group's scale (the 32 is in the term's float factor).
template <int64_t QT>
inline __m256i offset_weights(const KScales<QT>& s) {
  if constexpr (QT == kQ6_K) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s.sc));
  const __m128i m8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s.min));
  return _mm256_set_m128i(_mm_unpackhi_epi16(m8, m8), _mm_unpacklo_epi16(m8, m8));
}

// Each output's float steps, one lane per output: acc += (d * dx) * float(its block's integer sum) and
// off += (f * dx) * float(its offset sum), one fused multiply-add each per block in block order, then
// y = acc - off. Tiles and panels run them the same way, so an output's value is one whatever the path.
struct Outputs {
  __m256 acc = _mm256_setzero_ps(), off = _mm256_setzero_ps();
  void add(__m256 d_dx, __m256i sums, __m256 f_dx, __m256i offsets) {
    acc = _mm256_fmadd_ps(d_dx, _mm256_cvtepi32_ps(sums), acc);
    off = _mm256_fmadd_ps(f_dx, _mm256_cvtepi32_ps(offsets), off);
  }
  void values(float r[8]) const { _mm256_storeu_ps(r, _mm256_sub_ps(acc, off)); }
  // Lanes 0 .. n to y, stride apart.
  void store(float* y, int64_t stride, int n) const {
    float r[8];
    values(r);
    for (int i = 0; i < n; ++i) y[i * stride] = r[i];
  }
};

// From this many rows, each weight row is decoded once per call into a panel (quant_linear_k8_panel.cpp).
constexpr int64_t kPanelFrom = 4;

// x's quantized rows times the K-quant blocks of w (qtype), through panels: y [M, N].
void panel_rows(int64_t qtype, const uint8_t* w, int64_t row_bytes, const Q8K& a, int64_t M, int64_t K, int64_t N,
                float* y);
#endif

}  // namespace k8
}  // namespace tandem_ops
