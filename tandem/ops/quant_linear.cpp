// Linear layers on GGUF block-quantized weights read as stored, activations kept in float:
// y = x W^T (+ b) with W in Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K or Q6_K blocks (gguf_blocks.h).
//
// A decode step reads every weight once, so the bytes of W are its cost: Q4_K holds 256 weights in 144
// bytes (4.5 bits a weight) where float32 takes 1,024. Each weight is w = d * q + m (a scale and min per
// 32 weights, or per 16 for Q6_K's scales), and a row's product is computed as
//   sum over chunks of d * (q . x)  +  sum over chunks of m * (the chunk's sum of x)
// the quants converted to float and met by x in FMAs, the scale applied once per chunk and row, and
// the mins once per chunk against x's chunk sums (taken once per call): no weight is ever scaled in
// registers, which cut a one-row call's time by 12-20% on AVX2 (Zen 3) against dequantizing each
// chunk (d * q + m per weight, then an FMA per vector) at the same bytes. The result is F.linear(x,
// dequantized W) up to float32 rounding of sums in another order, with no activation rounding for a
// kernel's one-ulp differences upstream to amplify (the int8-activation path, quant_linear_q8.cpp,
// has that hazard).
//
// Each output's sums run in one order whatever the batch and the threads (K in chunks of 32, the
// scales and mins in chunk order): a request's tokens get bit-identical values in a prompt chunk and
// in a decode batch of any size.
//
// Tiles of NR weight rows x MR activation rows keep MR * NR accumulators (per scale) in registers; a
// weight chunk is converted once per tile and used by every row of it (a block's scales once per
// block), and W streams from memory once per call (prefetched a few tiles ahead). Threads split the
// weight rows.
//
// gguf_dequantize (float32 [N, K], exactly as gguf-py writes it) lets a caller with many rows use one
// GEMM instead (tandem/model/quant.py chooses).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

#include "gguf_blocks.h"
#include "quant_linear_x16.h"

namespace tandem_ops {
namespace {

using namespace gguf;

#if defined(__AVX512F__)
// A chunk's 32 weights as two vectors of 16 (weights 0-15, 16-31: the halves of its scales).
constexpr int kParts = 2;
using Vec = __m512;
using Ints = __m512i;  // a vector's lanes as int32
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float vsum(Vec a, Vec b) { return _mm512_reduce_add_ps(_mm512_add_ps(a, b)); }
inline Vec vset1(float f) { return _mm512_set1_ps(f); }
inline Vec vmul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec vadd(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline float vsum1(Vec a) { return _mm512_reduce_add_ps(a); }
inline Vec ifloat(Ints a) { return _mm512_cvtepi32_ps(a); }
// A vector's worth of bytes, each widened to an int32 lane (signed or not).
inline Ints iwiden(const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline Ints iwiden_signed(const uint8_t* p) {
  return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
// Vector p of a chunk's 32 signed bytes in a register, widened.
inline Ints signed_lanes(__m256i q, int p) {
  return _mm512_cvtepi8_epi32(p ? _mm256_extracti128_si256(q, 1) : _mm256_castsi256_si128(q));
}
inline Ints iand(Ints a, int m) { return _mm512_and_si512(a, _mm512_set1_epi32(m)); }
inline Ints ior(Ints a, Ints b) { return _mm512_or_si512(a, b); }
inline Ints isrl(Ints a, int n) { return _mm512_srl_epi32(a, _mm_cvtsi32_si128(n)); }
inline Ints isll(Ints a, int n) { return _mm512_sll_epi32(a, _mm_cvtsi32_si128(n)); }
// Bit (first + lane) of word, in each lane.
inline Ints ibits(uint32_t word, int first) {
  const Ints lanes = _mm512_add_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                      _mm512_set1_epi32(first));
  return iand(_mm512_srlv_epi32(_mm512_set1_epi32(static_cast<int>(word)), lanes), 1);
}
#elif defined(TANDEM_QUANT_AVX2)
// A chunk's 32 weights as four vectors of 8 (two per half of its scales).
constexpr int kParts = 4;
using Vec = __m256;
using Ints = __m256i;
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float vsum(Vec a, Vec b) {
  const __m256 v = _mm256_add_ps(a, b);
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline Vec vset1(float f) { return _mm256_set1_ps(f); }
inline Vec vmul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline Vec vadd(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline float vsum1(Vec a) { return vsum(a, vzero()); }
inline Vec ifloat(Ints a) { return _mm256_cvtepi32_ps(a); }
inline Ints iwiden(const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
inline Ints iwiden_signed(const uint8_t* p) {
  return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
inline Ints signed_lanes(__m256i q, int p) {
  const __m128i half = p / 2 ? _mm256_extracti128_si256(q, 1) : _mm256_castsi256_si128(q);
  return _mm256_cvtepi8_epi32(p % 2 ? _mm_srli_si128(half, 8) : half);
}
inline Ints iand(Ints a, int m) { return _mm256_and_si256(a, _mm256_set1_epi32(m)); }
inline Ints ior(Ints a, Ints b) { return _mm256_or_si256(a, b); }
inline Ints isrl(Ints a, int n) { return _mm256_srl_epi32(a, _mm_cvtsi32_si128(n)); }
inline Ints isll(Ints a, int n) { return _mm256_sll_epi32(a, _mm_cvtsi32_si128(n)); }
inline Ints ibits(uint32_t word, int first) {
  const Ints lanes = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(first));
  return iand(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(word)), lanes), 1);
}
#endif

#if defined(__AVX512F__) || defined(TANDEM_QUANT_AVX2)
constexpr int kLanes = kChunk / kParts;

// A chunk's 32 quants as floats, before its scales, exactly chunk_quant's values. Most formats widen
// each vector's bytes to int32 lanes first and pick the bits out there with masks and shifts: the
// byte shuffles of unpacking nibbles in bytes (chunk_quants) had bound the one-row kernel on AVX2
// (Q4_1 36% and Q8_0 28% faster without them on a Zen 3). Q6_K, whose quants come from two places
// each, and MXFP4's table keep the byte path: Q6_K ran 20% slower the other way.
template <int64_t QT>
inline void chunk_floats(const uint8_t* b, int c, Vec (&v)[kParts]) {
  if constexpr (QT == kQ6_K || QT == kMXFP4) {
    const __m256i q = chunk_quants<QT>(b, c);
    for (int p = 0; p < kParts; ++p) v[p] = ifloat(signed_lanes(q, p));
    return;
  }
  for (int p = 0; p < kParts; ++p) {
    const int k = p * kLanes;  // the vector's first weight in the chunk
    Ints q;
    if constexpr (QT == kQ8_0) {
      q = iwiden_signed(b + 2 + k);
    } else if constexpr (QT == kQ4_0 || QT == kQ4_1 || QT == kQ5_0) {
      // 16 bytes of nibbles: byte k holds weight k (low) and k + 16 (high).
      const uint8_t* qs = b + (QT == kQ4_0 ? 2 : QT == kQ4_1 ? 4 : 6);
      const Ints bytes = iwiden(qs + k % 16);
      q = k < 16 ? iand(bytes, 0x0F) : isrl(bytes, 4);
      if constexpr (QT == kQ5_0) {  // bit k of the 32-bit word at b + 2 is weight k's fifth
        uint32_t high;
        std::memcpy(&high, b + 2, 4);
        q = ior(q, isll(ibits(high, k), 4));
      }
    } else {  // Q4_K, Q5_K: chunk pairs share 32 bytes of nibbles (the even chunk the low ones)
      const Ints bytes = iwiden(b + (QT == kQ4_K ? 16 : 48) + 32 * (c / 2) + k);
      q = c % 2 ? isrl(bytes, 4) : iand(bytes, 0x0F);
      if constexpr (QT == kQ5_K) q = ior(q, isll(iand(isrl(iwiden(b + 16 + k), c), 1), 4));  // bit c of byte k
    }
    v[p] = ifloat(q);
  }
}
#endif

#if defined(__AVX512F__) || defined(TANDEM_QUANT_AVX2)
constexpr int kHalf = kParts / 2;  // vectors per half chunk (16 weights: one scale and min)

// A chunk's weights exactly as gguf_dequantize writes them: d * q, then + m (two roundings).
template <int64_t QT>
inline void chunk_weights(const uint8_t* b, const Scales<QT>& s, int c, Vec (&v)[kParts]) {
  chunk_floats<QT>(b, c, v);
  for (int p = 0; p < kParts; ++p)
    v[p] = vadd(vmul(vset1(s.d[c][p / kHalf]), v[p]), vset1(s.m[c][p / kHalf]));
}
#endif

#if defined(__AVX512F__) || defined(TANDEM_QUANT_AVX2)
// Formats whose weights have a min (w = d * q + m, m != 0): Q4_0 and Q5_0 (their centring offsets),
// Q4_1, Q4_K, Q5_K. One min per 32 weights in all of them.
template <int64_t QT>
constexpr bool kHasMin = !kSignedQuants<QT>;
// Products summed per scale: a chunk's 32, or each half's 16 (Q6_K's scale per 16 weights).
template <int64_t QT>
constexpr int kSums = kHalfScales<QT> ? 2 : 1;

// out[i][j] = row (m0 + i) of x . weight row (n0 + j), for MR rows and NR weight rows, as
//   sum over chunks of d * (q . x) (one vector of partial sums per output and scale), plus
//   sum over chunks of m * (the chunk's sum of x, xsum) (a float per output)
// the same products as (d * q + m) . x, with the weights never scaled in registers: per chunk and
// row that is one FMA per 8 or 16 weights and one per scale, against a dequantization per weight
// row's chunk plus an FMA per vector before.
template <int64_t QT, int MR, int NR>
void tile(const uint8_t* w, int64_t row_bytes, const float* x, const float* xsum, int64_t K, int64_t m0,
          int64_t n0, float* y, int64_t N) {
  constexpr int64_t bb = kBlockBytes<QT>, bw = kBlockWeights<QT>;
  constexpr int sums = kSums<QT>, per_sum = kParts / kSums<QT>;
  const int64_t chunks = K / kChunk;
  Vec acc[MR][NR][sums];
  float off[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) {
      for (int h = 0; h < sums; ++h) acc[i][j][h] = vzero();
      off[i][j] = 0.0f;
    }
  const uint8_t* ahead = w + (n0 + kPrefetchTiles * NR) * row_bytes;
  for (int64_t b = 0; b < K / bw; ++b) {
    for (int l = 0; l < kPrefetchLines<QT, NR>; ++l)
      _mm_prefetch(reinterpret_cast<const char*>(ahead + b * NR * bb + 64 * l), _MM_HINT_T0);
    for (int j = 0; j < NR; ++j) {
      const uint8_t* block = w + (n0 + j) * row_bytes + b * bb;
      const Scales<QT> s = block_scales<QT>(block);
      for (int c = 0; c < kChunks<QT>; ++c) {
        Vec q[kParts];
        chunk_floats<QT>(block, c, q);
        Vec d[sums];
        for (int h = 0; h < sums; ++h) d[h] = vset1(s.d[c][h]);
        for (int i = 0; i < MR; ++i) {
          const float* xc = x + (m0 + i) * K + b * bw + c * kChunk;
          for (int h = 0; h < sums; ++h) {
            Vec t = vmul(q[h * per_sum], vload(xc + h * per_sum * kLanes));
            for (int p = 1; p < per_sum; ++p) t = vfma(q[h * per_sum + p], vload(xc + (h * per_sum + p) * kLanes), t);
            acc[i][j][h] = vfma(d[h], t, acc[i][j][h]);
          }
          if constexpr (kHasMin<QT>) off[i][j] += s.m[c][0] * xsum[(m0 + i) * chunks + b * kChunks<QT> + c];
        }
      }
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) {
      const float dot = sums == 2 ? vsum(acc[i][j][0], acc[i][j][sums - 1]) : vsum1(acc[i][j][0]);
      y[(m0 + i) * N + n0 + j] = dot + off[i][j];
    }
}

// Each chunk's sum of x, per row: what a min multiplies (in one order whatever the batch).
std::vector<float> chunk_sums(const float* x, int64_t M, int64_t K) {
  std::vector<float> out(static_cast<size_t>(M * (K / kChunk)));
  for (int64_t r = 0; r < M; ++r)
    for (int64_t c = 0; c < K / kChunk; ++c) {
      const float* xc = x + r * K + c * kChunk;
      Vec v = vload(xc);
      for (int p = 1; p < kParts; ++p) v = vadd(v, vload(xc + p * kLanes));
      out[r * (K / kChunk) + c] = vsum1(v);
    }
  return out;
}
#else
// Portable: the same products, one output at a time.
template <int64_t QT, int MR, int NR>
void tile(const uint8_t* w, int64_t row_bytes, const float* x, const float* /*xsum*/, int64_t K, int64_t m0,
          int64_t n0, float* y, int64_t N) {
  constexpr int64_t bb = kBlockBytes<QT>, bw = kBlockWeights<QT>;
  for (int i = 0; i < MR; ++i) {
    const float* xr = x + (m0 + i) * K;
    for (int j = 0; j < NR; ++j) {
      float total = 0.0f;
      for (int64_t b = 0; b < K / bw; ++b) {
        const uint8_t* block = w + (n0 + j) * row_bytes + b * bb;
        const Scales<QT> s = block_scales<QT>(block);
        for (int c = 0; c < kChunks<QT>; ++c)
          for (int64_t k = 0; k < kChunk; ++k) {
            const float wk = s.d[c][k / 16] * static_cast<float>(chunk_quant<QT>(block, c, k)) + s.m[c][k / 16];
            total += wk * xr[b * bw + c * kChunk + k];
          }
      }
      y[(m0 + i) * N + n0 + j] = total;
    }
  }
}

std::vector<float> chunk_sums(const float* /*x*/, int64_t /*M*/, int64_t /*K*/) { return {}; }
#endif

template <int64_t QT>
void linear_rows(const uint8_t* w, int64_t row_bytes, const float* x, int64_t M, int64_t K, int64_t N, float* y) {
  const std::vector<float> xsum = chunk_sums(x, M, K);
  for_each_tile<!kHalfScales<QT>>(M, N, [&](auto mr, auto nr, int64_t m0, int64_t n0) {
    tile<QT, decltype(mr)::value, decltype(nr)::value>(w, row_bytes, x, xsum.data(), K, m0, n0, y, N);
  });
}

at::Tensor gguf_linear(const at::Tensor& x_in, const at::Tensor& w, int64_t qtype, int64_t in_features,
                       const std::optional<at::Tensor>& bias) {
  check_weight(w, qtype, in_features, "gguf_linear");
  check_activations(x_in, in_features, "gguf_linear");
  const at::Tensor x = x_in.reshape({-1, in_features}).to(at::kFloat).contiguous();
  const int64_t M = x.size(0), K = in_features, N = w.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M > 0) {
    const uint8_t* wp = w.data_ptr<uint8_t>();
    const float* xp = x.data_ptr<float>();
    float* yp = y.data_ptr<float>();
    with_format(qtype, "gguf_linear", [&](auto qt) { linear_rows<decltype(qt)::value>(wp, w.size(1), xp, M, K, N, yp); });
  }
  return finish_output(y, x_in, bias);
}

template <int64_t QT>
void dequantize_rows(const uint8_t* w, int64_t row_bytes, int64_t K, int64_t n0, int64_t n1, float* out) {
  constexpr int64_t bb = kBlockBytes<QT>, bw = kBlockWeights<QT>;
  for (int64_t n = n0; n < n1; ++n) {
    for (int64_t b = 0; b < K / bw; ++b) {
      const uint8_t* block = w + n * row_bytes + b * bb;
      const Scales<QT> s = block_scales<QT>(block);
      for (int c = 0; c < kChunks<QT>; ++c) {
        float* o = out + n * K + b * bw + c * kChunk;
#if defined(__AVX512F__) || defined(TANDEM_QUANT_AVX2)
        Vec wv[kParts];
        chunk_weights<QT>(block, s, c, wv);
        for (int p = 0; p < kParts; ++p) vstore(o + p * kLanes, wv[p]);
#else
        for (int64_t k = 0; k < kChunk; ++k)
          o[k] = s.d[c][k / 16] * static_cast<float>(chunk_quant<QT>(block, c, k)) + s.m[c][k / 16];
#endif
      }
    }
  }
}

// Into a caller's buffer: a GEMM caller reuses one scratch tensor per process instead of faulting in a
// fresh one per layer and step (~0.5 ms of page faults for a 7 MB layer here).
void gguf_dequantize_into(at::Tensor& out, const at::Tensor& w, int64_t qtype, int64_t in_features) {
  if (is_interleaved16(qtype))  // the rows as stored first (quant_linear_x16.cpp)
    return gguf_dequantize_into(out, deinterleave16(w, qtype, in_features, std::nullopt), qtype & ~kInterleaved16,
                                in_features);
  check_weight(w, qtype, in_features, "gguf_dequantize_into");
  const int64_t N = w.size(0);
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.dim() == 2 && out.size(0) == N &&
                  out.size(1) == in_features,
              "gguf_dequantize_into: out must be contiguous float32 [", N, ", ", in_features, "]");
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    with_format(qtype, "gguf_dequantize_into", [&](auto qt) {
      dequantize_rows<decltype(qt)::value>(wp, w.size(1), in_features, n0, n1, op);
    });
  });
}

at::Tensor gguf_dequantize(const at::Tensor& w, int64_t qtype, int64_t in_features) {
  at::Tensor out = at::empty({w.size(0), in_features}, w.options().dtype(at::kFloat));
  gguf_dequantize_into(out, w, qtype, in_features);
  return out;
}

}  // namespace
}  // namespace tandem_ops

TORCH_LIBRARY_FRAGMENT(tandem, m) {
  m.def("gguf_linear(Tensor x, Tensor w, int qtype, int in_features, Tensor? bias) -> Tensor");
  m.def("gguf_dequantize(Tensor w, int qtype, int in_features) -> Tensor");
  m.def("gguf_dequantize_into(Tensor(a!) out, Tensor w, int qtype, int in_features) -> ()");
}

TORCH_LIBRARY_IMPL(tandem, CPU, m) {
  m.impl("gguf_linear", &tandem_ops::gguf_linear);
  m.impl("gguf_dequantize", &tandem_ops::gguf_dequantize);
  m.impl("gguf_dequantize_into", &tandem_ops::gguf_dequantize_into);
}
