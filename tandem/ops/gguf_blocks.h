// GGUF's block-quantized weight layouts as the kernels read them, shared by the float- and
// int8-activation kernels: one row of blocks per output column, a block holding 32 weights along K
// (Q4_0, Q4_1, Q5_0, Q8_0, MXFP4) or a 256-weight K-quant super-block (Q4_K, Q5_K, Q6_K) of eight
// sub-blocks of 32.
//
// The kernels see every format the same way: a block is chunks of 32 weights (one, or eight), and
// each half of a chunk (16 weights) is w = d * q + m with its own d and m (only Q6_K's halves
// differ: it has a scale per 16 weights), q a byte in K order (unsigned, or signed for Q8_0 and
// Q6_K, whose m is 0). The scales are decoded once per block (block_scales), the quants one chunk
// at a time (chunk_quant, or chunk_quants in registers). Each w is exact in float32 except the
// K-quants' d * q + m, which rounds once, as gguf-py's d * q - dm does.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define TANDEM_QUANT_AVX2 1
#endif

// How many weight tiles ahead a kernel prefetches: the weights stream from memory once per call.
#ifndef TANDEM_PREFETCH_TILES
#define TANDEM_PREFETCH_TILES 2
#endif

namespace tandem_ops {
namespace gguf {

constexpr int64_t kChunk = 32;  // weights decoded at a time; also the int8 activations' block
constexpr int64_t kPrefetchTiles = TANDEM_PREFETCH_TILES;
// ggml type ids.
constexpr int64_t kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14, kMXFP4 = 39;
// MXFP4 (OCP microscaling, gpt-oss's experts): a 4-bit E2M1 code per weight, its value doubled so that
// it is an integer (ggml's kvalues_mxfp4), and an E8M0 scale per block, halved to match.
constexpr int8_t kMxfp4Values[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

template <int64_t QT>
constexpr int64_t kBlockWeights = QT == kQ4_K || QT == kQ5_K || QT == kQ6_K ? 256 : 32;
template <int64_t QT>
constexpr int64_t kBlockBytes = QT == kQ4_0   ? 18   // fp16 d, 16 bytes of nibbles
                                : QT == kQ4_1 ? 20   // fp16 d, fp16 m, 16 bytes of nibbles
                                : QT == kQ5_0 ? 22   // fp16 d, 32 high bits, 16 bytes of nibbles
                                : QT == kQ8_0 ? 34   // fp16 d, 32 int8
                                : QT == kMXFP4 ? 17  // E8M0 exponent, 16 bytes of nibbles
                                : QT == kQ4_K ? 144  // fp16 d, fp16 dmin, 12 bytes of 6-bit scales/mins, 128 of nibbles
                                : QT == kQ5_K ? 176  // as Q4_K, and 32 bytes of high bits before the nibbles
                                              : 210;  // Q6_K: 128 bytes of low nibbles, 64 of 2-bit highs, 16 int8 scales, fp16 d
template <int64_t QT>
constexpr int64_t kChunks = kBlockWeights<QT> / kChunk;
template <int64_t QT>
constexpr bool kSignedQuants = QT == kQ8_0 || QT == kQ6_K || QT == kMXFP4;
template <int64_t QT>
constexpr bool kHalfScales = QT == kQ6_K;  // a scale per 16 weights, not per 32

// Calls f(std::integral_constant<int64_t, QT>{}) for the format of a runtime qtype.
template <typename F>
auto with_format(int64_t qtype, const char* op, F&& f) {
  switch (qtype) {
    case kQ4_0: return f(std::integral_constant<int64_t, kQ4_0>{});
    case kQ4_1: return f(std::integral_constant<int64_t, kQ4_1>{});
    case kQ5_0: return f(std::integral_constant<int64_t, kQ5_0>{});
    case kQ8_0: return f(std::integral_constant<int64_t, kQ8_0>{});
    case kQ4_K: return f(std::integral_constant<int64_t, kQ4_K>{});
    case kQ5_K: return f(std::integral_constant<int64_t, kQ5_K>{});
    case kQ6_K: return f(std::integral_constant<int64_t, kQ6_K>{});
    case kMXFP4: return f(std::integral_constant<int64_t, kMXFP4>{});
    default: TORCH_CHECK(false, op, ": unsupported ggml type ", qtype);
  }
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

// An E8M0 exponent as 2^(e - 128): the block's scale halved, as the doubled codes need (exact in float32,
// a subnormal for e < 2; ggml's GGML_E8M0_TO_FP32_HALF).
inline float e8m0_half(uint8_t e) {
  const uint32_t bits = e < 2 ? 0x00200000u << e : static_cast<uint32_t>(e - 1) << 23;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// A block's scales: w = d[c][h] * q + m[c][h] for half h (weights 16h to 16h + 15) of chunk c.
template <int64_t QT>
struct Scales {
  float d[kChunks<QT>][2], m[kChunks<QT>][2];
};

// The K-quants' 6-bit scale and min of sub-block j, packed in 12 bytes (ggml's get_scale_min_k4):
// bytes 0-3 and 4-7 hold sub-blocks 0-3's scales and mins and the top two bits of sub-blocks 4-7's,
// bytes 8-11 the low four bits of sub-blocks 4-7's (scale in the low nibble, min in the high one).
inline void k_scale_min(const uint8_t* s, int j, int& scale, int& min) {
  if (j < 4) {
    scale = s[j] & 63;
    min = s[j + 4] & 63;
  } else {
    scale = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
    min = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// All eight at once, four sub-blocks a 32-bit word (what k_scale_min reads one at a time): 0-3 in the low
// six bits of words 0 (scales) and 1 (mins), 4-7 in word 2's nibbles with their top two bits in the top
// bits of words 0 and 1.
inline void k_scales_mins(const uint8_t* s, uint8_t scale[8], uint8_t min[8]) {
  uint32_t u[3];
  std::memcpy(u, s, 12);
  const uint32_t low6 = 0x3F3F3F3Fu, nib = 0x0F0F0F0Fu, top2 = 0x03030303u;
  const uint32_t sc[2] = {u[0] & low6, (u[2] & nib) | (((u[0] >> 6) & top2) << 4)};
  const uint32_t mn[2] = {u[1] & low6, ((u[2] >> 4) & nib) | (((u[1] >> 6) & top2) << 4)};
  std::memcpy(scale, sc, 8);
  std::memcpy(min, mn, 8);
}

template <int64_t QT>
inline Scales<QT> block_scales(const uint8_t* b) {
  Scales<QT> s;
  if constexpr (QT == kQ4_K || QT == kQ5_K) {
    const float d = half_at(b), dmin = half_at(b + 2);
    uint8_t scale[8], min[8];
    k_scales_mins(b + 4, scale, min);
    for (int c = 0; c < 8; ++c) {
      s.d[c][0] = s.d[c][1] = d * static_cast<float>(scale[c]);
      s.m[c][0] = s.m[c][1] = -(dmin * static_cast<float>(min[c]));
    }
  } else if constexpr (QT == kQ6_K) {
    const float d = half_at(b + 208);
    for (int c = 0; c < 8; ++c)
      for (int h = 0; h < 2; ++h) {
        s.d[c][h] = d * static_cast<float>(static_cast<int8_t>(b[192 + 2 * c + h]));
        s.m[c][h] = 0.0f;
      }
  } else if constexpr (QT == kMXFP4) {
    s.d[0][0] = s.d[0][1] = e8m0_half(b[0]);
    s.m[0][0] = s.m[0][1] = 0.0f;
  } else {
    const float d = half_at(b);
    // Q4_0 and Q5_0 centre their quants (q - 8, q - 16) as an offset, exact in float32.
    const float m = QT == kQ4_1 ? half_at(b + 2) : QT == kQ4_0 ? -8.0f * d : QT == kQ5_0 ? -16.0f * d : 0.0f;
    s.d[0][0] = s.d[0][1] = d;
    s.m[0][0] = s.m[0][1] = m;
  }
  return s;
}

// Quant k (in [0, 32)) of chunk c of a block, one at a time (the portable paths').
template <int64_t QT>
inline int32_t chunk_quant(const uint8_t* b, int c, int64_t k) {
  if constexpr (QT == kQ8_0) return static_cast<int8_t>(b[2 + k]);
  // 16 bytes of nibbles: low ones are weights 0-15, high ones 16-31.
  const auto nibble16 = [&](const uint8_t* qs) { return k < 16 ? (qs[k] & 0x0F) : (qs[k - 16] >> 4); };
  if constexpr (QT == kQ4_0) return nibble16(b + 2);
  if constexpr (QT == kQ4_1) return nibble16(b + 4);
  if constexpr (QT == kMXFP4) return kMxfp4Values[nibble16(b + 1)];
  if constexpr (QT == kQ5_0) {
    uint32_t high;
    std::memcpy(&high, b + 2, 4);
    return nibble16(b + 6) | static_cast<int32_t>(((high >> k) & 1) << 4);
  }
  if constexpr (QT == kQ4_K) return (b[16 + 32 * (c / 2) + k] >> (4 * (c % 2))) & 0x0F;  // chunk pairs share bytes
  if constexpr (QT == kQ5_K) return ((b[48 + 32 * (c / 2) + k] >> (4 * (c % 2))) & 0x0F) | (((b[16 + k] >> c) & 1) << 4);
  // Q6_K: chunks 0-3 and 4-7 each read 64 bytes of nibbles (chunks 0, 1 the low ones, 2, 3 the high
  // ones) and 32 bytes of 2-bit highs (chunk c % 4's at bit 2 * (c % 4)).
  const int low = (b[64 * (c / 4) + 32 * (c % 2) + k] >> (4 * ((c % 4) / 2))) & 0x0F;
  const int high = (b[128 + 32 * (c / 4) + k] >> (2 * (c % 4))) & 3;
  return (low | (high << 4)) - 32;
}

#if defined(TANDEM_QUANT_AVX2)
inline __m256i load32(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// Bytes >> n (n in [0, 8)), then & mask: 16-bit shifts move neighbours' bits only into bits the mask clears.
inline __m256i shifted_bits(__m256i v, int n, int mask) {
  return _mm256_and_si256(_mm256_srl_epi16(v, _mm_cvtsi32_si128(n)), _mm256_set1_epi8(static_cast<char>(mask)));
}

inline __m256i nibbles16(const uint8_t* qs) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(0x0F));
}

// 16 where bit k of the 32-bit little-endian word at p is set, for byte k: byte k takes the word's
// byte k / 8 and tests bit k % 8.
inline __m256i high_bits32(const uint8_t* p) {
  uint32_t word;
  std::memcpy(&word, p, 4);
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int>(word)),
      _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(16));
}

// Chunk c's 32 quants as bytes in K order (signed for kSignedQuants), as chunk_quant gives them.
template <int64_t QT>
inline __m256i chunk_quants(const uint8_t* b, int c) {
  if constexpr (QT == kQ8_0) return load32(b + 2);
  if constexpr (QT == kQ4_0) return nibbles16(b + 2);
  if constexpr (QT == kQ4_1) return nibbles16(b + 4);
  if constexpr (QT == kMXFP4) {  // each code looked up in the table (both lanes hold it)
    const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kMxfp4Values)));
    return _mm256_shuffle_epi8(table, nibbles16(b + 1));
  }
  if constexpr (QT == kQ5_0) return _mm256_or_si256(nibbles16(b + 6), high_bits32(b + 2));
  if constexpr (QT == kQ4_K) return shifted_bits(load32(b + 16 + 32 * (c / 2)), 4 * (c % 2), 0x0F);
  if constexpr (QT == kQ5_K) {
    const __m256i high = _mm256_slli_epi16(shifted_bits(load32(b + 16), c, 1), 4);
    return _mm256_or_si256(shifted_bits(load32(b + 48 + 32 * (c / 2)), 4 * (c % 2), 0x0F), high);
  }
  // Q6_K
  const __m256i low = shifted_bits(load32(b + 64 * (c / 4) + 32 * (c % 2)), 4 * ((c % 4) / 2), 0x0F);
  const __m256i high = _mm256_slli_epi16(shifted_bits(load32(b + 128 + 32 * (c / 4)), 2 * (c % 4), 3), 4);
  return _mm256_sub_epi8(_mm256_or_si256(low, high), _mm256_set1_epi8(32));
}

// Lane i of the result: the sum of v[i]'s eight lanes, for n <= 8 vectors (exact integers, so the order
// of the adds does not matter).
inline __m256i lane_sums(const __m256i* v, int n) {
  __m256i u[8];
  for (int i = 0; i < 8; ++i) u[i] = i < n ? v[i] : _mm256_setzero_si256();
  const __m256i lo = _mm256_hadd_epi32(_mm256_hadd_epi32(u[0], u[1]), _mm256_hadd_epi32(u[2], u[3]));
  const __m256i hi = _mm256_hadd_epi32(_mm256_hadd_epi32(u[4], u[5]), _mm256_hadd_epi32(u[6], u[7]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(lo, hi, 0x20), _mm256_permute2x128_si256(lo, hi, 0x31));
}
#endif

inline int64_t block_weights(int64_t qtype, const char* op) {
  return with_format(qtype, op, [](auto qt) { return kBlockWeights<decltype(qt)::value>; });
}

inline int64_t block_bytes(int64_t qtype, const char* op) {
  return with_format(qtype, op, [](auto qt) { return kBlockBytes<decltype(qt)::value>; });
}

// How many cache lines of the weights to prefetch per block of a tile of NR rows (its bytes, and
// one more for a block that straddles a line).
template <int64_t QT, int NR>
constexpr int kPrefetchLines = std::max<int64_t>(2, NR * kBlockBytes<QT> / 64 + 1);

inline void check_weight(const at::Tensor& w, int64_t qtype, int64_t in_features, const char* op) {
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous(), op,
              ": weight must be contiguous uint8 [out_features, blocks * block_bytes] on the CPU");
  const int64_t bw = block_weights(qtype, op), row_bytes = in_features / bw * block_bytes(qtype, op);
  TORCH_CHECK(in_features > 0 && in_features % bw == 0, op, ": in_features must be a multiple of ", bw, ", got ",
              in_features);
  TORCH_CHECK(w.size(1) == row_bytes, op, ": weight rows hold ", w.size(1), " bytes, expected ", row_bytes);
}

inline void check_activations(const at::Tensor& x, int64_t in_features, const char* op) {
  TORCH_CHECK(x.device().is_cpu() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16), op,
              ": x must be float32 or bfloat16 on the CPU");
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == in_features, op, ": x has ", x.dim() ? x.size(-1) : 0,
              " features, expected ", in_features);
}

// y [..., N] from y2d [M, N]: x's leading shape, x's dtype, the bias added in float32.
inline at::Tensor finish_output(at::Tensor y, const at::Tensor& x_in, const std::optional<at::Tensor>& bias) {
  if (bias.has_value()) y.add_(bias->to(at::kFloat));
  std::vector<int64_t> shape(x_in.sizes().begin(), x_in.sizes().end());
  shape.back() = y.size(1);
  return y.to(x_in.scalar_type()).view(shape);
}

// Walks the [M, N] output in tiles, calling run(MR, NR, m0, n0) with MR and NR as integral_constants:
// rows of x in groups of up to four, weight rows in pairs (four at a time for one row, where no weight
// block is reused across rows and more independent accumulators keep the FMAs busy; with AVX2, four
// rows meet one weight row at a time and the last two or three rows form one tile, measured 1.9x
// faster at three rows, a speculative verification's shape). Threads split the weight rows, so each
// output is computed the same way whatever the thread count or the tiling.
// kEightRows: with AVX2, eight rows meet one weight row where the kernel's tile holds their eight
// accumulators and a chunk's converted weights in the 16 registers (the float kernel's), so a weight
// chunk is converted once for a batch of eight rather than twice.
template <bool kEightRows = false, typename Run>
void for_each_tile(int64_t M, int64_t N, Run&& run) {
  using One = std::integral_constant<int, 1>;
  using Two = std::integral_constant<int, 2>;
  using Three = std::integral_constant<int, 3>;
  using Four = std::integral_constant<int, 4>;
  using Eight = std::integral_constant<int, 8>;
  at::parallel_for(0, (N + 3) / 4, 8, [&](int64_t t0, int64_t t1) {
    const int64_t n_end = std::min(N, t1 * 4);
    for (int64_t n0 = t0 * 4; n0 < n_end;) {
      if (M == 1 && n0 + 4 <= n_end) {
        run(One{}, Four{}, 0, n0);
        n0 += 4;
        continue;
      }
      const bool pair = n0 + 2 <= n_end;
      int64_t m0 = 0;
#if defined(__AVX512F__)
      for (; m0 + 4 <= M; m0 += 4) pair ? run(Four{}, Two{}, m0, n0) : run(Four{}, One{}, m0, n0);
#else
      // 16 ymm registers: a 4 x 2 tile's 16 accumulators would spill, so four rows meet one weight row.
      if constexpr (kEightRows) {
        for (; m0 + 8 <= M; m0 += 8) {
          run(Eight{}, One{}, m0, n0);
          if (pair) run(Eight{}, One{}, m0, n0 + 1);
        }
      }
      for (; m0 + 4 <= M; m0 += 4) {
        run(Four{}, One{}, m0, n0);
        if (pair) run(Four{}, One{}, m0, n0 + 1);
      }
      // The last two or three rows as one tile too (a verification step's rows), not one by one.
      if (M - m0 >= 2) {
        for (int64_t j = 0; j < (pair ? 2 : 1); ++j)
          M - m0 == 3 ? run(Three{}, One{}, m0, n0 + j) : run(Two{}, One{}, m0, n0 + j);
        m0 = M;
      }
#endif
      for (; m0 < M; ++m0) pair ? run(One{}, Two{}, m0, n0) : run(One{}, One{}, m0, n0);
      n0 += pair ? 2 : 1;
    }
  });
}

}  // namespace gguf
}  // namespace tandem_ops
