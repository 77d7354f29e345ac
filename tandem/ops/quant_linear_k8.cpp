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
// and the threads. Below four rows (decode), tiles meet the weights as they stream from memory once
// per call, each block decoded once per tile; from four (a prompt's chunk, a verification), each
// weight row is decoded once per call into a panel that every row of x then meets (panel_rows: 2x
// the rate at 256 rows). Threads split the weight rows.
//
// AVX2 (every machine the kernels build for has it): 256-bit integer ops, which Zen 4 runs at the
// rate of its 512-bit ones. Without AVX2 the portable loop computes the same integers.

#include "quant_linear_k8.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "gguf_blocks.h"
#include "int8_blocks.h"

namespace tandem_ops {
namespace {

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

Q8K quantize_rows(const at::Tensor& x) {
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

inline __m512i dot_add(__m512i acc, __m512i p, __m512i s) {
#if defined(__AVX512VNNI__)
  return _mm512_dpwssd_epi32(acc, p, s);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(p, s));
#endif
}
#endif

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
  void store(float* y, int64_t stride, int n) const {
    alignas(32) float r[8];
    _mm256_store_ps(r, _mm256_sub_ps(acc, off));
    for (int i = 0; i < n; ++i) y[i * stride] = r[i];
  }
};

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
  _mm256_store_ps(r, _mm256_sub_ps(out.acc, out.off));
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 4; ++j) y[(m + i) * N + n + j] = r[4 * i + j];
}

// Many rows (a prompt's chunk): each weight row's blocks are decoded once per call into a panel (the
// chunks' unsigned quants and int16 scale vectors, each block's offset weights and float factors) that
// then meets every row of x, instead of being decoded again for every tile of four rows. Tiles of four
// rows of x and two weight rows (panel_pair: eight integer sums in registers, each x chunk loaded once
// for both) take the quants and scales from L1, and a tile's x rows (4 x K bytes) stay in L1 while it
// meets a group of weight rows; measured on Zen 3 against tiles of eight rows and one weight row: the
// same at K = 2048, 1.15x at K = 8192, where eight rows of x outgrow L1. Each output's float steps are
// tile()'s (Outputs), so every output is tile()'s value bit for bit: a row's value does not depend on
// which path its batch took.
constexpr int64_t kPanelFrom = 4;

struct alignas(32) PanelBlock {
  __m256i q[8];         // the chunks' unsigned quants
  uint32_t sc[8];       // each chunk's int16 scales, the first half's in the low 16 bits (chunk_scales packed)
  __m256i offw;         // offset_weights
  float d, f;           // d, and the offset term's factor (dmin, or 32 d for Q6_K) before x's scale
};

// A chunk's packed scales as chunk_scales gives them: the low int16 in the low 128 bits, the high in the
// high (a broadcast load and one byte shuffle; half the panel's bytes of a stored vector).
inline __m256i panel_scales(uint32_t packed) {
  const __m256i halves = _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1,
                                          2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3);
  return _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(packed)), halves);
}

template <int64_t QT>
void decode_panel(const uint8_t* row, int64_t nb, PanelBlock* out) {
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* block = row + b * kBlockBytes<QT>;
    const KScales<QT> s = k_scales<QT>(block);
    for (int c = 0; c < 8; ++c) {
      out[b].q[c] = unsigned_quants<QT>(block, c);
      const int16_t low = QT == kQ6_K ? s.sc[2 * c] : s.sc[c], high = QT == kQ6_K ? s.sc[2 * c + 1] : s.sc[c];
      out[b].sc[c] = static_cast<uint16_t>(low) | static_cast<uint32_t>(static_cast<uint16_t>(high)) << 16;
    }
    out[b].offw = offset_weights<QT>(s);
    out[b].d = s.d;
    out[b].f = offset_factor<QT>(s);
  }
}

// Rows m0 .. m0 + MR of x times one decoded weight row, into column n of y.
template <int MR>
void panel_tile(const PanelBlock* p, const Q8K& a, int64_t K, int64_t M, int64_t m0, int64_t n, float* y,
                int64_t N) {
  const int64_t nb = a.nb;
  Outputs out;
  const int8_t* x0 = a.q.data() + m0 * K;
  for (int64_t b = 0; b < nb; ++b) {
    __m256i isum[MR], offsets[MR];
    for (int i = 0; i < MR; ++i) isum[i] = _mm256_setzero_si256();
    for (int c = 0; c < 8; ++c) {
      const __m256i q = _mm256_load_si256(&p[b].q[c]);
      const __m256i sc = panel_scales(p[b].sc[c]);
      for (int i = 0; i < MR; ++i) {
        const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x0 + i * K + b * kSuper + 32 * c));
        isum[i] = dot_add(isum[i], _mm256_maddubs_epi16(q, x), sc);
      }
    }
    for (int i = 0; i < MR; ++i) {
      const int16_t* bsum = a.bsum16.data() + ((m0 + i) * nb + b) * 16;
      offsets[i] = _mm256_madd_epi16(p[b].offw, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bsum)));
    }
    __m256 dx;
    if constexpr (MR == 8) {
      dx = _mm256_loadu_ps(a.d_by_block.data() + b * M + m0);
    } else {
      alignas(32) float part[8] = {};
      std::copy_n(a.d_by_block.data() + b * M + m0, MR, part);
      dx = _mm256_load_ps(part);
    }
    out.add(_mm256_mul_ps(_mm256_set1_ps(p[b].d), dx), lane_sums(isum, MR), _mm256_mul_ps(_mm256_set1_ps(p[b].f), dx),
            lane_sums(offsets, MR));
  }
  out.store(y + m0 * N + n, N, MR);
}

// Rows m0 .. m0 + 4 of x times two decoded weight rows, into columns n, n + 1 of y: eight outputs, each
// x chunk loaded once for both weight rows (lane 2 i + j: row m0 + i, weight row n + j).
void panel_pair(const PanelBlock* p0, const PanelBlock* p1, const Q8K& a, int64_t K, int64_t M, int64_t m0,
                int64_t n, float* y, int64_t N) {
  const int64_t nb = a.nb;
  Outputs out;
  const int8_t* x0 = a.q.data() + m0 * K;
  const __m256i twice = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3);  // each row's lane for both weight rows
  for (int64_t b = 0; b < nb; ++b) {
    __m256i isum[8], offsets[8];
    for (int i = 0; i < 8; ++i) isum[i] = _mm256_setzero_si256();
    for (int c = 0; c < 8; ++c) {
      const __m256i q0 = _mm256_load_si256(&p0[b].q[c]), s0 = panel_scales(p0[b].sc[c]);
      const __m256i q1 = _mm256_load_si256(&p1[b].q[c]), s1 = panel_scales(p1[b].sc[c]);
      for (int i = 0; i < 4; ++i) {
        const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x0 + i * K + b * kSuper + 32 * c));
        isum[2 * i] = dot_add(isum[2 * i], _mm256_maddubs_epi16(q0, x), s0);
        isum[2 * i + 1] = dot_add(isum[2 * i + 1], _mm256_maddubs_epi16(q1, x), s1);
      }
    }
    for (int i = 0; i < 4; ++i) {
      const __m256i bsum = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.bsum16.data() + ((m0 + i) * nb + b) * 16));
      offsets[2 * i] = _mm256_madd_epi16(p0[b].offw, bsum);
      offsets[2 * i + 1] = _mm256_madd_epi16(p1[b].offw, bsum);
    }
    const __m256 dx = _mm256_permutevar8x32_ps(
        _mm256_castps128_ps256(_mm_loadu_ps(a.d_by_block.data() + b * M + m0)), twice);
    const __m256 d = _mm256_setr_ps(p0[b].d, p1[b].d, p0[b].d, p1[b].d, p0[b].d, p1[b].d, p0[b].d, p1[b].d);
    const __m256 f = _mm256_setr_ps(p0[b].f, p1[b].f, p0[b].f, p1[b].f, p0[b].f, p1[b].f, p0[b].f, p1[b].f);
    out.add(_mm256_mul_ps(d, dx), lane_sums(isum, 8), _mm256_mul_ps(f, dx), lane_sums(offsets, 8));
  }
  alignas(32) float r[8];
  _mm256_store_ps(r, _mm256_sub_ps(out.acc, out.off));
  for (int i = 0; i < 4; ++i) y[(m0 + i) * N + n] = r[2 * i], y[(m0 + i) * N + n + 1] = r[2 * i + 1];
}

// Threads split the weight rows; each decodes a group of them at a time (a panel of about 96 KB, in L2),
// then walks every tile of x's rows across the group.
template <int64_t QT>
void panel_rows(const uint8_t* w, int64_t row_bytes, const Q8K& a, int64_t M, int64_t K, int64_t N, float* y) {
  const int64_t nb = a.nb;
  // An even count, so that weight rows pair up.
  const int64_t group = std::max<int64_t>(2, (96 << 10) / (nb * static_cast<int64_t>(sizeof(PanelBlock))) / 2 * 2);
  at::parallel_for(0, N, group, [&](int64_t n0, int64_t n1) {
    std::vector<PanelBlock> panel(group * nb);
    for (int64_t g0 = n0; g0 < n1; g0 += group) {
      const int64_t g1 = std::min(n1, g0 + group);
      for (int64_t n = g0; n < g1; ++n) decode_panel<QT>(w + n * row_bytes, nb, panel.data() + (n - g0) * nb);
      const auto over_group = [&](auto mr, int64_t m0) {
        for (int64_t n = g0; n < g1; ++n)
          panel_tile<decltype(mr)::value>(panel.data() + (n - g0) * nb, a, K, M, m0, n, y, N);
      };
      int64_t m0 = 0;
      for (; m0 + 4 <= M; m0 += 4) {
        int64_t n = g0;
        for (; n + 2 <= g1; n += 2)
          panel_pair(panel.data() + (n - g0) * nb, panel.data() + (n + 1 - g0) * nb, a, K, M, m0, n, y, N);
        if (n < g1) panel_tile<4>(panel.data() + (n - g0) * nb, a, K, M, m0, n, y, N);
      }
      if (M - m0 == 3) over_group(std::integral_constant<int, 3>{}, m0);
      if (M - m0 == 2) over_group(std::integral_constant<int, 2>{}, m0);
      if (M - m0 == 1) over_group(std::integral_constant<int, 1>{}, m0);
    }
  });
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
  if (M >= kPanelFrom) return panel_rows<QT>(w, row_bytes, a, M, K, N, y);
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
