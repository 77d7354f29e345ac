// GGUF's block-quantized weight layouts as the kernels read them (Q4_0, Q4_1, Q8_0: 32 weights along K
// per block, one row of blocks per output column), shared by the float- and int8-activation kernels.
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

constexpr int64_t kBlock = 32;
constexpr int64_t kPrefetchTiles = TANDEM_PREFETCH_TILES;
// ggml type ids.
constexpr int64_t kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8;

template <int64_t QT>
constexpr int64_t kBlockBytes = QT == kQ4_0 ? 18 : QT == kQ4_1 ? 20 : 34;

inline int64_t block_bytes(int64_t qtype) {
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

// One weight block's scale, offset (the weight of q = 0) and the address of its quants: w = d * q + m.
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

// Quant k of a block (k in [0, 32)): low nibbles are weights 0-15, high ones 16-31; Q8_0 signed.
template <int64_t QT>
inline int32_t quant_at(const uint8_t* qs, int64_t k) {
  if constexpr (QT == kQ8_0) return static_cast<int8_t>(qs[k]);
  return k < 16 ? (qs[k] & 0x0F) : (qs[k - 16] >> 4);
}

inline void check_weight(const at::Tensor& w, int64_t qtype, int64_t in_features, const char* op) {
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous(), op,
              ": weight must be contiguous uint8 [out_features, blocks * block_bytes] on the CPU");
  TORCH_CHECK(in_features > 0 && in_features % kBlock == 0, op, ": in_features must be a multiple of 32, got ",
              in_features);
  TORCH_CHECK(w.size(1) == in_features / kBlock * block_bytes(qtype), op, ": weight rows hold ", w.size(1),
              " bytes, expected ", in_features / kBlock * block_bytes(qtype));
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
template <typename Run>
void for_each_tile(int64_t M, int64_t N, Run&& run) {
  using One = std::integral_constant<int, 1>;
  using Two = std::integral_constant<int, 2>;
  using Three = std::integral_constant<int, 3>;
  using Four = std::integral_constant<int, 4>;
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
