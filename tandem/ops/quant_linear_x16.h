// Weights interleaved by 16 rows at load (quant_linear_x16.cpp): Q4_K, Q6_K, Q4_0 and Q8_0 blocks whose
// bytes are permuted within each group of 16 output rows so that one 64-byte load holds four quant
// bytes of each of the 16 rows, the layout VNNI's vpdpbusd multiplies against a broadcast of four
// activations. A qtype with kInterleaved16 set names a weight in this layout.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>

namespace tandem_ops {

constexpr int64_t kInterleaved16 = 1 << 8;

inline bool is_interleaved16(int64_t qtype) { return (qtype & kInterleaved16) != 0; }

// The plain blocks of w's rows (all of them, or rows): [rows, row_bytes], the layout as stored.
at::Tensor deinterleave16(const at::Tensor& w, int64_t qtype, int64_t in_features,
                          const std::optional<at::Tensor>& rows);

// x [M, in_features] (float32 or bfloat16, contiguous) times interleaved w: float32 [M, out_features],
// every output the value quant_linear_k8.cpp gives for the same blocks as stored.
at::Tensor interleaved16_linear_q8(const at::Tensor& x, const at::Tensor& w, int64_t qtype, int64_t in_features);

}  // namespace tandem_ops
