// Linear layers on GGUF block-quantized weights with int8 activations, llama.cpp's arithmetic:
// y = x W^T (+ b) with W in Q4_0, Q4_1, Q5_0, Q8_0 or MXFP4 blocks (gguf_blocks.h) here, and in Q4_K, Q5_K or
// Q6_K blocks through quant_linear_k8.cpp (activations per 256, ggml's Q8_K, as llama.cpp pairs them).
//
// The activations are quantized to int8 per block of 32 (a scale d and the scaled sum s = d * sum(q),
// ggml's Q8_1), and each block's dot product is an exact integer sum: 32 u8 x s8 products in one
// vpmaddubsw, pairs added by vpmaddwd (or both in one vpdpbusd with AVX512-VNNI; no int16 pair sum
// saturates: each is at most 2 * 127 * 127), then scaled once per block in float32:
//   unsigned q (Q4_0, Q4_1, Q5_0)   w = dw * q + mw        dot = dw * dx * sum(q * qx) + mw * sx
//   signed q (Q8_0, MXFP4)          w = dw * q             dot = dw * dx * sum(|q| * sign(qx, q))
// per block of 32 weights, which is one block of x.
// Each output is the same function of its row of x whatever the batch. But rounding x to int8 is
// discontinuous: a one-ulp difference in x (another kernel's summation order upstream) can move a
// value to the next integer, so this path is opt-in (--quantization gguf-q8); quant_linear.cpp keeps
// x in float.
//
// Tiles of NR weight rows x MR activation rows keep MR * NR accumulators in registers; a tile's weight
// rows (a few KB) stay in L1 while every activation row meets them, so W streams from memory once per
// call. Threads split the weight rows.
//
// q8_roundtrip (x quantized and dequantized as above) lets a caller with many rows run the same
// arithmetic as one float32 GEMM (tandem/model/quant.py chooses).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

#include "gguf_blocks.h"
#include "int8_blocks.h"
#include "quant_linear_k8.h"

namespace tandem_ops {
namespace {

using namespace gguf;

// Activations quantized per block of 32: int8 values, the scale and the scaled sum of each block.
struct QuantizedRows {
  std::vector<int8_t> q;
  std::vector<float> d, s;
  int64_t nb = 0;
};

QuantizedRows quantize_rows(const at::Tensor& x) {
  const int64_t K = x.size(1);
  QuantizedRows r;
  r.nb = K / kChunk;
  r.q.resize(x.size(0) * K);
  r.d.resize(x.size(0) * r.nb);
  r.s.resize(x.size(0) * r.nb);
  int8_blocks::for_each_row(x, [&](const auto* row, int64_t m) {
    for (int64_t b = m * r.nb; b < (m + 1) * r.nb; ++b) {
      int8_t* q = r.q.data() + b * kChunk;
      r.d[b] = int8_blocks::quantize_block(row + (b - m * r.nb) * kChunk, kChunk, q);
      int32_t sum = 0;
      for (int64_t i = 0; i < kChunk; ++i) sum += q[i];
      r.s[b] = r.d[b] * static_cast<float>(sum);
    }
  });
  return r;
}

#if defined(TANDEM_QUANT_AVX2)
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// A chunk's 32 quants as the unsigned bytes of the products: the quants or, for signed formats, their
// magnitudes (signs move onto the activations).
template <int64_t QT>
inline __m256i weight_bytes(__m256i q) {
  if constexpr (kSignedQuants<QT>) return _mm256_sign_epi8(q, q);
  return q;
}

template <int64_t QT>
inline __m256 chunk_dot(__m256i w, __m256i q, const int8_t* qx, __m256i ones) {
  __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx));
  if constexpr (kSignedQuants<QT>) x = _mm256_sign_epi8(x, q);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  (void)ones;  // vpdpbusd: the four u8 x s8 products of each lane summed in one instruction
  return _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(_mm256_setzero_si256(), w, x));
#else
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(w, x), ones));
#endif
}

// A chunk's scale times x's, for each lane of chunk_dot (lanes 0-3 sum weights 0-15, lanes 4-7 16-31).
template <int64_t QT>
inline __m256 chunk_scale(const Scales<QT>& s, int c, float dx) {
  if constexpr (kHalfScales<QT>) return _mm256_set_m128(_mm_set1_ps(s.d[c][1] * dx), _mm_set1_ps(s.d[c][0] * dx));
  return _mm256_set1_ps(s.d[c][0] * dx);
}

// out[i][j] = row (m0 + i) of x . weight row (n0 + j), for MR rows and NR weight rows.
template <int64_t QT, int MR, int NR>
void tile(const uint8_t* w, int64_t row_bytes, const QuantizedRows& a, int64_t K, int64_t m0, int64_t n0,
          float* y, int64_t N) {
  static_assert(kSignedQuants<QT> || !kHalfScales<QT>, "an offset per half would need x's sums per half");
  constexpr int64_t bb = kBlockBytes<QT>;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[MR][NR];
  float mins[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_setzero_ps(), mins[i][j] = 0.0f;
  const int64_t nb = a.nb;
  // The weights stream from memory once per call: ask for the next tiles' bytes while this one
  // computes (its rows are contiguous, NR * row_bytes).
  const uint8_t* ahead = w + (n0 + kPrefetchTiles * NR) * row_bytes;
  for (int64_t b = 0; b < K / kBlockWeights<QT>; ++b) {
    for (int l = 0; l < kPrefetchLines<QT, NR>; ++l)
      _mm_prefetch(reinterpret_cast<const char*>(ahead + b * NR * bb + 64 * l), _MM_HINT_T0);
    for (int j = 0; j < NR; ++j) {
      const uint8_t* block = w + (n0 + j) * row_bytes + b * bb;
      const Scales<QT> s = block_scales<QT>(block);
      for (int c = 0; c < kChunks<QT>; ++c) {
        const __m256i q = chunk_quants<QT>(block, c);
        const __m256i wq = weight_bytes<QT>(q);
        const int64_t xb = b * kChunks<QT> + c;  // x's block of 32
        for (int i = 0; i < MR; ++i) {
          const int64_t row = m0 + i;
          const __m256 dot = chunk_dot<QT>(wq, q, a.q.data() + row * K + xb * kChunk, ones);
          acc[i][j] = _mm256_fmadd_ps(chunk_scale<QT>(s, c, a.d[row * nb + xb]), dot, acc[i][j]);
          if constexpr (!kSignedQuants<QT>) mins[i][j] += s.m[c][0] * a.s[row * nb + xb];
        }
      }
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) y[(m0 + i) * N + n0 + j] = hsum(acc[i][j]) + mins[i][j];
}
#else
// Portable: the same sums, one output at a time.
template <int64_t QT, int MR, int NR>
void tile(const uint8_t* w, int64_t row_bytes, const QuantizedRows& a, int64_t K, int64_t m0, int64_t n0,
          float* y, int64_t N) {
  constexpr int64_t bb = kBlockBytes<QT>;
  for (int i = 0; i < MR; ++i) {
    const int64_t row = m0 + i;
    for (int j = 0; j < NR; ++j) {
      float total = 0.0f;
      for (int64_t b = 0; b < K / kBlockWeights<QT>; ++b) {
        const uint8_t* block = w + (n0 + j) * row_bytes + b * bb;
        const Scales<QT> s = block_scales<QT>(block);
        for (int c = 0; c < kChunks<QT>; ++c) {
          const int64_t xb = row * a.nb + b * kChunks<QT> + c;
          const int8_t* qx = a.q.data() + xb * kChunk;
          int32_t sum[2] = {0, 0};  // each half's
          for (int64_t k = 0; k < kChunk; ++k) sum[k / 16] += chunk_quant<QT>(block, c, k) * qx[k];
          if constexpr (kHalfScales<QT>) {
            total += s.d[c][0] * a.d[xb] * static_cast<float>(sum[0]) + s.d[c][1] * a.d[xb] * static_cast<float>(sum[1]);
          } else {
            total += s.d[c][0] * a.d[xb] * static_cast<float>(sum[0] + sum[1]) + s.m[c][0] * a.s[xb];
          }
        }
      }
      y[row * N + n0 + j] = total;
    }
  }
}
#endif

template <int64_t QT>
void linear_rows(const uint8_t* w, int64_t row_bytes, const QuantizedRows& a, int64_t M, int64_t K, int64_t N, float* y) {
  for_each_tile(M, N, [&](auto mr, auto nr, int64_t m0, int64_t n0) {
    tile<QT, decltype(mr)::value, decltype(nr)::value>(w, row_bytes, a, K, m0, n0, y, N);
  });
}

at::Tensor gguf_linear_q8(const at::Tensor& x_in, const at::Tensor& w, int64_t qtype, int64_t in_features,
                          const std::optional<at::Tensor>& bias) {
  check_weight(w, qtype, in_features, "gguf_linear_q8");
  check_activations(x_in, in_features, "gguf_linear_q8");
  const at::Tensor x = x_in.reshape({-1, in_features}).contiguous();
  const int64_t M = x.size(0), K = in_features, N = w.size(0);
  if (is_k_quant(qtype)) return finish_output(k_quant_linear_q8(x, w, qtype, in_features), x_in, bias);
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  if (M > 0) {
    const QuantizedRows a = quantize_rows(x);
    const uint8_t* wp = w.data_ptr<uint8_t>();
    float* yp = y.data_ptr<float>();
    switch (qtype) {  // the K-quants went to quant_linear_k8.cpp above
      case kQ4_0: linear_rows<kQ4_0>(wp, w.size(1), a, M, K, N, yp); break;
      case kQ4_1: linear_rows<kQ4_1>(wp, w.size(1), a, M, K, N, yp); break;
      case kQ5_0: linear_rows<kQ5_0>(wp, w.size(1), a, M, K, N, yp); break;
      case kQ8_0: linear_rows<kQ8_0>(wp, w.size(1), a, M, K, N, yp); break;
      case kMXFP4: linear_rows<kMXFP4>(wp, w.size(1), a, M, K, N, yp); break;
      default: TORCH_CHECK(false, "gguf_linear_q8: unsupported ggml type ", qtype);
    }
  }
  return finish_output(y, x_in, bias);
}

at::Tensor q8_roundtrip(const at::Tensor& x_in, int64_t block) { return int8_blocks::roundtrip(x_in, block); }

}  // namespace
}  // namespace tandem_ops

TORCH_LIBRARY_FRAGMENT(tandem, m) {
  m.def("gguf_linear_q8(Tensor x, Tensor w, int qtype, int in_features, Tensor? bias) -> Tensor");
  m.def("q8_roundtrip(Tensor x, int block=32) -> Tensor");
}

TORCH_LIBRARY_IMPL(tandem, CPU, m) {
  m.impl("gguf_linear_q8", &tandem_ops::gguf_linear_q8);
  m.impl("q8_roundtrip", &tandem_ops::q8_roundtrip);
}
