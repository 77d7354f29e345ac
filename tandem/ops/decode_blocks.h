// The steps of Tandem's paged decode kernel (paged_attention.cpp; see it for the design), each over
// the rows of one KV block and in a vector and a portable version: the scaled q.k scores, the
// online-softmax update, the weighted sum of V (float, or bf16 token pairs with dpbf16), and the
// per-thread scratch they work in. Everything here is inlined into the kernel's loops.
#pragma once

#include "decode_rows.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace tandem_ops {
namespace {

// =============================================================================================
// Per-block steps (each has a vector and a portable version)
// =============================================================================================

// scores[g][t] = scale * q_g . k_t for the n (<= block size) rows of one kv head in a block.
template <typename T, typename QT>
TANDEM_INLINE void block_scores(const QT* q, int64_t G, const T* k, int64_t row_stride, int64_t n, int64_t d,
                                float scale, float* scores, int64_t s_stride, Prefetcher& pf) {
#if defined(__AVX512F__)
  const __m512 sc = _mm512_set1_ps(scale);
  for (int64_t t0 = 0; t0 < n; t0 += 16) {
    const int64_t c = std::min<int64_t>(16, n - t0);
    [[maybe_unused]] __m512 ks;  // int8 rows: each token's scale, in its score's lane
    if constexpr (kInt8Rows<T>) {
      alignas(64) float scales[16] = {};
      for (int64_t t = 0; t < c; ++t) scales[t] = row_scale(k + (t0 + t) * row_stride, d);
      ks = _mm512_load_ps(scales);
    }
    for (int64_t g = 0; g < G; ++g) {
      __m512 acc[16];
#pragma GCC unroll 16
      for (int t = 0; t < 16; ++t)  // rows past n are not read (they may hold anything)
        acc[t] = t < c ? dot_lanes(q + g * d, k + (t0 + t) * row_stride, d) : _mm512_setzero_ps();
      __m512 s = _mm512_mul_ps(hsum16(acc), sc);
      if constexpr (kInt8Rows<T>) s = _mm512_mul_ps(s, ks);
      _mm512_storeu_ps(scores + g * s_stride + t0, s);
      pf.issue();
    }
  }
#elif defined(TANDEM_AVX2)
  const __m256 sc = _mm256_set1_ps(scale);
  for (int64_t t0 = 0; t0 < n; t0 += 8) {
    const int64_t c = std::min<int64_t>(8, n - t0);
    [[maybe_unused]] __m256 ks;  // int8 rows: each token's scale, in its score's lane
    if constexpr (kInt8Rows<T>) {
      alignas(32) float scales[8] = {};
      for (int64_t t = 0; t < c; ++t) scales[t] = row_scale(k + (t0 + t) * row_stride, d);
      ks = _mm256_load_ps(scales);
    }
    for (int64_t g = 0; g < G; ++g) {
      __m256 acc[8];
#pragma GCC unroll 8
      for (int t = 0; t < 8; ++t)  // rows past n are not read (they may hold anything)
        acc[t] = t < c ? dot_lanes8(q + g * d, k + (t0 + t) * row_stride, d) : _mm256_setzero_ps();
      __m256 s = _mm256_mul_ps(hsum8(acc), sc);
      if constexpr (kInt8Rows<T>) s = _mm256_mul_ps(s, ks);
      _mm256_storeu_ps(scores + g * s_stride + t0, s);  // lanes past n hold 0 (the store may overhang)
      pf.issue();
    }
  }
#else
  for (int64_t t = 0; t < n; ++t) {
    const T* kr = k + t * row_stride;
    const float ks = row_scale(kr, d);
    for (int64_t g = 0; g < G; ++g) {
      const QT* qg = q + g * d;
      float acc = 0.0f;
      for (int64_t i = 0; i < d; ++i) acc += static_cast<float>(qg[i]) * static_cast<float>(kr[i]);
      scores[g * s_stride + t] = kInt8Rows<T> ? acc * scale * ks : acc * scale;
    }
    pf.issue();
  }
#endif
}

// Online-softmax update of one head with the scores of one chunk (masked ones are -inf; the first
// chunk of a head must hold at least one unmasked score): rewrites the n scores as
// weights exp(s - m_new) (zero past n, up to the next multiple of 16) and returns the factor by
// which the head's accumulator must be rescaled.
TANDEM_INLINE float softmax_update(float* s, int64_t n, float& m, float& l) {
#if defined(__AVX512F__)
  __m512 vmax = _mm512_set1_ps(kNegInf);
  for (int64_t t = 0; t < n; t += 16)
    vmax = _mm512_mask_max_ps(vmax, lane_mask(n - t), vmax, _mm512_loadu_ps(s + t));
  const float m_new = std::max(m, _mm512_reduce_max_ps(vmax));
  const __m512 mv = _mm512_set1_ps(m_new);
  __m512 sum = _mm512_setzero_ps();
  const __m512 neg_inf = _mm512_set1_ps(kNegInf);
  for (int64_t t = 0; t < n; t += 16) {
    // A masked score (-inf, a causal prefill's future key) gets weight exactly 0.
    const __m512 sv = _mm512_loadu_ps(s + t);
    const __mmask16 live = lane_mask(n - t) & _mm512_cmp_ps_mask(sv, neg_inf, _CMP_NEQ_OQ);
    const __m512 p = _mm512_maskz_mov_ps(live, exp512(_mm512_sub_ps(sv, mv)));
    _mm512_storeu_ps(s + t, p);
    sum = _mm512_add_ps(sum, p);
  }
  const float total = _mm512_reduce_add_ps(sum);
#elif defined(TANDEM_AVX2)
  const __m256 neg_inf = _mm256_set1_ps(kNegInf);
  __m256 vmax = neg_inf;
  for (int64_t t = 0; t < n; t += 8)
    vmax = _mm256_max_ps(vmax, _mm256_blendv_ps(neg_inf, _mm256_loadu_ps(s + t),
                                                 _mm256_castsi256_ps(lane_mask8(n - t))));
  const float m_new = std::max(m, reduce_max8(vmax));
  const __m256 mv = _mm256_set1_ps(m_new);
  __m256 sum = _mm256_setzero_ps();
  for (int64_t t = 0; t < n; t += 8) {
    // A masked score (-inf, a causal prefill's future key) and lanes past n get weight exactly 0.
    const __m256 sv = _mm256_loadu_ps(s + t);
    const __m256 live = _mm256_and_ps(_mm256_castsi256_ps(lane_mask8(n - t)), _mm256_cmp_ps(sv, neg_inf, _CMP_NEQ_OQ));
    const __m256 p = _mm256_and_ps(live, exp256(_mm256_sub_ps(sv, mv)));
    _mm256_storeu_ps(s + t, p);
    sum = _mm256_add_ps(sum, p);
  }
  const float total = reduce_add8(sum);
#else
  float bm = kNegInf;
  for (int64_t t = 0; t < n; ++t) bm = std::max(bm, s[t]);
  const float m_new = std::max(m, bm);
  float total = 0.0f;
  for (int64_t t = 0; t < n; ++t) {
    s[t] = std::exp(s[t] - m_new);
    total += s[t];
  }
#endif
  // First chunk: m is -inf and the accumulator is still zero, so the factor does not matter.
  const float alpha = (m == kNegInf) ? 0.0f : std::exp(m - m_new);
  l = l * alpha + total;
  m = m_new;
  return alpha;
}

#if defined(__AVX512F__)
// acc[g] += sum_t p[g][t] * v[t] over the n rows of one block, for GB heads (compile-time, so the
// accumulators stay in registers). acc rows are `acc_stride` floats.
template <int GB, typename T>
TANDEM_INLINE void accumulate_v_f32(float* acc, int64_t acc_stride, const float* p, int64_t p_stride, const T* v,
                                    int64_t n, int64_t row_stride, int64_t d, Prefetcher& pf) {
  for (int64_t i = 0; i < d; i += 16) {
    __m512 a[GB];
    for (int g = 0; g < GB; ++g) a[g] = _mm512_loadu_ps(acc + g * acc_stride + i);
    for (int64_t t = 0; t < n; ++t) {
      const __m512 vv = load16(v + t * row_stride + i);
      if constexpr (kInt8Rows<T>) {  // p * s * q: the row's scale folded into its weight
        const float vs = row_scale(v + t * row_stride, d);
        for (int g = 0; g < GB; ++g) a[g] = _mm512_fmadd_ps(_mm512_set1_ps(p[g * p_stride + t] * vs), vv, a[g]);
      } else {
        for (int g = 0; g < GB; ++g) a[g] = _mm512_fmadd_ps(_mm512_set1_ps(p[g * p_stride + t]), vv, a[g]);
      }
    }
    for (int g = 0; g < GB; ++g) _mm512_storeu_ps(acc + g * acc_stride + i, a[g]);
    pf.issue();
  }
}
#endif

#if defined(TANDEM_AVX2)
// acc[g] += sum_t p[g][t] * v[t] over the n rows of one block, head by head, 64 dimensions (eight
// accumulators, half of AVX2's registers) at a time: a block's V rows stay in L1 for the next head.
template <typename T>
TANDEM_INLINE void accumulate_v_avx2(float* acc, int64_t acc_stride, const float* p, int64_t p_stride, const T* v,
                                     int64_t n, int64_t row_stride, int64_t G, int64_t d, Prefetcher& pf) {
  for (int64_t i0 = 0; i0 < d; i0 += 64) {
    const int64_t nv = std::min<int64_t>(64, d - i0) / 8;  // d is a multiple of 16
    for (int64_t g = 0; g < G; ++g) {
      float* ag = acc + g * acc_stride + i0;
      __m256 a[8];
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) a[j] = j < nv ? _mm256_loadu_ps(ag + 8 * j) : _mm256_setzero_ps();
      for (int64_t t = 0; t < n; ++t) {
        const T* vt = v + t * row_stride;
        float w = p[g * p_stride + t];
        if constexpr (kInt8Rows<T>) w *= row_scale(vt, d);  // p * s * q: the row's scale in its weight
        const __m256 pw = _mm256_set1_ps(w);
#pragma GCC unroll 8
        for (int j = 0; j < 8; ++j)
          if (j < nv) a[j] = _mm256_fmadd_ps(pw, load8(vt + i0 + 8 * j), a[j]);
      }
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j)
        if (j < nv) _mm256_storeu_ps(ag + 8 * j, a[j]);
      pf.issue();
    }
  }
}
#endif

#if defined(TANDEM_DPBF16)
// bf16 p.V with dpbf16 on token pairs (t, t+1): the V rows are interleaved 16 bits at a time, so
// each 32-bit lane holds (v[t][j], v[t+1][j]) and multiplies the broadcast pair (p[t], p[t+1]).
// unpacklo/hi work within 128-bit lanes, so for each 32-wide chunk of D the two accumulators hold
//   lo lane 4k+j -> dim 8k+j,   hi lane 4k+j -> dim 8k+4+j      (k = 0..3, j = 0..3)
// which unpermute_acc() turns back into natural order at the end of the item. pb holds p as bf16.
template <int GB>
TANDEM_INLINE void accumulate_v_pairs(float* acc, int64_t acc_stride, const uint16_t* pb, int64_t p_stride,
                                      const bf16* v, int64_t n, int64_t row_stride, int64_t d, Prefetcher& pf) {
  for (int64_t i = 0; i < d; i += 32) {
    const __mmask32 width = d - i >= 32 ? 0xFFFFFFFFu : 0xFFFFu;
    __m512 lo[GB], hi[GB];
    for (int g = 0; g < GB; ++g) {
      lo[g] = _mm512_loadu_ps(acc + g * acc_stride + i);
      hi[g] = _mm512_loadu_ps(acc + g * acc_stride + i + 16);
    }
    for (int64_t t = 0; t < n; t += 2) {
      const bool odd = t + 1 == n;
      const __m512i r0 = _mm512_maskz_loadu_epi16(width, v + t * row_stride + i);
      // An odd count's last token pairs with zeros (the next row may hold anything, even NaN) and
      // a zero weight (the next weight belongs to the next block).
      const __m512i r1 = odd ? _mm512_setzero_si512() : _mm512_maskz_loadu_epi16(width, v + (t + 1) * row_stride + i);
      const __m512bh vlo = (__m512bh)_mm512_unpacklo_epi16(r0, r1);
      const __m512bh vhi = (__m512bh)_mm512_unpackhi_epi16(r0, r1);
      for (int g = 0; g < GB; ++g) {
        uint32_t pair;
        std::memcpy(&pair, pb + g * p_stride + t, sizeof(pair));
        if (odd) pair &= 0xFFFFu;
        const __m512bh pp = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
        lo[g] = _mm512_dpbf16_ps(lo[g], pp, vlo);
        hi[g] = _mm512_dpbf16_ps(hi[g], pp, vhi);
      }
    }
    for (int g = 0; g < GB; ++g) {
      _mm512_storeu_ps(acc + g * acc_stride + i, lo[g]);
      _mm512_storeu_ps(acc + g * acc_stride + i + 16, hi[g]);
    }
    pf.issue();
  }
}

// Undo the lane order of accumulate_v_pairs for one head, in place (acc has round_up(d, 32) floats).
inline void unpermute_acc(float* acc, int64_t d) {
  const __m512i idx0 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i idx1 = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int64_t i = 0; i < d; i += 32) {
    const __m512 lo = _mm512_loadu_ps(acc + i), hi = _mm512_loadu_ps(acc + i + 16);
    _mm512_storeu_ps(acc + i, _mm512_permutex2var_ps(lo, idx0, hi));
    _mm512_storeu_ps(acc + i + 16, _mm512_permutex2var_ps(lo, idx1, hi));
  }
}
#endif

#if defined(__AVX512F__)
// Calls f(std::integral_constant<int, GB>, g0) for each chunk [g0, g0 + GB) of up to kHeadChunk of
// the G heads, so the register-blocked p.V versions get their head count at compile time.
template <typename F>
TANDEM_INLINE void for_head_chunks(int64_t G, F&& f) {
  for (int64_t g0 = 0; g0 < G; g0 += kHeadChunk) {
    switch (std::min<int64_t>(kHeadChunk, G - g0)) {
      case 1: f(std::integral_constant<int, 1>{}, g0); break;
      case 2: f(std::integral_constant<int, 2>{}, g0); break;
      case 3: f(std::integral_constant<int, 3>{}, g0); break;
      default: f(std::integral_constant<int, 4>{}, g0); break;
    }
  }
}
#endif

// p.V over one block for the G heads of one kv head; chunks of up to kHeadChunk heads go to the
// register-blocked versions above.
template <typename T>
TANDEM_INLINE void block_accumulate(float* acc, int64_t acc_stride, const float* p, [[maybe_unused]] const uint16_t* pb,
                                    int64_t p_stride, const T* v, int64_t n, int64_t row_stride, int64_t G,
                                    int64_t d, Prefetcher& pf) {
#if defined(__AVX512F__)
  if constexpr (kPairV<T>) {
#if defined(TANDEM_DPBF16)
    for_head_chunks(G, [&](auto gb, int64_t g0) {
      accumulate_v_pairs<decltype(gb)::value>(acc + g0 * acc_stride, acc_stride, pb + g0 * p_stride, p_stride, v, n,
                                              row_stride, d, pf);
    });
#endif
  } else {
    for_head_chunks(G, [&](auto gb, int64_t g0) {
      accumulate_v_f32<decltype(gb)::value>(acc + g0 * acc_stride, acc_stride, p + g0 * p_stride, p_stride, v, n,
                                            row_stride, d, pf);
    });
  }
#elif defined(TANDEM_AVX2)
  accumulate_v_avx2(acc, acc_stride, p, p_stride, v, n, row_stride, G, d, pf);
#else
  for (int64_t t = 0; t < n; ++t) {
    const T* vt = v + t * row_stride;
    for (int64_t g = 0; g < G; ++g) {
      float* ag = acc + g * acc_stride;
      const float pg = kInt8Rows<T> ? p[g * p_stride + t] * row_scale(vt, d) : p[g * p_stride + t];
      for (int64_t i = 0; i < d; ++i) ag[i] += pg * static_cast<float>(vt[i]);
    }
    pf.issue();
  }
#endif
}

// Scores as bf16 weights for the pair path (lanes past n are already zero).
TANDEM_INLINE void weights_to_bf16(const float* p, uint16_t* pb, int64_t n) {
#if defined(TANDEM_DPBF16)
  for (int64_t t = 0; t < n; t += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(pb + t), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(p + t)));
#else
  for (int64_t t = 0; t < n; ++t) pb[t] = c10::BFloat16(p[t]).x;
#endif
}

// =============================================================================================
// Per-thread scratch
// =============================================================================================
template <typename T>
struct Scratch {
  std::vector<typename QueryType<T>::type> q;  // [heads of the item, D]
  std::vector<float> scores;                   // [heads of the item, s_stride]: one chunk's scores
  std::vector<uint16_t> pb;                    // the same as bf16 weights (pair path)
  std::vector<float> acc, m, l;                // [heads of the item, acc_stride], [heads], [heads]
  int64_t s_stride, acc_stride;
  Scratch(int64_t h, int64_t d, int64_t chunk_tokens)
      : q(h * d),
        scores(h * round_up(chunk_tokens + 16, 16), 0.0f),
        pb(h * round_up(chunk_tokens + 16, 16) + 2, 0),
        acc(h * round_up(d, 32)),
        m(h),
        l(h),
        s_stride(round_up(chunk_tokens + 16, 16)),  // +16: a block's 16-wide score store may overhang
        acc_stride(round_up(d, 32)) {}
};

// Blocks per chunk: the softmax max/sum bookkeeping runs once per chunk rather than per block.
inline int64_t chunk_blocks(int64_t bs) { return std::max<int64_t>(1, kChunkTokens / bs); }

}  // namespace
}  // namespace tandem_ops
