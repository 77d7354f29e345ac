// Q4_K, Q6_K, Q4_0 and Q8_0 weights interleaved by 16 rows, times int8 activations, on AVX512-VNNI
// (llama.cpp's CPU repack has the idea for its Q4_0 x 8 and Q4_K x 8 layouts; this layout is Tandem's own).
//
// Layout. The rows are cut into groups of 16; a group's super-blocks (256 weights along K) follow one
// another, and each holds the 16 rows' bytes of that super-block permuted (a byte permutation: the
// group takes exactly the bytes it held):
//   Q4_K (16 x 144 bytes)  16 fp16 d | 16 fp16 dmin | the 12 scale bytes as 12 planes of 16 (byte j of
//                          every row) | 32 groups of 64 quant bytes: rows x 4 bytes of qs[4 g .. 4 g + 3]
//   Q6_K (16 x 210 bytes)  16 fp16 d | 16 planes of the int8 scales | per half of 128 weights, per four
//                          bytes g: 64 of ql[64 h + 4 g ..], 64 of ql[64 h + 32 + 4 g ..], 64 of qh[32 h + 4 g ..]
//   Q4_0 (16 x 18 bytes)   16 fp16 d | 4 groups of 64: rows x qs[4 g .. 4 g + 3]
//   Q8_0 (16 x 34 bytes)   16 fp16 d | 8 groups of 64: rows x qs[4 g .. 4 g + 3]
// so that a 64-byte load is four quant bytes of each of 16 rows: its low nibbles meet four int8
// activations broadcast to every lane in one vpdpbusd (u8 x s8, four products summed into each row's
// int32 lane), its high nibbles the four 32 weights later (Q4_K: the next sub-block). No sum crosses
// lanes: a tile ends with 16 outputs in one register.
//
// Arithmetic. Exactly the stored layout's kernel's per output, so an output is the same value through
// either layout, whatever the batch, the tile or the threads (each row of x runs the same instructions
// in any tile). K-quants, quant_linear_k8.cpp's: each super-block's integer sum (the sub-block scales
// applied in int32) and offset sum, then acc += (d * dx) * sum and off += (f * dx) * offset in that
// order, y = acc - off. Q4_0 and Q8_0, quant_linear_q8.cpp's (x per 32): acc += (d * dx) * sum and, for
// Q4_0, off += (-8 d) * sx, y = acc + off; Q8_0's signed quants meet x as q + 128 (vpdpbusd multiplies
// unsigned bytes), less 128 times x's sum over the block, the same integer.
//
// Threads split the groups; rows of x go through a group in tiles of up to four, in blocks of 64 rows
// (a prompt's int8 rows stay in the L2 cache while every group of a thread's range meets them).

#include "quant_linear_x16.h"

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>

#include "k_quant_int8.h"

namespace tandem_ops {
namespace {

using namespace gguf;
constexpr int kRows = 16;

// Where byte i of row r's super-block lands in the group's interleaved super-block.
template <int64_t QT>
int64_t interleaved_offset(int64_t r, int64_t i) {
  if constexpr (QT == kQ4_K) {
    if (i < 2) return 2 * r + i;
    if (i < 4) return 32 + 2 * r + (i - 2);
    if (i < 16) return 64 + 16 * (i - 4) + r;
    const int64_t q = i - 16;  // qs byte: pair of chunks c, four bytes g
    return 256 + (q / 4) * 64 + 4 * r + q % 4;
  } else if constexpr (QT == kQ4_0 || QT == kQ8_0) {
    if (i < 2) return 2 * r + i;
    const int64_t q = i - 2;
    return 32 + (q / 4) * 64 + 4 * r + q % 4;
  } else {
    if (i >= 208) return 2 * r + (i - 208);
    if (i >= 192) return 32 + 16 * (i - 192) + r;
    if (i < 128) {  // ql: half h, then the first or second 32 bytes of it
      const int64_t h = i / 64, w = i % 64, second = w / 32, g = (w % 32) / 4;
      return 288 + h * 1536 + g * 192 + second * 64 + 4 * r + w % 4;
    }
    const int64_t q = i - 128, h = q / 32, g = (q % 32) / 4;  // qh
    return 288 + h * 1536 + g * 192 + 128 + 4 * r + q % 4;
  }
}

template <typename F>
auto with_x16_format(int64_t qtype, const char* op, F&& f) {
  switch (qtype & ~kInterleaved16) {
    case kQ4_K: return f(std::integral_constant<int64_t, kQ4_K>{});
    case kQ6_K: return f(std::integral_constant<int64_t, kQ6_K>{});
    case kQ4_0: return f(std::integral_constant<int64_t, kQ4_0>{});
    case kQ8_0: return f(std::integral_constant<int64_t, kQ8_0>{});
    default: TORCH_CHECK(false, op, ": no 16-row interleaved layout for ggml type ", qtype & ~kInterleaved16);
  }
}

void check_x16(const at::Tensor& w, int64_t qtype, int64_t in_features, const char* op) {
  const int64_t base = qtype & ~kInterleaved16;
  check_weight(w, base, in_features, op);
  TORCH_CHECK(w.size(0) % kRows == 0, op, ": interleaved weights hold a multiple of 16 rows, got ", w.size(0));
  with_x16_format(base, op, [](auto) { return 0; });
}

// In place: each group of 16 rows from the layout as stored to the interleaved one.
void interleave16_(at::Tensor& w, int64_t qtype, int64_t in_features) {
  check_x16(w, qtype, in_features, "gguf_interleave16_");
  uint8_t* wp = w.data_ptr<uint8_t>();
  const int64_t row_bytes = w.size(1);
  with_x16_format(qtype, "gguf_interleave16_", [&](auto qt) {
    constexpr int64_t QT = decltype(qt)::value, bb = kBlockBytes<QT>;
    at::parallel_for(0, w.size(0) / kRows, 1, [&](int64_t g0, int64_t g1) {
      std::vector<uint8_t> plain(kRows * row_bytes);
      for (int64_t g = g0; g < g1; ++g) {
        uint8_t* group = wp + g * kRows * row_bytes;
        std::memcpy(plain.data(), group, plain.size());
        for (int64_t r = 0; r < kRows; ++r)
          for (int64_t b = 0; b < row_bytes / bb; ++b)
            for (int64_t i = 0; i < bb; ++i)
              group[b * kRows * bb + interleaved_offset<QT>(r, i)] = plain[r * row_bytes + b * bb + i];
      }
    });
    return 0;
  });
}

}  // namespace

at::Tensor deinterleave16(const at::Tensor& w, int64_t qtype, int64_t in_features,
                          const std::optional<at::Tensor>& rows) {
  check_x16(w, qtype, in_features, "gguf_deinterleave16");
  const at::Tensor ids = rows.has_value() ? rows->to(at::kLong).contiguous().view(-1)
                                          : at::arange(w.size(0), w.options().dtype(at::kLong));
  const int64_t row_bytes = w.size(1), n = ids.numel(), N = w.size(0);
  at::Tensor out = at::empty({n, row_bytes}, w.options());
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const int64_t* ip = ids.data_ptr<int64_t>();
  uint8_t* op = out.data_ptr<uint8_t>();
  for (int64_t j = 0; j < n; ++j) TORCH_CHECK(ip[j] >= 0 && ip[j] < N, "gguf_deinterleave16: row ", ip[j], " of ", N);
  with_x16_format(qtype, "gguf_deinterleave16", [&](auto qt) {
    constexpr int64_t QT = decltype(qt)::value, bb = kBlockBytes<QT>;
    at::parallel_for(0, n, 64, [&](int64_t j0, int64_t j1) {
      for (int64_t j = j0; j < j1; ++j) {
        const uint8_t* group = wp + (ip[j] / kRows) * kRows * row_bytes;
        const int64_t r = ip[j] % kRows;
        for (int64_t b = 0; b < row_bytes / bb; ++b)
          for (int64_t i = 0; i < bb; ++i)
            op[j * row_bytes + b * bb + i] = group[b * kRows * bb + interleaved_offset<QT>(r, i)];
      }
    });
    return 0;
  });
  return out;
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__F16C__)
#define TANDEM_X16_KERNEL 1
namespace {

using k8::Q8K;

inline __m512i load64(const uint8_t* p) { return _mm512_loadu_si512(reinterpret_cast<const void*>(p)); }
inline __m128i load16(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
// Four int8 activations in every 32-bit lane.
inline __m512i four(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}
// Two int16 values as one 32-bit lane, in every lane (vpdpwssd's pair).
inline __m512i pair16(int32_t lo, int32_t hi) {
  return _mm512_set1_epi32(static_cast<int32_t>((static_cast<uint32_t>(static_cast<uint16_t>(hi)) << 16) |
                                                static_cast<uint16_t>(lo)));
}
// Two planes of 16 bytes (a per row, b per row) as 16 lanes of the int16 pair (a, b).
inline __m512i plane_pairs(__m128i a, __m128i b, bool is_signed) {
  const __m256i bytes = _mm256_set_m128i(_mm_unpackhi_epi8(a, b), _mm_unpacklo_epi8(a, b));
  return is_signed ? _mm512_cvtepi8_epi16(bytes) : _mm512_cvtepu8_epi16(bytes);
}

#ifndef TANDEM_X16_PREFETCH
#define TANDEM_X16_PREFETCH 2
#endif
// Every line of the tile this many tiles ahead: one stream per thread, which the hardware prefetcher
// alone leaves short of the memory's bandwidth (a decode step reads each weight once).
inline void prefetch_ahead(const uint8_t* t, int64_t tb) {
  const char* ahead = reinterpret_cast<const char*>(t + TANDEM_X16_PREFETCH * tb);
  for (int64_t l = 0; l < tb; l += 64) _mm_prefetch(ahead + l, _MM_HINT_T0);
}

// One row's float steps over 16 outputs (k_quant_int8.h's Outputs, 16 lanes).
struct Out16 {
  __m512 acc = _mm512_setzero_ps(), off = _mm512_setzero_ps();
  void add(__m512 d_dx, __m512i sums, __m512 f_dx, __m512i offsets) {
    acc = _mm512_fmadd_ps(d_dx, _mm512_cvtepi32_ps(sums), acc);
    off = _mm512_fmadd_ps(f_dx, _mm512_cvtepi32_ps(offsets), off);
  }
  void store(float* y) const { _mm512_storeu_ps(y, _mm512_sub_ps(acc, off)); }
};

// Rows m .. m + R of x times the group's 16 weight rows (Q4_K).
template <int R>
void tile_q4k(const uint8_t* group, const Q8K& a, int64_t K, int64_t m, float* y, int64_t N) {
  constexpr int64_t tb = kRows * kBlockBytes<kQ4_K>;
  const __m512i nib = _mm512_set1_epi8(0x0F);
  const __m128i m6 = _mm_set1_epi8(63), m4 = _mm_set1_epi8(15), m2 = _mm_set1_epi8(3);
  Out16 out[R];
  for (int64_t b = 0; b < a.nb; ++b) {
    const uint8_t* t = group + b * tb;
    prefetch_ahead(t, tb);
    __m128i p[12], sc[8], mn[8];
    for (int j = 0; j < 12; ++j) p[j] = load16(t + 64 + 16 * j);
    for (int j = 0; j < 4; ++j) {  // ggml's get_scale_min_k4, 16 rows at once
      sc[j] = _mm_and_si128(p[j], m6);
      mn[j] = _mm_and_si128(p[j + 4], m6);
      const __m128i hs = _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(p[j], 6), m2), 4);
      const __m128i hm = _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(p[j + 4], 6), m2), 4);
      sc[j + 4] = _mm_or_si128(_mm_and_si128(p[j + 8], m4), hs);
      mn[j + 4] = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(p[j + 8], 4), m4), hm);
    }
    __m512i mins[4];  // each row's mins of sub-blocks 2 s, 2 s + 1 as one lane's int16 pair
    for (int s = 0; s < 4; ++s) mins[s] = plane_pairs(mn[2 * s], mn[2 * s + 1], false);
    __m512i sums[R], offs[R];
    for (int i = 0; i < R; ++i) {
      const int16_t* bs = a.bsum16.data() + ((m + i) * a.nb + b) * 16;
      offs[i] = _mm512_setzero_si512();
      for (int s = 0; s < 4; ++s)  // sum over sub-blocks of min * (x's sum over it)
        offs[i] = _mm512_dpwssd_epi32(offs[i], mins[s],
                                      pair16(bs[4 * s] + bs[4 * s + 1], bs[4 * s + 2] + bs[4 * s + 3]));
      sums[i] = _mm512_setzero_si512();
    }
    for (int c = 0; c < 4; ++c) {
      __m512i even[R], odd[R];
      for (int i = 0; i < R; ++i) even[i] = odd[i] = _mm512_setzero_si512();
      for (int g = 0; g < 8; ++g) {
        const __m512i v = load64(t + 256 + (8 * c + g) * 64);
        const __m512i lo = _mm512_and_si512(v, nib), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
        for (int i = 0; i < R; ++i) {
          const int8_t* xq = a.q.data() + (m + i) * K + b * 256 + 64 * c + 4 * g;
          even[i] = _mm512_dpbusd_epi32(even[i], lo, four(xq));
          odd[i] = _mm512_dpbusd_epi32(odd[i], hi, four(xq + 32));
        }
      }
      const __m512i se = _mm512_cvtepu8_epi32(sc[2 * c]), so = _mm512_cvtepu8_epi32(sc[2 * c + 1]);
      for (int i = 0; i < R; ++i)
        sums[i] = _mm512_add_epi32(sums[i], _mm512_add_epi32(_mm512_mullo_epi32(even[i], se),
                                                              _mm512_mullo_epi32(odd[i], so)));
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(t)));
    const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + 32)));
    for (int i = 0; i < R; ++i) {
      const __m512 dx = _mm512_set1_ps(a.d[(m + i) * a.nb + b]);
      out[i].add(_mm512_mul_ps(d, dx), sums[i], _mm512_mul_ps(dmin, dx), offs[i]);
    }
  }
  for (int i = 0; i < R; ++i) out[i].store(y + (m + i) * N);
}

// Rows m .. m + R of x times the group's 16 weight rows (Q6_K).
template <int R>
void tile_q6k(const uint8_t* group, const Q8K& a, int64_t K, int64_t m, float* y, int64_t N) {
  constexpr int64_t tb = kRows * kBlockBytes<kQ6_K>;
  const __m512i nib = _mm512_set1_epi8(0x0F), two = _mm512_set1_epi8(0x30);
  Out16 out[R];
  for (int64_t b = 0; b < a.nb; ++b) {
    const uint8_t* t = group + b * tb;
    prefetch_ahead(t, tb);
    __m128i sp[16];
    for (int s = 0; s < 16; ++s) sp[s] = load16(t + 32 + 16 * s);
    __m512i scales[8];  // each row's scales of groups 2 s, 2 s + 1 as one lane's int16 pair
    for (int s = 0; s < 8; ++s) scales[s] = plane_pairs(sp[2 * s], sp[2 * s + 1], true);
    __m512i sums[R], offs[R];
    for (int i = 0; i < R; ++i) {
      const int16_t* bs = a.bsum16.data() + ((m + i) * a.nb + b) * 16;
      offs[i] = _mm512_setzero_si512();
      for (int s = 0; s < 8; ++s)  // sum over groups of 16 of scale * (x's sum over it)
        offs[i] = _mm512_dpwssd_epi32(offs[i], scales[s], pair16(bs[2 * s], bs[2 * s + 1]));
      sums[i] = _mm512_setzero_si512();
    }
    for (int h = 0; h < 2; ++h)
      for (int half = 0; half < 2; ++half) {  // bytes 0-15 of the 32 (scales 8 h + 2 k), then 16-31 (+ 1)
        __m512i s1[R], s2[R], s3[R], s4[R];
        for (int i = 0; i < R; ++i) s1[i] = s2[i] = s3[i] = s4[i] = _mm512_setzero_si512();
        for (int g = 4 * half; g < 4 * half + 4; ++g) {
          const uint8_t* base = t + 288 + h * 1536 + g * 192;
          const __m512i A = load64(base), B = load64(base + 64), H = load64(base + 128);
          const __m512i q1 = _mm512_or_si512(_mm512_and_si512(A, nib), _mm512_and_si512(_mm512_slli_epi16(H, 4), two));
          const __m512i q2 = _mm512_or_si512(_mm512_and_si512(B, nib), _mm512_and_si512(_mm512_slli_epi16(H, 2), two));
          const __m512i q3 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(A, 4), nib), _mm512_and_si512(H, two));
          const __m512i q4 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(B, 4), nib),
                                             _mm512_and_si512(_mm512_srli_epi16(H, 2), two));
          for (int i = 0; i < R; ++i) {
            const int8_t* xq = a.q.data() + (m + i) * K + b * 256 + 128 * h + 4 * g;
            s1[i] = _mm512_dpbusd_epi32(s1[i], q1, four(xq));
            s2[i] = _mm512_dpbusd_epi32(s2[i], q2, four(xq + 32));
            s3[i] = _mm512_dpbusd_epi32(s3[i], q3, four(xq + 64));
            s4[i] = _mm512_dpbusd_epi32(s4[i], q4, four(xq + 96));
          }
        }
        const int s = 8 * h + half;
        const __m512i c1 = _mm512_cvtepi8_epi32(sp[s]), c2 = _mm512_cvtepi8_epi32(sp[s + 2]);
        const __m512i c3 = _mm512_cvtepi8_epi32(sp[s + 4]), c4 = _mm512_cvtepi8_epi32(sp[s + 6]);
        for (int i = 0; i < R; ++i) {
          const __m512i lo = _mm512_add_epi32(_mm512_mullo_epi32(s1[i], c1), _mm512_mullo_epi32(s2[i], c2));
          const __m512i hi = _mm512_add_epi32(_mm512_mullo_epi32(s3[i], c3), _mm512_mullo_epi32(s4[i], c4));
          sums[i] = _mm512_add_epi32(sums[i], _mm512_add_epi32(lo, hi));
        }
      }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(t)));
    const __m512 f = _mm512_mul_ps(_mm512_set1_ps(32.0f), d);  // the quants' -32 (k_quant_int8.h's offset_factor)
    for (int i = 0; i < R; ++i) {
      const __m512 dx = _mm512_set1_ps(a.d[(m + i) * a.nb + b]);
      out[i].add(_mm512_mul_ps(d, dx), sums[i], _mm512_mul_ps(f, dx), offs[i]);
    }
  }
  for (int i = 0; i < R; ++i) out[i].store(y + (m + i) * N);
}

// x's rows quantized per 32 (quant_linear_q8.cpp's values: int8_blocks, the scaled sum d * sum(q)).
struct Q8Rows {
  std::vector<int8_t> q;
  std::vector<float> d, s;    // [rows, blocks]
  std::vector<int32_t> sum;  // [rows, blocks]: sum(q)
  int64_t nb = 0;
};

Q8Rows quantize_rows32(const at::Tensor& x) {
  const int64_t K = x.size(1), M = x.size(0);
  Q8Rows r;
  r.nb = K / kChunk;
  r.q.resize(M * K);
  r.d.resize(M * r.nb);
  r.s.resize(M * r.nb);
  r.sum.resize(M * r.nb);
  int8_blocks::for_each_row(x, [&](const auto* row, int64_t m) {
    for (int64_t b = 0; b < r.nb; ++b) {
      int8_t* q = r.q.data() + m * K + b * kChunk;
      int32_t sum;
      const float d = int8_blocks::quantize_block(row + b * kChunk, kChunk, q, sum);
      r.d[m * r.nb + b] = d, r.sum[m * r.nb + b] = sum, r.s[m * r.nb + b] = d * static_cast<float>(sum);
    }
  });
  return r;
}

// Rows m .. m + R of x times the group's 16 weight rows (Q4_0, Q8_0: one scale per block of 32).
template <int64_t QT, int R>
void tile_32(const uint8_t* group, const Q8Rows& a, int64_t K, int64_t m, float* y, int64_t N) {
  constexpr int64_t tb = kRows * kBlockBytes<QT>;
  const __m512i nib = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 acc[R], off[R];
  for (int i = 0; i < R; ++i) acc[i] = off[i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < a.nb; ++b) {
    const uint8_t* t = group + b * tb;
    prefetch_ahead(t, tb);
    __m512i s0[R], s1[R];  // two chains of sums, added at the block's end (exact)
    for (int i = 0; i < R; ++i) s0[i] = s1[i] = _mm512_setzero_si512();
    for (int g = 0; g < (QT == kQ4_0 ? 4 : 8); ++g) {
      const __m512i v = load64(t + 32 + 64 * g);
      if constexpr (QT == kQ4_0) {
        const __m512i lo = _mm512_and_si512(v, nib), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
        for (int i = 0; i < R; ++i) {
          const int8_t* xq = a.q.data() + (m + i) * K + b * kChunk + 4 * g;
          s0[i] = _mm512_dpbusd_epi32(s0[i], lo, four(xq));
          s1[i] = _mm512_dpbusd_epi32(s1[i], hi, four(xq + 16));
        }
      } else {
        const __m512i u = _mm512_xor_si512(v, flip);  // q + 128
        for (int i = 0; i < R; ++i) {
          const int8_t* xq = a.q.data() + (m + i) * K + b * kChunk + 4 * g;
          if (g % 2) s1[i] = _mm512_dpbusd_epi32(s1[i], u, four(xq));
          else s0[i] = _mm512_dpbusd_epi32(s0[i], u, four(xq));
        }
      }
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(t)));
    for (int i = 0; i < R; ++i) {
      const int64_t xb = (m + i) * a.nb + b;
      __m512i sum = _mm512_add_epi32(s0[i], s1[i]);
      if constexpr (QT == kQ8_0) sum = _mm512_sub_epi32(sum, _mm512_set1_epi32(128 * a.sum[xb]));
      acc[i] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(a.d[xb])), _mm512_cvtepi32_ps(sum), acc[i]);
      if constexpr (QT == kQ4_0)
        off[i] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(-8.0f), d), _mm512_set1_ps(a.s[xb]), off[i]);
    }
  }
  for (int i = 0; i < R; ++i) _mm512_storeu_ps(y + (m + i) * N, _mm512_add_ps(acc[i], off[i]));
}

template <int64_t QT, int R, typename X>
void tile(const uint8_t* group, const X& a, int64_t K, int64_t m, float* y, int64_t N) {
  if constexpr (QT == kQ4_K) tile_q4k<R>(group, a, K, m, y, N);
  else if constexpr (QT == kQ6_K) tile_q6k<R>(group, a, K, m, y, N);
  else tile_32<QT, R>(group, a, K, m, y, N);
}

constexpr int64_t kRowBlock = 64;

template <int64_t QT, typename X>
void linear_groups(const uint8_t* w, int64_t row_bytes, const X& a, int64_t M, int64_t K, int64_t N, float* y) {
  at::parallel_for(0, N / kRows, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t mb = 0; mb < M; mb += kRowBlock) {
      const int64_t mend = std::min(M, mb + kRowBlock);
      for (int64_t g = g0; g < g1; ++g) {
        const uint8_t* group = w + g * kRows * row_bytes;
        float* yg = y + g * kRows;
        int64_t m = mb;
        for (; m + 4 <= mend; m += 4) tile<QT, 4>(group, a, K, m, yg, N);
        for (; m + 2 <= mend; m += 2) tile<QT, 2>(group, a, K, m, yg, N);
        for (; m < mend; ++m) tile<QT, 1>(group, a, K, m, yg, N);
      }
    }
  });
}

}  // namespace
#endif

at::Tensor interleaved16_linear_q8(const at::Tensor& x, const at::Tensor& w, int64_t qtype, int64_t in_features) {
  check_x16(w, qtype, in_features, "gguf_linear_q8");
  const int64_t M = x.size(0), K = in_features, N = w.size(0);
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
#if defined(TANDEM_X16_KERNEL)
  if (M == 0) return y;
  with_x16_format(qtype, "gguf_linear_q8", [&](auto qt) {
    constexpr int64_t QT = decltype(qt)::value;
    if constexpr (QT == kQ4_K || QT == kQ6_K) {
      linear_groups<QT>(w.data_ptr<uint8_t>(), w.size(1), k8::quantize_rows(x), M, K, N, y.data_ptr<float>());
    } else {
      linear_groups<QT>(w.data_ptr<uint8_t>(), w.size(1), quantize_rows32(x), M, K, N, y.data_ptr<float>());
    }
    return 0;
  });
  return y;
#else
  TORCH_CHECK(false, "gguf_linear_q8: interleaved weights need AVX512-VNNI, which this build lacks");
#endif
}

namespace {

bool interleave16_supported(int64_t qtype) {
#if defined(TANDEM_X16_KERNEL)
  return qtype == kQ4_K || qtype == kQ6_K || qtype == kQ4_0 || qtype == kQ8_0;
#else
  (void)qtype;
  return false;
#endif
}

}  // namespace
}  // namespace tandem_ops

TORCH_LIBRARY_FRAGMENT(tandem, m) {
  m.def("gguf_interleave16_(Tensor(a!) w, int qtype, int in_features) -> ()");
  m.def("gguf_deinterleave16(Tensor w, int qtype, int in_features, Tensor? rows=None) -> Tensor");
  // No tensor to dispatch on: one kernel for every backend.
  m.def("gguf_interleave16_supported(int qtype) -> bool", &tandem_ops::interleave16_supported);
}

TORCH_LIBRARY_IMPL(tandem, CPU, m) {
  m.impl("gguf_interleave16_", &tandem_ops::interleave16_);
  m.impl("gguf_deinterleave16", &tandem_ops::deinterleave16);
}
