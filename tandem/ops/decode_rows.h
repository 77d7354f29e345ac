// The decode kernel's low-level pieces (paged_attention.cpp): its tunables, how an int8 KV row is
// read (its values and, after them, its scale), the AVX512 q.k dot products and their horizontal
// sums, the type the query is held in, and the software prefetcher that spreads a block's loads
// over the computation. decode_blocks.h builds the per-block steps from them.
#pragma once

#include "attention_common.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

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

// A pool of int8 rows (their values, then kScaleBytes of scale) rather than of values.
template <typename KV>
constexpr bool kInt8Rows = std::is_same_v<KV, int8_t>;

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

#if defined(TANDEM_AVX2)
// Lane t of the result is the horizontal sum of v[t] (8 vectors of 8): pairwise adds within 128-bit
// halves, then the halves folded.
inline __m256 hsum8(const __m256 (&v)[8]) {
  const __m256 a0 = _mm256_hadd_ps(v[0], v[1]), a1 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 a2 = _mm256_hadd_ps(v[4], v[5]), a3 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 b0 = _mm256_hadd_ps(a0, a1), b1 = _mm256_hadd_ps(a2, a3);  // [v0..v3 | v0..v3], [v4..v7 | v4..v7]
  return _mm256_add_ps(_mm256_permute2f128_ps(b0, b1, 0x20), _mm256_permute2f128_ps(b0, b1, 0x31));
}

// Unreduced q.k: a vector whose lanes sum to the dot product (d a multiple of 8).
template <typename T>
TANDEM_INLINE __m256 dot_lanes8(const float* q, const T* k, int64_t d) {
  __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(q), load8(k));
  for (int64_t i = 8; i < d; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), load8(k + i), acc);
  return acc;
}
#endif  // TANDEM_AVX2

// Tokens whose q.k scores block_scores computes together (one vector of them).
#if defined(__AVX512F__)
constexpr int64_t kScoreLanes = 16;
#elif defined(TANDEM_AVX2)
constexpr int64_t kScoreLanes = 8;
#else
constexpr int64_t kScoreLanes = 1;
#endif

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

}  // namespace
}  // namespace tandem_ops
