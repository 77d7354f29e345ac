// Building blocks of Tandem's paged attention kernels (decode and prefill): per-block q.k scores,
// the online-softmax update, the weighted sum of V, software prefetch, and per-thread scratch.
// See paged_attention.cpp for the design; everything here is inlined into the kernels' loops.
#pragma once

#include <ATen/ATen.h>

#include "simd.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#ifndef TANDEM_CHUNK_TOKENS
#define TANDEM_CHUNK_TOKENS 256
#endif
#ifndef TANDEM_PF_LOCALITY
#define TANDEM_PF_LOCALITY 2
#endif
#ifndef TANDEM_PREFETCH_AHEAD
#define TANDEM_PREFETCH_AHEAD 2
#endif


namespace tandem_ops {
namespace {


constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// Query heads whose accumulators are held in registers at once (the group is walked in chunks).
constexpr int kHeadChunk = 4;
// Tokens per softmax chunk (rounded down to whole blocks).
constexpr int64_t kChunkTokens = TANDEM_CHUNK_TOKENS;
// How many block-steps (one block's K or V rows) the prefetch cursor runs ahead.
constexpr int64_t kPrefetchAhead = TANDEM_PREFETCH_AHEAD;

// p.V on bf16 pairs of tokens (dpbf16) is used for bf16 caches when the ISA has it.
template <typename T>
constexpr bool kPairV =
#if defined(TANDEM_DPBF16)
    std::is_same_v<T, bf16>;
#else
    false;
#endif

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// int8 KV rows (tandem/kv/layout.py): d int8 values, then the row's float32 scale.
template <typename KV>
constexpr bool kInt8Rows = std::is_same_v<KV, int8_t>;
constexpr int64_t kScaleBytes = 4;

// Elements from one kv head's row of a token to the next head's: d, plus the scale for int8 rows.
template <typename KV>
constexpr int64_t head_stride(int64_t d) {
  return kInt8Rows<KV> ? d + kScaleBytes : d;
}

// The scale of an int8 row (1 for rows held as values).
template <typename KV>
TANDEM_INLINE float row_scale([[maybe_unused]] const KV* row, [[maybe_unused]] int64_t d) {
  if constexpr (kInt8Rows<KV>) {
    float s;
    std::memcpy(&s, row + d, sizeof(s));
    return s;
  }
  return 1.0f;
}

// =============================================================================================
// AVX512 building blocks
// =============================================================================================
#if defined(__AVX512F__)

// Lane t of the result is the horizontal sum of v[t]: a transpose-and-add tree, ~3 instructions
// per input vector instead of ~8 for separate reductions.
inline __m512 hsum16(const __m512 (&v)[16]) {
  __m512 a[8];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [v0:0+2, v1:0+2, v0:1+3, v1:1+3]
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  __m512 b[4];
  for (int i = 0; i < 4; ++i)  // per 128-bit lane: the lane's sum for 4 consecutive vectors
    b[i] = _mm512_add_ps(_mm512_shuffle_ps(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  __m512 c[2];
  for (int i = 0; i < 2; ++i)  // fold 128-bit lanes 2,3 onto 0,1
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// Unreduced q.k: a vector whose lanes sum to the dot product.
template <typename T>
TANDEM_INLINE __m512 dot_lanes(const float* q, const T* k, int64_t d) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < d; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + i), load16(k + i), acc);
  return acc;
}

#if defined(TANDEM_DPBF16)
TANDEM_INLINE __m512 dot_lanes(const bf16* q, const bf16* k, int64_t d) {
  // dpbf16 multiplies bf16 pairs and accumulates in float: 32 products per instruction.
  __m512 acc = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= d; i += 32)
    acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(q + i), (__m512bh)_mm512_loadu_si512(k + i));
  if (i < d)  // d is a multiple of 16: one half-width tail with zeroed upper lanes
    acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_maskz_loadu_epi16(0xFFFFu, q + i),
                           (__m512bh)_mm512_maskz_loadu_epi16(0xFFFFu, k + i));
  return acc;
}
#endif

#endif  // __AVX512F__

// The query operand is kept as float, except on the AVX512-BF16 path where the bf16 query feeds
// dpbf16 directly.
template <typename T>
struct QueryType {
  using type = float;
};
#if defined(TANDEM_DPBF16)
template <>
struct QueryType<bf16> {
  using type = bf16;
};
#endif

// =============================================================================================
// Per-block steps (each has a vector and a portable version)
// =============================================================================================

// Software prefetch of one region (rows of a block) spread over the computation: the kernel hands
// it the region needed a few steps ahead and calls issue() between pieces of work, so each call
// requests a few cache lines. A burst of prefetches would fill the miss buffers and stall the very
// computation it should overlap. Prefetches go to L2 (T1), which measured best.
struct Prefetcher {
  const char* base = nullptr;
  int64_t stride = 0, width = 0, rows = 0, row = 0, col = 0, quota = 0;

  // Region: `rows` rows of `width` bytes, `stride` bytes apart, spread over ~`calls` issue() calls.
  TANDEM_INLINE void set(const void* b, int64_t n_rows, int64_t stride_bytes, int64_t width_bytes, int64_t calls) {
    flush();
    base = static_cast<const char*>(b);
    rows = n_rows;
    row = col = 0;
    if (width_bytes == stride_bytes) {  // contiguous rows: one range
      width = width_bytes * n_rows;
      rows = n_rows > 0 ? 1 : 0;
    } else {
      width = width_bytes;
    }
    stride = stride_bytes;
    const int64_t lines = rows * ((width + 63) / 64);
    quota = std::max<int64_t>(1, (lines + calls - 1) / std::max<int64_t>(1, calls));
  }
  TANDEM_INLINE void issue() { issue_n(quota); }
  TANDEM_INLINE void flush() { issue_n(std::numeric_limits<int64_t>::max()); }
  TANDEM_INLINE void issue_n(int64_t lines) {
    for (; lines > 0 && row < rows; --lines) {
      __builtin_prefetch(base + row * stride + col, 0, TANDEM_PF_LOCALITY);
      col += 64;
      if (col >= width) {
        col = 0;
        ++row;
      }
    }
  }
};

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


// q as the kernels read it: token rows may be any distance apart (a view of a fused qkv
// projection is used in place), but each row's heads must be packed; anything else is copied.
inline at::Tensor packed_rows(const at::Tensor& q) {
  return q.stride(2) == 1 && q.stride(1) == q.size(2) ? q : q.contiguous();
}

// The checks the decode and prefill ops share: q [T, H, D], the K/V pool, int32 block tables of
// one row per sequence, and the output buffer the kernels write rows of ([T, H, D] like q, contiguous).
inline void check_attention_inputs(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                   const at::Tensor& block_tables, int64_t n_seqs, const at::Tensor& out,
                                   const char* op, bool int8_rows_ok = false) {
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu(), op,
              ": CPU tensors expected");
  TORCH_CHECK(q.dim() == 3, op, ": q must be [tokens, H, D]");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), op,
              ": k_cache/v_cache must both be [num_blocks, block_size, KVH, D]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), op, ": k_cache/v_cache must be contiguous");
  const bool int8_rows = int8_rows_ok && k_cache.scalar_type() == at::kChar;
  TORCH_CHECK((int8_rows || q.scalar_type() == k_cache.scalar_type()) && v_cache.scalar_type() == k_cache.scalar_type(),
              op, ": k_cache and v_cache must share q's dtype", int8_rows_ok ? " (or be int8 rows)" : "");
  const int64_t H = q.size(1), D = q.size(2), KVH = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == (int8_rows ? D + kScaleBytes : D) && D % 16 == 0 && D > 0, op,
              ": head_dim must match and be a multiple of 16 (int8 rows: head_dim + 4 bytes)");
  TORCH_CHECK(KVH > 0 && H % KVH == 0, op, ": num heads must be a multiple of num kv heads");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 && block_tables.size(0) == n_seqs,
              op, ": block_tables must be int32 [num sequences, max_blocks]");
  TORCH_CHECK(out.sizes() == q.sizes() && out.scalar_type() == q.scalar_type() && out.is_contiguous() &&
                  out.device() == q.device(),
              op, ": out must be a contiguous tensor of q's shape and dtype");
}

// Fills the fields that the decode and prefill kernels' parameter structs share (same names).
// The first key a query at position len - 1 sees: its last `window` keys (0: all of them).
TANDEM_INLINE int64_t window_start(int64_t len, int64_t window) {
  return window > 0 ? std::max<int64_t>(0, len - window) : 0;
}

#if defined(__AVX512F__)
// soft_cap_scores for 16 scores: tanh(y) = sign(y) (1 - e) / (1 + e) with e = exp(-2 |y|), which
// never overflows.
TANDEM_INLINE __m512 soft_cap16(__m512 x, float cap) {
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512 y = _mm512_div_ps(x, _mm512_set1_ps(cap));
  const __m512 e = exp512(_mm512_mul_ps(_mm512_abs_ps(y), _mm512_set1_ps(-2.0f)));
  const __m512 t = _mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e));
  const __m512i sign = _mm512_and_si512(_mm512_castps_si512(y), _mm512_set1_epi32(static_cast<int>(0x80000000u)));
  return _mm512_mul_ps(_mm512_set1_ps(cap), _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(t), sign)));
}
#endif

// Gemma-style logit soft-capping of already-scaled scores: cap * tanh(s / cap) (cap > 0).
TANDEM_INLINE void soft_cap_scores(float* s, int64_t n, float cap) {
  for (int64_t t = 0; t < n; ++t) s[t] = cap * std::tanh(s[t] / cap);
}

template <typename Params>
void fill_common_params(Params& P, const at::Tensor& q, const at::Tensor& out, const at::Tensor& k_cache,
                        const at::Tensor& v_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                        double scale, int64_t window, double softcap) {
  TORCH_CHECK(window >= 0, "attention: window must be >= 0 (0: none)");
  TORCH_CHECK(softcap >= 0.0, "attention: softcap must be >= 0 (0: none)");
  P.window = window;
  P.softcap = static_cast<float>(softcap);
  P.q = q.data_ptr();
  P.q_stride = q.stride(0);
  P.k = k_cache.data_ptr();
  P.v = v_cache.data_ptr();
  P.out = out.data_ptr();
  P.block_tables = block_tables.data_ptr<int32_t>();
  P.seq_lens = seq_lens.data_ptr<int32_t>();
  P.max_blocks = block_tables.size(1);
  P.bs = k_cache.size(1);
  P.kvh = k_cache.size(2);
  P.heads = q.size(1);
  P.group = q.size(1) / k_cache.size(2);
  P.d = q.size(2);
  P.scale = static_cast<float>(scale);
}

}  // namespace
}  // namespace tandem_ops
