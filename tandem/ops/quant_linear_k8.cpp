// K-quant weights (Q4_K, Q5_K, Q6_K) times int8 activations, llama.cpp's arithmetic for them: x is
// quantized per super-block of 256 (one float scale; ggml's Q8_K) and a block's dot product is summed
// in integers, its 6- or 8-bit sub-block scales included, then scaled once in float:
//   Q4_K, Q5_K   w = d * sc[s] * q - dmin * m[s]   dot = d * dx * sum_s sc[s] * sum(q * qx)  -  dmin * dx * sum_s m[s] * bsum[s]
//   Q6_K         w = d * sc[g] * (q - 32)          dot = d * dx * (sum_g sc[g] * sum(q * qx)  -  32 * sum_g sc[g] * bsum16[g])
// with s a sub-block of 32 weights, g a group of 16, and bsum the sums of x's int8 values over them.
// Per 32 weights and row: one vpmaddubsw (u8 quants x s8 activations, pairs summed in int16: at most
// 2 * 63 * 127, no saturation) and one vpmaddwd with the sub-block scales (int32), so a block costs
// one int32 -> float conversion per row instead of one per 32 weights (quant_linear_q8.cpp's
// per-32 path for the other formats).
//
// Each output is a function of its row of x alone, summed in one order whatever the batch, the tile
// and the threads. Below four rows (decode, a short verification), tiles of one or two rows meet the
// weights as they stream from memory once per call, each block decoded once per tile; from four (a
// prompt's chunk, a longer verification), each weight row is decoded once per call into a panel that
// every row of x then meets (k8::panel_rows in quant_linear_k8_panel.cpp: 2x the rate at 256 rows).
// Threads split the weight rows.
//
// AVX2 (every machine the kernels build for has it): 256-bit integer ops, which Zen 4 runs at the
// rate of its 512-bit ones. Without AVX2 the portable loop computes the same integers.

#include "quant_linear_k8.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "k_quant_int8.h"

namespace tandem_ops {
namespace {

using namespace k8;

#if defined(TANDEM_QUANT_AVX2)
#if defined(__AVX512BW__) && defined(__AVX512VL__)
#define TANDEM_K8_AVX512 1
// Two chunks at once (2k in the low 256 bits, 2k + 1 in the high), where there are 512-bit integer ops:
// half the instructions for the same integers, folded back to the 256-bit sums at the block's end,
// so every output is the same value as the 256-bit path's, bit for bit (used for Q6_K: see tile).

// Q6_K's chunks 2k and 2k + 1 as 64 unsigned bytes (without the -32, which the bsums carry): their low
// nibbles lie in 64 bytes, their 2-bit highs in one 32-byte group.
inline __m512i pair_quants_q6k(const uint8_t* b, int k) {
  // 16-bit lanes: the high 256 bits shifted 2 more than the low (a byte's bits stay its own after the
  // mask, as shifted_bits relies on).
  const __m512i shifts = _mm512_inserti64x4(_mm512_set1_epi16(4 * (k % 2)), _mm256_set1_epi16(4 * (k % 2) + 2), 1);
  const __m512i v = _mm512_loadu_si512(reinterpret_cast<const void*>(b + 64 * (k / 2)));
  const __m512i low = _mm512_and_si512(_mm512_srlv_epi16(v, _mm512_set1_epi16(4 * (k % 2))), _mm512_set1_epi8(0x0F));
  const __m512i h = _mm512_broadcast_i64x4(load32(b + 128 + 32 * (k / 2)));
  const __m512i high = _mm512_and_si512(_mm512_srlv_epi16(h, shifts), _mm512_set1_epi8(3));
  return _mm512_or_si512(low, _mm512_slli_epi16(high, 4));
}

// Which of Q6_K's 16 group scales multiplies each pair sum of chunks 2k, 2k + 1 (permutexvar indices).
inline __m512i pair_scale_index(int k) {
  alignas(64) int16_t idx[32];
  for (int w = 0; w < 32; ++w) idx[w] = static_cast<int16_t>(4 * k + w / 8);
  return _mm512_load_si512(idx);
}

using k8::dot_add;  // the 256-bit one, beside this overload
inline __m512i dot_add(__m512i acc, __m512i p, __m512i s) {
#if defined(__AVX512VNNI__)
  return _mm512_dpwssd_epi32(acc, p, s);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(p, s));
#endif
}
#endif

// Row m of x . weight rows n .. n + NR (four: independent blocks to overlap as the weights stream in).
template <int64_t QT, int NR>
void tile(const uint8_t* w, int64_t row_bytes, const Q8K& a, int64_t K, int64_t m, int64_t n, float* y,
          int64_t N) {
  constexpr int64_t bb = kBlockBytes<QT>;
  // Independent chains of integer sums per output (vpdpwssd's latency would bind a lone chain), added
  // at the block's end: exact integers, so the same value however many.
  constexpr int kChains = NR == 1 ? 4 : 2;
  const int64_t nb = a.nb;
  Outputs out;
  const uint8_t* ahead = w + (n + NR * kPrefetchTiles) * row_bytes;
#if defined(TANDEM_K8_AVX512)
  const __m512i pair_idx[4] = {pair_scale_index(0), pair_scale_index(1), pair_scale_index(2), pair_scale_index(3)};
#endif
  for (int64_t b = 0; b < nb; ++b) {
    __m256i sums[NR], offsets[NR];
    alignas(32) float d[8] = {}, f[8] = {};
    const int64_t xb = m * nb + b;
    const int8_t* xq = a.q.data() + m * K + b * kSuper;
    const __m256i bsum = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.bsum16.data() + xb * 16));
    for (int j = 0; j < NR; ++j) {
      const uint8_t* block = w + (n + j) * row_bytes + b * bb;
      for (int l = 0; l < (bb + 63) / 64; ++l)
        _mm_prefetch(reinterpret_cast<const char*>(ahead + j * row_bytes + b * bb + 64 * l), _MM_HINT_T0);
      const KScales<QT> s = k_scales<QT>(block);
      d[j] = s.d, f[j] = offset_factor<QT>(s);
      offsets[j] = _mm256_madd_epi16(offset_weights<QT>(s), bsum);
      __m256i isum[kChains];
      for (int h = 0; h < kChains; ++h) isum[h] = _mm256_setzero_si256();
#if defined(TANDEM_K8_AVX512)
      // Measured on Zen 4: Q6_K's 512-bit pairs read 1.1-1.3x faster (its decode is the heaviest); Q4_K's
      // and Q5_K's ran slower than their 256-bit chunks, so they keep those.
      if constexpr (QT == kQ6_K) {
        const __m512i scales = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s.sc)));
        __m512i wide[kChains];
        for (int h = 0; h < kChains; ++h) wide[h] = _mm512_setzero_si512();
        for (int k = 0; k < 4; ++k) {
          const __m512i x = _mm512_loadu_si512(reinterpret_cast<const void*>(xq + 64 * k));
          const __m512i sc = _mm512_permutexvar_epi16(pair_idx[k], scales);
          wide[k % kChains] = dot_add(wide[k % kChains], _mm512_maddubs_epi16(pair_quants_q6k(block, k), x), sc);
        }
        for (int h = 0; h < kChains; ++h)
          isum[h] = _mm256_add_epi32(_mm512_castsi512_si256(wide[h]), _mm512_extracti64x4_epi64(wide[h], 1));
      } else
#endif
      {
        for (int c = 0; c < 8; ++c) {
          const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 32 * c));
          isum[c % kChains] =
              dot_add(isum[c % kChains], _mm256_maddubs_epi16(unsigned_quants<QT>(block, c), x), chunk_scales<QT>(s, c));
        }
      }
      for (int h = 1; h < kChains; ++h) isum[0] = _mm256_add_epi32(isum[0], isum[h]);
      sums[j] = isum[0];
    }
    const __m256 dx = _mm256_set1_ps(a.d[xb]);
    out.add(_mm256_mul_ps(_mm256_load_ps(d), dx), lane_sums(sums, NR), _mm256_mul_ps(_mm256_load_ps(f), dx),
            lane_sums(offsets, NR));
  }
  out.store(y + m * N + n, 1, NR);
}

// Rows m, m + 1 of x . weight rows n .. n + 4 (a verification's or a small batch's rows): each block
// decoded once for both rows, eight outputs (lane 4 i + j: row m + i, weight row n + j).
template <int64_t QT>
void tile_two_rows(const uint8_t* w, int64_t row_bytes, const Q8K& a, int64_t K, int64_t m, int64_t n, float* y,
                   int64_t N) {
  constexpr int64_t bb = kBlockBytes<QT>;
  const int64_t nb = a.nb;
  Outputs out;
  const uint8_t* ahead = w + (n + 4 * kPrefetchTiles) * row_bytes;
  for (int64_t b = 0; b < nb; ++b) {
    __m256i sums[8], offsets[8];
    float d[4], f[4];
    const int8_t* x0 = a.q.data() + m * K + b * kSuper;
    const __m256i bsum0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.bsum16.data() + (m * nb + b) * 16));
    const __m256i bsum1 =
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.bsum16.data() + ((m + 1) * nb + b) * 16));
    for (int j = 0; j < 4; ++j) {
      const uint8_t* block = w + (n + j) * row_bytes + b * bb;
      for (int l = 0; l < (bb + 63) / 64; ++l)
        _mm_prefetch(reinterpret_cast<const char*>(ahead + j * row_bytes + b * bb + 64 * l), _MM_HINT_T0);
      const KScales<QT> s = k_scales<QT>(block);
      d[j] = s.d, f[j] = offset_factor<QT>(s);
      const __m256i offw = offset_weights<QT>(s);
      offsets[j] = _mm256_madd_epi16(offw, bsum0);
      offsets[4 + j] = _mm256_madd_epi16(offw, bsum1);
      __m256i i0 = _mm256_setzero_si256(), i1 = _mm256_setzero_si256();
      for (int c = 0; c < 8; ++c) {
        const __m256i q = unsigned_quants<QT>(block, c), sc = chunk_scales<QT>(s, c);
        const __m256i xa = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x0 + 32 * c));
        const __m256i xb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x0 + K + 32 * c));
        i0 = dot_add(i0, _mm256_maddubs_epi16(q, xa), sc);
        i1 = dot_add(i1, _mm256_maddubs_epi16(q, xb), sc);
      }
      sums[j] = i0, sums[4 + j] = i1;
    }
    const float dx0 = a.d[m * nb + b], dx1 = a.d[(m + 1) * nb + b];
    // Lanes set from registers (a vector load of the scalars just stored would stall on forwarding).
    const __m256 dx = _mm256_setr_ps(dx0, dx0, dx0, dx0, dx1, dx1, dx1, dx1);
    out.add(_mm256_mul_ps(_mm256_setr_ps(d[0], d[1], d[2], d[3], d[0], d[1], d[2], d[3]), dx), lane_sums(sums, 8),
            _mm256_mul_ps(_mm256_setr_ps(f[0], f[1], f[2], f[3], f[0], f[1], f[2], f[3]), dx), lane_sums(offsets, 8));
  }
  alignas(32) float r[8];
  out.values(r);
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 4; ++j) y[(m + i) * N + n + j] = r[4 * i + j];
}
#else
// Portable: the same integers and the same float steps per output (Outputs), one output at a time.
template <int64_t QT, int NR>
void tile(const uint8_t* w, int64_t row_bytes, const Q8K& a, int64_t K, int64_t m, int64_t n0, float* y,
          int64_t N) {
  constexpr int64_t bb = kBlockBytes<QT>;
  for (int64_t n = n0; n < n0 + NR; ++n) {
    float acc = 0.0f, off = 0.0f;
    for (int64_t b = 0; b < a.nb; ++b) {
      const uint8_t* block = w + n * row_bytes + b * bb;
      const KScales<QT> s = k_scales<QT>(block);
      const int8_t* qx = a.q.data() + m * K + b * kSuper;
      const int16_t* bsum = a.bsum16.data() + (m * a.nb + b) * 16;
      int32_t isum = 0, o = 0;
      for (int c = 0; c < 8; ++c)
        for (int k = 0; k < 32; ++k) {
          const int32_t q = chunk_quant<QT>(block, c, k) + (QT == kQ6_K ? 32 : 0);
          isum += (QT == kQ6_K ? s.sc[2 * c + k / 16] : s.sc[c]) * q * qx[32 * c + k];
        }
      for (int g = 0; g < 16; ++g) o += (QT == kQ6_K ? s.sc[g] : s.min[g / 2]) * bsum[g];
      const float dx = a.d[m * a.nb + b];
      acc = std::fma(s.d * dx, static_cast<float>(isum), acc);
      off = std::fma(offset_factor<QT>(s) * dx, static_cast<float>(o), off);
    }
    y[m * N + n] = acc - off;
  }
}
#endif

template <int64_t QT>
void linear_rows(const uint8_t* w, int64_t row_bytes, const Q8K& a, int64_t M, int64_t K, int64_t N, float* y) {
#if defined(TANDEM_QUANT_AVX2)
  // Measured on a Zen 3 EPYC (2 threads, Llama-3.2-1B's shapes): the panel is 1.1-2x faster from four
  // rows; below that the tiles, which stream the weights once with no panel to write, are 1.1-1.6x faster.
  if (M >= kPanelFrom) return panel_rows(QT, w, row_bytes, a, M, K, N, y);
#endif
  // A few rows (decode, a short verification): each row meets the weights in tiles of four weight rows
  // (one at the end) as they stream from memory.
  at::parallel_for(0, (N + 3) / 4, 4, [&](int64_t t0, int64_t t1) {
    const int64_t n_end = std::min(N, t1 * 4);
    for (int64_t n = t0 * 4; n < n_end;) {
      const bool four = n + 4 <= n_end;
      int64_t m = 0;
#if defined(TANDEM_QUANT_AVX2)
      if (four)
        for (; m + 2 <= M; m += 2) tile_two_rows<QT>(w, row_bytes, a, K, m, n, y, N);
#endif
      for (; m < M; ++m)
        four ? tile<QT, 4>(w, row_bytes, a, K, m, n, y, N) : tile<QT, 1>(w, row_bytes, a, K, m, n, y, N);
      n += four ? 4 : 1;
    }
  });
}

}  // namespace

bool is_k_quant(int64_t qtype) { return qtype == kQ4_K || qtype == kQ5_K || qtype == kQ6_K; }

at::Tensor k_quant_linear_q8(const at::Tensor& x, const at::Tensor& w, int64_t qtype, int64_t in_features) {
  const int64_t M = x.size(0), K = in_features, N = w.size(0);
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  if (M == 0) return y;
  const Q8K a = quantize_rows(x);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  switch (qtype) {
    case kQ4_K: linear_rows<kQ4_K>(wp, w.size(1), a, M, K, N, yp); break;
    case kQ5_K: linear_rows<kQ5_K>(wp, w.size(1), a, M, K, N, yp); break;
    case kQ6_K: linear_rows<kQ6_K>(wp, w.size(1), a, M, K, N, yp); break;
    default: TORCH_CHECK(false, "k_quant_linear_q8: not a K-quant: ", qtype);
  }
  return y;
}

}  // namespace tandem_ops
