// K-quant weights times int8 activations at many rows (a prompt's chunk): the panel path of the
// K-quants' int8 kernel (quant_linear_k8.cpp calls it from k8::kPanelFrom rows; k_quant_int8.h holds the
// arithmetic both share).

#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#include "k_quant_int8.h"

namespace tandem_ops {
namespace k8 {
#if defined(TANDEM_QUANT_AVX2)
namespace {

// Many rows (a prompt's chunk): each weight row's blocks are decoded once per call into a panel (the
// chunks' unsigned quants and packed int16 scales, each block's offset weights and float factors) that
// then meets every row of x, instead of being decoded again for every tile of four rows. Tiles of four
// rows of x and two weight rows (panel_pair: eight integer sums in registers, each x chunk loaded once
// for both) take the quants and scales from L1, and a tile's x rows (4 x K bytes) stay in L1 while it
// meets a group of weight rows; measured on Zen 3 against tiles of eight rows and one weight row: the
// same at K = 2048, 1.15x at K = 8192, where eight rows of x outgrow L1. Each output's float steps are
// tile()'s (Outputs), so every output is tile()'s value bit for bit: a row's value does not depend on
// which path its batch took.

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
      const __m256i sc = chunk_scales<QT>(s, c);  // int16 0 holds the low half's scale, int16 8 the high's
      out[b].sc[c] = static_cast<uint16_t>(_mm256_extract_epi16(sc, 0)) |
                     static_cast<uint32_t>(static_cast<uint16_t>(_mm256_extract_epi16(sc, 8))) << 16;
    }
    out[b].offw = offset_weights<QT>(s);
    out[b].d = s.d;
    out[b].f = offset_factor<QT>(s);
  }
}

// Rows m0 .. m0 + MR (at most four) of x times one decoded weight row, into column n of y.
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
    alignas(32) float part[8] = {};  // the tile's rows' scales (fewer than eight: the lanes past MR unused)
    std::copy_n(a.d_by_block.data() + b * M + m0, MR, part);
    const __m256 dx = _mm256_load_ps(part);
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
  out.values(r);
  for (int i = 0; i < 4; ++i) y[(m0 + i) * N + n] = r[2 * i], y[(m0 + i) * N + n + 1] = r[2 * i + 1];
}

// Threads split the weight rows; each decodes a group of them at a time (a panel of about 96 KB, in L2),
// then walks every tile of x's rows across the group.
template <int64_t QT>
void rows_of_format(const uint8_t* w, int64_t row_bytes, const Q8K& a, int64_t M, int64_t K, int64_t N, float* y) {
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

}  // namespace

void panel_rows(int64_t qtype, const uint8_t* w, int64_t row_bytes, const Q8K& a, int64_t M, int64_t K, int64_t N,
                float* y) {
  switch (qtype) {
    case kQ4_K: return rows_of_format<kQ4_K>(w, row_bytes, a, M, K, N, y);
    case kQ5_K: return rows_of_format<kQ5_K>(w, row_bytes, a, M, K, N, y);
    case kQ6_K: return rows_of_format<kQ6_K>(w, row_bytes, a, M, K, N, y);
    default: TORCH_CHECK(false, "k8::panel_rows: not a K-quant: ", qtype);
  }
}
#endif
}  // namespace k8
}  // namespace tandem_ops
