// Linear layers on GGUF block-quantized weights, read as stored: y = x W^T (+ b) with W in Q4_0, Q4_1 or
// Q8_0 blocks of 32 weights along K (ggml's layouts, one row of blocks per output column).
//
// A decode step reads every weight once, so the bytes of W are its cost: Q4_1 holds 32 weights in 20
// bytes (5 bits a weight) where float32 takes 128. Like llama.cpp, the activations are quantized to
// int8 per block of 32 (a scale d and the scaled sum s = d * sum(q), ggml's Q8_1), and each block's dot
// product is an exact integer sum: 32 u8 x s8 products in one vpmaddubsw, pairs added by vpmaddwd,
// then scaled once per block in float32:
//   Q4_1  w = dw * q + mw, q in [0, 15]     dot = dw * dx * sum(q * qx) + mw * sx
//   Q4_0  w = dw * (q - 8)                  the same with mw = -8 dw
//   Q8_0  w = dw * q, q in [-127, 127]      dot = dw * dx * sum(|q| * sign(qx, q))
// Each output is the same function of its row of x whatever the batch: a request's tokens get the same
// values in a prompt chunk as in a decode batch.
//
// Tiles of NR weight rows x MR activation rows keep MR * NR accumulators in registers; a tile's weight
// rows (a few KB) stay in L1 while every activation row meets them, so W streams from memory once per
// call. Threads split the weight rows.
//
// gguf_dequantize (float32 [N, K]) and q8_roundtrip (x quantized and dequantized as above) let a caller
// with many rows run the same arithmetic as one float32 GEMM (tandem/model/quant.py chooses).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define TANDEM_QUANT_AVX2 1
#endif

#ifndef TANDEM_PREFETCH_TILES
#define TANDEM_PREFETCH_TILES 2
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

namespace tandem_ops {
namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kPrefetchTiles = TANDEM_PREFETCH_TILES;
// ggml type ids.
constexpr int64_t kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8;

int64_t block_bytes(int64_t qtype) {
  switch (qtype) {
    case kQ4_0: return 18;  // fp16 d, 16 bytes of nibbles
    case kQ4_1: return 20;  // fp16 d, fp16 m, 16 bytes of nibbles
    case kQ8_0: return 34;  // fp16 d, 32 int8
    default: TORCH_CHECK(false, "gguf quantized linear: unsupported ggml type ", qtype);
  }
  return 0;
}

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
#if defined(TANDEM_QUANT_AVX2)
  return _cvtsh_ss(bits);
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}

// One weight block's scale, offset (the weight of q = 0) and the address of its quants.
struct WeightBlock {
  float d, m;
  const uint8_t* qs;
};

template <int64_t QT>
inline WeightBlock weight_block(const uint8_t* b) {
  if constexpr (QT == kQ4_1) return {half_at(b), half_at(b + 2), b + 4};
  const float d = half_at(b);
  if constexpr (QT == kQ4_0) return {d, -8.0f * d, b + 2};
  return {d, 0.0f, b + 2};
}

// Activations quantized per block of 32: int8 values, the scale and the scaled sum of each block.
struct QuantizedRows {
  std::vector<int8_t> q;
  std::vector<float> d, s;
  int64_t nb = 0;
};

template <typename T>
void quantize_row(const T* x, int64_t K, int8_t* q, float* d, float* s) {
  for (int64_t b = 0; b < K / kBlock; ++b) {
    const T* xb = x + b * kBlock;
    float amax = 0.0f;
    for (int64_t i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(static_cast<float>(xb[i])));
    const float scale = amax / 127.0f;
    const float inv = scale > 0.0f ? 1.0f / scale : 0.0f;
    int32_t sum = 0;
    for (int64_t i = 0; i < kBlock; ++i) {
      // nearbyint rounds half to even, as torch.round does in the fallback.
      const int32_t v = static_cast<int32_t>(std::nearbyint(static_cast<float>(xb[i]) * inv));
      q[b * kBlock + i] = static_cast<int8_t>(v);
      sum += v;
    }
    d[b] = scale;
    s[b] = scale * static_cast<float>(sum);
  }
}

QuantizedRows quantize_rows(const at::Tensor& x) {
  const int64_t M = x.size(0), K = x.size(1);
  QuantizedRows r;
  r.nb = K / kBlock;
  r.q.resize(M * K);
  r.d.resize(M * r.nb);
  r.s.resize(M * r.nb);
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      int8_t* q = r.q.data() + m * K;
      float* d = r.d.data() + m * r.nb;
      float* s = r.s.data() + m * r.nb;
      if (x.scalar_type() == at::kFloat) {
        quantize_row(x.data_ptr<float>() + m * K, K, q, d, s);
      } else {
        quantize_row(x.data_ptr<at::BFloat16>() + m * K, K, q, d, s);
      }
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

// A weight block's 32 quants as bytes in K order: nibbles (low ones are weights 0-15, high ones 16-31)
// or, for Q8_0, the magnitudes (signs move onto the activations).
template <int64_t QT>
inline __m256i weight_bytes(const uint8_t* qs) {
  if constexpr (QT == kQ8_0) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs));
    return _mm256_sign_epi8(v, v);
  }
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(0x0F));
}

template <int64_t QT>
inline __m256 block_dot(__m256i w, const uint8_t* qs, const int8_t* qx, __m256i ones) {
  __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx));
  if constexpr (QT == kQ8_0) x = _mm256_sign_epi8(x, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs)));
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(w, x), ones));
}

// out[i][j] = row (m0 + i) of x . weight row (n0 + j), for MR rows and NR weight rows.
template <int64_t QT, int MR, int NR>
void tile(const uint8_t* w, int64_t row_bytes, const QuantizedRows& a, int64_t K, int64_t m0, int64_t n0,
          float* y, int64_t N) {
  constexpr int64_t bb = QT == kQ4_0 ? 18 : QT == kQ4_1 ? 20 : 34;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[MR][NR];
  float mins[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_setzero_ps(), mins[i][j] = 0.0f;
  const int64_t nb = a.nb;
  // The weights stream from memory once per call: ask for the next tiles' bytes while this one
  // computes (its rows are contiguous, NR * row_bytes), a little more than one line per block.
  const uint8_t* ahead = w + (n0 + kPrefetchTiles * NR) * row_bytes;
  for (int64_t b = 0; b < nb; ++b) {
    _mm_prefetch(reinterpret_cast<const char*>(ahead + b * NR * bb), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(ahead + b * NR * bb + 64), _MM_HINT_T0);
    for (int j = 0; j < NR; ++j) {
      const WeightBlock wb = weight_block<QT>(w + (n0 + j) * row_bytes + b * bb);
      const __m256i wq = weight_bytes<QT>(wb.qs);
      for (int i = 0; i < MR; ++i) {
        const int64_t row = m0 + i;
        const __m256 dot = block_dot<QT>(wq, wb.qs, a.q.data() + row * K + b * kBlock, ones);
        acc[i][j] = _mm256_fmadd_ps(_mm256_set1_ps(wb.d * a.d[row * nb + b]), dot, acc[i][j]);
        if constexpr (QT != kQ8_0) mins[i][j] += wb.m * a.s[row * nb + b];
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
  constexpr int64_t bb = QT == kQ4_0 ? 18 : QT == kQ4_1 ? 20 : 34;
  for (int i = 0; i < MR; ++i) {
    const int64_t row = m0 + i;
    for (int j = 0; j < NR; ++j) {
      float total = 0.0f;
      for (int64_t b = 0; b < a.nb; ++b) {
        const WeightBlock wb = weight_block<QT>(w + (n0 + j) * row_bytes + b * bb);
        const int8_t* qx = a.q.data() + row * K + b * kBlock;
        int32_t sum = 0;
        for (int64_t k = 0; k < kBlock; ++k) {
          int32_t q;
          if constexpr (QT == kQ8_0) q = static_cast<int8_t>(wb.qs[k]);
          else q = k < 16 ? (wb.qs[k] & 0x0F) : (wb.qs[k - 16] >> 4);
          sum += q * qx[k];
        }
        total += wb.d * a.d[row * a.nb + b] * static_cast<float>(sum) + wb.m * a.s[row * a.nb + b];
      }
      y[row * N + n0 + j] = total;
    }
  }
}
#endif

// Rows of x in groups of up to four, weight rows in pairs (four at a time for one row, where there
// is no reuse of a weight block across rows and more independent accumulators keep the FMAs busy).
template <int64_t QT>
void linear_rows(const uint8_t* w, int64_t row_bytes, const QuantizedRows& a, int64_t M, int64_t K, int64_t N,
                 float* y) {
  constexpr int64_t kNR = 2;
  at::parallel_for(0, (N + 3) / 4, 8, [&](int64_t t0, int64_t t1) {
    const int64_t n_end = std::min(N, t1 * 4);
    for (int64_t n0 = t0 * 4; n0 < n_end;) {
      if (M == 1 && n0 + 4 <= n_end) {
        tile<QT, 1, 4>(w, row_bytes, a, K, 0, n0, y, N);
        n0 += 4;
        continue;
      }
      const bool pair = n0 + kNR <= n_end;
      int64_t m0 = 0;
      for (; m0 + 4 <= M; m0 += 4) {
        pair ? tile<QT, 4, kNR>(w, row_bytes, a, K, m0, n0, y, N) : tile<QT, 4, 1>(w, row_bytes, a, K, m0, n0, y, N);
      }
      for (; m0 < M; ++m0) {
        pair ? tile<QT, 1, kNR>(w, row_bytes, a, K, m0, n0, y, N) : tile<QT, 1, 1>(w, row_bytes, a, K, m0, n0, y, N);
      }
      n0 += pair ? kNR : 1;
    }
  });
}

void check_weight(const at::Tensor& w, int64_t qtype, int64_t in_features, const char* op) {
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous(), op,
              ": weight must be contiguous uint8 [out_features, blocks * block_bytes] on the CPU");
  TORCH_CHECK(in_features > 0 && in_features % kBlock == 0, op, ": in_features must be a multiple of 32, got ",
              in_features);
  TORCH_CHECK(w.size(1) == in_features / kBlock * block_bytes(qtype), op, ": weight rows hold ", w.size(1),
              " bytes, expected ", in_features / kBlock * block_bytes(qtype));
}

at::Tensor gguf_linear(const at::Tensor& x_in, const at::Tensor& w, int64_t qtype, int64_t in_features,
                       const std::optional<at::Tensor>& bias) {
  check_weight(w, qtype, in_features, "gguf_linear");
  TORCH_CHECK(x_in.device().is_cpu() && (x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16),
              "gguf_linear: x must be float32 or bfloat16 on the CPU");
  TORCH_CHECK(x_in.size(-1) == in_features, "gguf_linear: x has ", x_in.size(-1), " features, expected ",
              in_features);
  const at::Tensor x = x_in.reshape({-1, in_features}).contiguous();
  const int64_t M = x.size(0), K = in_features, N = w.size(0);
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  if (M > 0) {
    const QuantizedRows a = quantize_rows(x);
    const uint8_t* wp = w.data_ptr<uint8_t>();
    float* yp = y.data_ptr<float>();
    switch (qtype) {
      case kQ4_0: linear_rows<kQ4_0>(wp, w.size(1), a, M, K, N, yp); break;
      case kQ4_1: linear_rows<kQ4_1>(wp, w.size(1), a, M, K, N, yp); break;
      case kQ8_0: linear_rows<kQ8_0>(wp, w.size(1), a, M, K, N, yp); break;
      default: TORCH_CHECK(false, "gguf_linear: unsupported ggml type ", qtype);
    }
  }
  if (bias.has_value()) y.add_(bias->to(at::kFloat));
  std::vector<int64_t> shape(x_in.sizes().begin(), x_in.sizes().end());
  shape.back() = N;
  return y.to(x_in.scalar_type()).view(shape);
}

template <int64_t QT>
void dequantize_rows(const uint8_t* w, int64_t row_bytes, int64_t K, int64_t n0, int64_t n1, float* out) {
  constexpr int64_t bb = QT == kQ4_0 ? 18 : QT == kQ4_1 ? 20 : 34;
  for (int64_t n = n0; n < n1; ++n) {
    for (int64_t b = 0; b < K / kBlock; ++b) {
      const WeightBlock wb = weight_block<QT>(w + n * row_bytes + b * bb);
      float* o = out + n * K + b * kBlock;
#if defined(TANDEM_QUANT_AVX2)
      // The bytes in K order (as the dot kernel sees them, Q8_0 signed), widened eight at a time;
      // d * q + m rounds twice, as the scalar loop below does (no FMA).
      __m256i bytes;
      if constexpr (QT == kQ8_0) {
        bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb.qs));
      } else {
        const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wb.qs));
        bytes = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(0x0F));
      }
      const __m256 d = _mm256_set1_ps(wb.d), m = _mm256_set1_ps(wb.m);
      alignas(32) uint8_t lanes[32];
      _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), bytes);
      for (int64_t part = 0; part < 4; ++part) {
        const __m128i eight = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(lanes + part * 8));
        const __m256i ints = QT == kQ8_0 ? _mm256_cvtepi8_epi32(eight) : _mm256_cvtepu8_epi32(eight);
        _mm256_storeu_ps(o + part * 8, _mm256_add_ps(_mm256_mul_ps(d, _mm256_cvtepi32_ps(ints)), m));
      }
#else
      for (int64_t k = 0; k < kBlock; ++k) {
        float q;
        if constexpr (QT == kQ8_0) q = static_cast<float>(static_cast<int8_t>(wb.qs[k]));
        else q = static_cast<float>(k < 16 ? (wb.qs[k] & 0x0F) : (wb.qs[k - 16] >> 4));
        o[k] = wb.d * q + wb.m;
      }
#endif
    }
  }
}

// Into a caller's buffer: a GEMM caller reuses one scratch tensor per process instead of faulting in a
// fresh one per layer and step (~0.5 ms of page faults for a 7 MB layer here).
void gguf_dequantize_into(at::Tensor& out, const at::Tensor& w, int64_t qtype, int64_t in_features) {
  check_weight(w, qtype, in_features, "gguf_dequantize_into");
  const int64_t N = w.size(0);
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.dim() == 2 && out.size(0) == N &&
                  out.size(1) == in_features,
              "gguf_dequantize_into: out must be contiguous float32 [", N, ", ", in_features, "]");
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    switch (qtype) {
      case kQ4_0: dequantize_rows<kQ4_0>(wp, w.size(1), in_features, n0, n1, op); break;
      case kQ4_1: dequantize_rows<kQ4_1>(wp, w.size(1), in_features, n0, n1, op); break;
      default: dequantize_rows<kQ8_0>(wp, w.size(1), in_features, n0, n1, op); break;
    }
  });
}

at::Tensor gguf_dequantize(const at::Tensor& w, int64_t qtype, int64_t in_features) {
  check_weight(w, qtype, in_features, "gguf_dequantize");
  at::Tensor out = at::empty({w.size(0), in_features}, w.options().dtype(at::kFloat));
  gguf_dequantize_into(out, w, qtype, in_features);
  return out;
}

at::Tensor q8_roundtrip(const at::Tensor& x_in) {
  TORCH_CHECK(x_in.device().is_cpu() && (x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16),
              "q8_roundtrip: x must be float32 or bfloat16 on the CPU");
  const int64_t K = x_in.size(-1);
  TORCH_CHECK(K % kBlock == 0, "q8_roundtrip: the last dimension must be a multiple of 32, got ", K);
  const at::Tensor x = x_in.reshape({-1, K}).contiguous();
  const int64_t M = x.size(0);
  at::Tensor out = at::empty({M, K}, x.options().dtype(at::kFloat));
  if (M > 0) {
    const QuantizedRows a = quantize_rows(x);
    float* op = out.data_ptr<float>();
    at::parallel_for(0, M * a.nb, 256, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b)
        for (int64_t k = 0; k < kBlock; ++k) op[b * kBlock + k] = a.d[b] * static_cast<float>(a.q[b * kBlock + k]);
    });
  }
  return out.view(x_in.sizes());
}

}  // namespace
}  // namespace tandem_ops

TORCH_LIBRARY_FRAGMENT(tandem, m) {
  m.def("gguf_linear(Tensor x, Tensor w, int qtype, int in_features, Tensor? bias) -> Tensor");
  m.def("gguf_dequantize(Tensor w, int qtype, int in_features) -> Tensor");
  m.def("gguf_dequantize_into(Tensor(a!) out, Tensor w, int qtype, int in_features) -> ()");
  m.def("q8_roundtrip(Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(tandem, CPU, m) {
  m.impl("gguf_linear", &tandem_ops::gguf_linear);
  m.impl("gguf_dequantize", &tandem_ops::gguf_dequantize);
  m.impl("gguf_dequantize_into", &tandem_ops::gguf_dequantize_into);
  m.impl("q8_roundtrip", &tandem_ops::q8_roundtrip);
}
