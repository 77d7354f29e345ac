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
// Each output is the same function of its row of x whatever the batch: per block, acc += (dw * dx) * sum
// and off += mw * sx in fused multiply-adds, blocks in order, then y = acc + off. But rounding x to int8 is
// discontinuous: a one-ulp difference in x (another kernel's summation order upstream) can move a
// value to the next integer, so this path is opt-in (--quantization gguf-q8, or `auto` for large
// models); quant_linear.cpp keeps x in float.
//
// With AVX2, a tile holds up to eight outputs (eight rows of x and one weight row for a prompt's chunk;
// one row and eight weight rows for a decode step), one lane each: a block's integer sums of all eight
// are reduced across lanes together, so the float steps (a conversion, a multiply, one or two FMAs)
// are one per block for eight outputs rather than one per block and output. Threads split the weight
// rows in groups that stay in L2 while every tile of x's rows meets them.
//
// q8_roundtrip (x quantized and dequantized as above) lets a caller with many rows run the same
// arithmetic as one float32 GEMM (tandem/model/quant.py chooses).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

#include "gguf_blocks.h"
#include "int8_blocks.h"
#include "quant_linear_k8.h"
#include "quant_linear_x16.h"

namespace tandem_ops {
namespace {

using namespace gguf;

// Activations quantized per block of 32: int8 values, and the scale and the scaled sum of each block,
// kept by block ([nb][M], padded by a vector) so that a tile's rows' come in one load.
struct QuantizedRows {
  std::vector<int8_t> q;
  std::vector<float> d_by_block, s_by_block;  // [nb][M] + 8
  // Each whole tile of eight rows by lane: [tile][block][group of 4 values][row][4], a group's values
  // of the eight rows in one vector (lane i: row 8 tile + i), as a weight group broadcast meets them;
  // then, where four or more rows are left, the next four the same way ([block][group][row][4]).
  std::vector<int8_t> by_lane;
  int64_t tiled = 0;  // rows in whole tiles of eight
  int64_t nb = 0, M = 0;
};

QuantizedRows quantize_rows(const at::Tensor& x) {
  const int64_t K = x.size(1);
  QuantizedRows r;
  r.M = x.size(0);
  r.nb = K / kChunk;
  r.q.resize(r.M * K);
  r.d_by_block.assign(r.M * r.nb + 8, 0.0f);
  r.s_by_block.assign(r.M * r.nb + 8, 0.0f);
#if defined(TANDEM_QUANT_AVX2)
  r.tiled = r.M / 8 * 8;  // rows8_tile's, then rows4_pair's four
  const int64_t laid = r.tiled + (r.M - r.tiled >= 4 ? 4 : 0);
#else
  const int64_t laid = 0;
#endif
  r.by_lane.resize(laid * K);
  int8_blocks::for_each_row(x, [&](const auto* row, int64_t m) {
    for (int64_t b = 0; b < r.nb; ++b) {
      int8_t* q = r.q.data() + m * K + b * kChunk;
      int32_t sum;
      const float d = int8_blocks::quantize_block(row + b * kChunk, kChunk, q, sum);
      r.d_by_block[b * r.M + m] = d;
      r.s_by_block[b * r.M + m] = d * static_cast<float>(sum);
    }
    for (int64_t b = 0; m < laid && b < r.nb; ++b)
      for (int64_t g = 0; g < 8; ++g) {
        int8_t* to = m < r.tiled ? r.by_lane.data() + (((m / 8) * r.nb + b) * 8 + g) * 32 + (m % 8) * 4
                                 : r.by_lane.data() + r.tiled * K + (b * 8 + g) * 16 + (m - r.tiled) * 4;
        std::memcpy(to, r.q.data() + m * K + b * kChunk + 4 * g, 4);
      }
  });
  return r;
}

#if defined(TANDEM_QUANT_AVX2)
// A chunk's 32 quants as the unsigned bytes of the products: the quants or, for signed formats, their
// magnitudes (signs move onto the activations).
template <int64_t QT>
inline __m256i weight_bytes(__m256i q) {
  if constexpr (kSignedQuants<QT>) return _mm256_sign_epi8(q, q);
  return q;
}

// A chunk's 32 products with a row of x, summed exactly into eight int32 lanes.
template <int64_t QT>
inline __m256i chunk_isum(__m256i w, __m256i q, const int8_t* qx) {
  __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx));
  if constexpr (kSignedQuants<QT>) x = _mm256_sign_epi8(x, q);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, x);  // the four u8 x s8 products of a lane in one step
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1));
#endif
}

// Lane i * NR + j of a tile's vectors is row m0 + i and weight row n0 + j: x's value of MR consecutive
// rows (p: [block][M], padded), each repeated NR times.
template <int MR, int NR>
inline __m256 rows_lanes(const float* p) {
  if constexpr (MR == 1) return _mm256_set1_ps(p[0]);
  const __m256 v = _mm256_loadu_ps(p);
  if constexpr (NR == 1) return v;
  return _mm256_permutevar8x32_ps(v, _mm256_setr_epi32(0 / NR, 1 / NR, 2 / NR, 3 / NR, 4 / NR, 5 / NR, 6 / NR, 7 / NR));
}

// ... and a weight row's value for each (values[j], repeated MR times).
template <int MR, int NR>
inline __m256 weight_lanes(const float* values) {
  if constexpr (NR == 1) return _mm256_set1_ps(values[0]);
  alignas(32) float lanes[8] = {};
  for (int l = 0; l < MR * NR; ++l) lanes[l] = values[l % NR];
  return _mm256_load_ps(lanes);
}

inline uint16_t u16_at(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

// The fp16 at byte offset `at` of a block of eight weight rows (first: the first row's), as eight float
// lanes (exact, as half_at gives each).
inline __m256 halves8(const uint8_t* first, int64_t row_bytes, int64_t at) {
  const uint8_t* p = first + at;
  __m128i h = _mm_cvtsi32_si128(u16_at(p));
  h = _mm_insert_epi16(h, u16_at(p + row_bytes), 1);
  h = _mm_insert_epi16(h, u16_at(p + 2 * row_bytes), 2);
  h = _mm_insert_epi16(h, u16_at(p + 3 * row_bytes), 3);
  h = _mm_insert_epi16(h, u16_at(p + 4 * row_bytes), 4);
  h = _mm_insert_epi16(h, u16_at(p + 5 * row_bytes), 5);
  h = _mm_insert_epi16(h, u16_at(p + 6 * row_bytes), 6);
  h = _mm_insert_epi16(h, u16_at(p + 7 * row_bytes), 7);
  return _mm256_cvtph_ps(h);
}

// The E8M0 exponents of block b of eight weight rows as e8m0_half gives them, eight float lanes:
// 2^(e - 128), (e - 1) << 23 as float bits, or 0x00200000 << e (a subnormal) for e < 2.
inline __m256 exponents8(const uint8_t* first, int64_t row_bytes) {
  const __m256i e = _mm256_setr_epi32(first[0], first[row_bytes], first[2 * row_bytes], first[3 * row_bytes],
                                      first[4 * row_bytes], first[5 * row_bytes], first[6 * row_bytes],
                                      first[7 * row_bytes]);
  const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
  const __m256i tiny = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
  const __m256i small = _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e);
  return _mm256_castsi256_ps(_mm256_blendv_epi8(normal, tiny, small));
}

// Outputs rows m0 .. m0 + MR x weight rows n0 .. n0 + NR (MR * NR <= 8), one lane each. Every output
// takes the same steps whatever its tile: per block of 32, the products summed exactly in integers,
// then acc += (dw * dx) * sum and, for the formats with an offset, off += mw * sx (fused multiply-adds,
// blocks in order), and y = acc + off. So a row's value does not depend on its batch or the thread count.
// The integer sums of a block for all of a tile's outputs are reduced across lanes together
// (lane_sums), one conversion and one FMA per block for eight outputs.
template <int64_t QT, int MR, int NR>
void tile(const uint8_t* w, int64_t row_bytes, const QuantizedRows& a, int64_t K, int64_t m0, int64_t n0,
          float* y, int64_t N) {
  static_assert(MR * NR <= 8 && kChunks<QT> == 1, "one lane per output; blocks of one chunk");
  constexpr int64_t bb = kBlockBytes<QT>;
  // One row and eight weight rows (a decode step): the eight scales converted in one vector, not one by one.
  constexpr bool kVectorScales = MR == 1 && NR == 8;  // every format here starts its block with its scale
  const int64_t M = a.M;
  __m256 acc = _mm256_setzero_ps(), off = _mm256_setzero_ps();
  const int8_t* x0 = a.q.data() + m0 * K;
  for (int64_t b = 0; b < a.nb; ++b) {
    __m256i q[NR], wb[NR], isum[8];
    float dw[NR], mw[NR];
    for (int j = 0; j < NR; ++j) {
      const uint8_t* block = w + (n0 + j) * row_bytes + b * bb;
      if constexpr (MR == 1) _mm_prefetch(reinterpret_cast<const char*>(block + 8 * row_bytes), _MM_HINT_T0);
      if constexpr (!kVectorScales) {
        const Scales<QT> s = block_scales<QT>(block);
        dw[j] = s.d[0][0], mw[j] = s.m[0][0];
      }
      q[j] = chunk_quants<QT>(block, 0);
      wb[j] = weight_bytes<QT>(q[j]);
    }
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NR; ++j) isum[i * NR + j] = chunk_isum<QT>(wb[j], q[j], x0 + i * K + b * kChunk);
    const __m256 sums = _mm256_cvtepi32_ps(lane_sums(isum, MR * NR));
    __m256 wd, wm;
    if constexpr (kVectorScales) {  // block_scales' values: m = -8 d (Q4_0), -16 d (Q5_0), the stored m (Q4_1)
      const uint8_t* first = w + n0 * row_bytes + b * bb;
      wd = QT == kMXFP4 ? exponents8(first, row_bytes) : halves8(first, row_bytes, 0);
      wm = QT == kQ4_1 ? halves8(first, row_bytes, 2) : _mm256_mul_ps(_mm256_set1_ps(QT == kQ4_0 ? -8.0f : -16.0f), wd);
    } else {
      wd = weight_lanes<MR, NR>(dw), wm = weight_lanes<MR, NR>(mw);
    }
    const __m256 scale = _mm256_mul_ps(wd, rows_lanes<MR, NR>(a.d_by_block.data() + b * M + m0));
    acc = _mm256_fmadd_ps(scale, sums, acc);
    if constexpr (!kSignedQuants<QT>)
      off = _mm256_fmadd_ps(wm, rows_lanes<MR, NR>(a.s_by_block.data() + b * M + m0), off);
  }
  alignas(32) float r[8];
  _mm256_store_ps(r, _mm256_add_ps(acc, off));
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) y[(m0 + i) * N + n0 + j] = r[i * NR + j];
}

// How many of a block's u8 x s8 pair sums (vpmaddubsw's int16 lanes) add up before widening to int32
// without saturating: 8 * 2 * 15 * 127 and 4 * 2 * 31 * 127 are below 2^15, 2 * 2 * 127 * 127 is not.
template <int64_t QT>
constexpr int kWidenEvery = QT == kQ4_0 || QT == kQ4_1 || QT == kMXFP4 ? 8 : QT == kQ5_0 ? 4 : 1;

// A block's exact integer sums, one per lane, where x's rows come by lane: wh[h] holds weight groups
// 4 h .. 4 h + 3 in each 128-bit half (qh the same of the signed quants), and x_of(g) the rows' values of
// group g for the lanes, so an in-lane shuffle broadcasts each group to its half to meet them.
template <int64_t QT, typename XOf>
inline __m256i by_lane_sums(const __m256i (&wh)[2], const __m256i (&qh)[2], XOf&& x_of) {
  __m256i isum = _mm256_setzero_si256(), pairs = _mm256_setzero_si256();
  const auto group = [&](auto g) {
    constexpr int kG = decltype(g)::value, kImm = (kG % 4) * 0x55;  // group g % 4 of each half, four times
    __m256i x = x_of(kG);
    if constexpr (kSignedQuants<QT>) x = _mm256_sign_epi8(x, _mm256_shuffle_epi32(qh[kG / 4], kImm));
    const __m256i wg = _mm256_shuffle_epi32(wh[kG / 4], kImm);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    (void)pairs;
    isum = _mm256_dpbusd_epi32(isum, wg, x);
#else
    pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(wg, x));
    if constexpr ((kG + 1) % kWidenEvery<QT> == 0) {
      isum = _mm256_add_epi32(isum, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
      pairs = _mm256_setzero_si256();
    }
#endif
  };
  group(std::integral_constant<int, 0>{}), group(std::integral_constant<int, 1>{});
  group(std::integral_constant<int, 2>{}), group(std::integral_constant<int, 3>{});
  group(std::integral_constant<int, 4>{}), group(std::integral_constant<int, 5>{});
  group(std::integral_constant<int, 6>{}), group(std::integral_constant<int, 7>{});
  return isum;
}

// Eight rows of x (a whole tile, m0 % 8 == 0) times weight row n: lane i is row m0 + i. The rows come by
// lane (QuantizedRows::by_lane): each group of four weights is broadcast to the eight lanes and meets
// the eight rows' values in one vpmaddubsw, so a block's sums land one per lane with no reduction
// across lanes. Its float steps are tile()'s, so its outputs are tile()'s bit for bit.
template <int64_t QT>
void rows8_tile(const uint8_t* w, int64_t row_bytes, const QuantizedRows& a, int64_t m0, int64_t n, float* y,
                int64_t N) {
  constexpr int64_t bb = kBlockBytes<QT>;
  const int64_t M = a.M, nb = a.nb;
  const int8_t* xt = a.by_lane.data() + (m0 / 8) * nb * 256;
  const uint8_t* row = w + n * row_bytes;
  __m256 acc = _mm256_setzero_ps(), off = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* block = row + b * bb;
    const Scales<QT> s = block_scales<QT>(block);
    const __m256i q = chunk_quants<QT>(block, 0), wb = weight_bytes<QT>(q);
    const int8_t* xb = xt + b * 256;
    // Groups 0-3 in both halves, then 4-7: an in-lane shuffle broadcasts a group to all eight lanes.
    const __m256i wh[2] = {_mm256_permute2x128_si256(wb, wb, 0x00), _mm256_permute2x128_si256(wb, wb, 0x11)};
    const __m256i qh[2] = {_mm256_permute2x128_si256(q, q, 0x00), _mm256_permute2x128_si256(q, q, 0x11)};
    const __m256i isum = by_lane_sums<QT>(wh, qh, [&](int g) {
      return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb + 32 * g));
    });
    const __m256 scale = _mm256_mul_ps(weight_lanes<8, 1>(&s.d[0][0]), rows_lanes<8, 1>(a.d_by_block.data() + b * M + m0));
    acc = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(isum), acc);
    if constexpr (!kSignedQuants<QT>)
      off = _mm256_fmadd_ps(weight_lanes<8, 1>(&s.m[0][0]), rows_lanes<8, 1>(a.s_by_block.data() + b * M + m0), off);
  }
  alignas(32) float r[8];
  _mm256_store_ps(r, _mm256_add_ps(acc, off));
  for (int i = 0; i < 8; ++i) y[(m0 + i) * N + n] = r[i];
}

// The four rows after the whole tiles of eight (m0 == a.tiled) times weight rows n and n + 1: lane
// 4 j + i is row m0 + i and weight row n + j. Each 128-bit half holds one weight row's groups (an in-lane
// shuffle broadcasts a group to its half) and meets the four rows' values of that group, laid by lane
// and loaded into both halves. Its float steps are tile()'s, so its outputs are tile()'s bit for bit.
template <int64_t QT>
void rows4_pair(const uint8_t* w, int64_t row_bytes, const QuantizedRows& a, int64_t K, int64_t m0, int64_t n,
                float* y, int64_t N) {
  constexpr int64_t bb = kBlockBytes<QT>;
  const int64_t M = a.M, nb = a.nb;
  const int8_t* xt = a.by_lane.data() + a.tiled * K;
  __m256 acc = _mm256_setzero_ps(), off = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* b0 = w + n * row_bytes + b * bb;
    const uint8_t* b1 = b0 + row_bytes;
    const Scales<QT> s0 = block_scales<QT>(b0), s1 = block_scales<QT>(b1);
    const __m256i q0 = chunk_quants<QT>(b0, 0), q1 = chunk_quants<QT>(b1, 0);
    const __m256i w0 = weight_bytes<QT>(q0), w1 = weight_bytes<QT>(q1);
    // Groups 0-3 of both weight rows, then groups 4-7: [row n's | row n + 1's].
    const __m256i wh[2] = {_mm256_permute2x128_si256(w0, w1, 0x20), _mm256_permute2x128_si256(w0, w1, 0x31)};
    const __m256i qh[2] = {_mm256_permute2x128_si256(q0, q1, 0x20), _mm256_permute2x128_si256(q0, q1, 0x31)};
    const int8_t* xb = xt + b * 128;
    const __m256i isum = by_lane_sums<QT>(wh, qh, [&](int g) {  // the four rows' group in both halves
      return _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(xb + 16 * g)));
    });
    const __m256 dx = _mm256_broadcast_ps(reinterpret_cast<const __m128*>(a.d_by_block.data() + b * M + m0));
    const __m256 dw = _mm256_set_m128(_mm_set1_ps(s1.d[0][0]), _mm_set1_ps(s0.d[0][0]));
    acc = _mm256_fmadd_ps(_mm256_mul_ps(dw, dx), _mm256_cvtepi32_ps(isum), acc);
    if constexpr (!kSignedQuants<QT>) {
      const __m256 sx = _mm256_broadcast_ps(reinterpret_cast<const __m128*>(a.s_by_block.data() + b * M + m0));
      off = _mm256_fmadd_ps(_mm256_set_m128(_mm_set1_ps(s1.m[0][0]), _mm_set1_ps(s0.m[0][0])), sx, off);
    }
  }
  alignas(32) float r[8];
  _mm256_store_ps(r, _mm256_add_ps(acc, off));
  for (int j = 0; j < 2; ++j)
    for (int i = 0; i < 4; ++i) y[(m0 + i) * N + n + j] = r[4 * j + i];
}

// Weight rows [n0, n1) times rows m0 .. m0 + MR of x, NR weight rows a tile and the rest fewer.
template <int64_t QT, int MR, int NR>
void across(const uint8_t* w, int64_t row_bytes, const QuantizedRows& a, int64_t K, int64_t m0, int64_t n0,
            int64_t n1, float* y, int64_t N) {
  int64_t n = n0;
  for (; n + NR <= n1; n += NR) tile<QT, MR, NR>(w, row_bytes, a, K, m0, n, y, N);
  if constexpr (NR > 1) across<QT, MR, NR / 2>(w, row_bytes, a, K, m0, n, n1, y, N);
}

// Threads split the weight rows in groups (about 128 KB of blocks, in L2); within a group, tiles of
// eight rows of x (in L1 up to K = 2,048) meet each weight row in turn, then the rows left over meet
// two, four or eight weight rows at a time.
template <int64_t QT>
void linear_rows(const uint8_t* w, int64_t row_bytes, const QuantizedRows& a, int64_t M, int64_t K, int64_t N, float* y) {
  const int64_t threads = at::get_num_threads();
  // Below eight rows no tile of x meets a group twice: groups of eight split the rows evenly.
  int64_t group = M < 8 ? 8 : std::max<int64_t>(8, (128 << 10) / row_bytes);
  group = std::min(group, (N + threads - 1) / threads);
  group = std::max<int64_t>(8, (group + 7) / 8 * 8);
  at::parallel_for(0, (N + group - 1) / group, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t n0 = g * group, n1 = std::min(N, n0 + group);
      int64_t m0 = 0;
      for (; m0 + 8 <= M; m0 += 8)
        for (int64_t n = n0; n < n1; ++n) rows8_tile<QT>(w, row_bytes, a, m0, n, y, N);
      if (M - m0 >= 4) {
        int64_t n = n0;
        for (; n + 2 <= n1; n += 2) rows4_pair<QT>(w, row_bytes, a, K, m0, n, y, N);
        if (n < n1) tile<QT, 4, 1>(w, row_bytes, a, K, m0, n, y, N);
        m0 += 4;
      }
      if (M - m0 >= 2) across<QT, 2, 4>(w, row_bytes, a, K, m0, n0, n1, y, N), m0 += 2;
      if (M - m0 == 1) across<QT, 1, 8>(w, row_bytes, a, K, m0, n0, n1, y, N);
    }
  });
}
#else
// Portable: the same sums, one output at a time.
template <int64_t QT>
void linear_rows(const uint8_t* w, int64_t row_bytes, const QuantizedRows& a, int64_t M, int64_t K, int64_t N, float* y) {
  constexpr int64_t bb = kBlockBytes<QT>;
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t row = 0; row < M; ++row) {
        float acc = 0.0f, off = 0.0f;
        for (int64_t b = 0; b < a.nb; ++b) {
          const uint8_t* block = w + n * row_bytes + b * bb;
          const Scales<QT> s = block_scales<QT>(block);
          const int64_t xb = b * M + row;
          const int8_t* qx = a.q.data() + row * K + b * kChunk;
          int32_t sum = 0;
          for (int64_t k = 0; k < kChunk; ++k) sum += chunk_quant<QT>(block, 0, k) * qx[k];
          acc = std::fma(s.d[0][0] * a.d_by_block[xb], static_cast<float>(sum), acc);
          if constexpr (!kSignedQuants<QT>) off = std::fma(s.m[0][0], a.s_by_block[xb], off);
        }
        y[row * N + n] = acc + off;
      }
  });
}
#endif

at::Tensor gguf_linear_q8(const at::Tensor& x_in, const at::Tensor& w, int64_t qtype, int64_t in_features,
                          const std::optional<at::Tensor>& bias) {
  check_activations(x_in, in_features, "gguf_linear_q8");
  const at::Tensor x = x_in.reshape({-1, in_features}).contiguous();
  if (is_interleaved16(qtype)) return finish_output(interleaved16_linear_q8(x, w, qtype, in_features), x_in, bias);
  check_weight(w, qtype, in_features, "gguf_linear_q8");
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
