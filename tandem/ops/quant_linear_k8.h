// K-quant weights times int8 activations quantized per 256 (quant_linear_k8.cpp): the int8 arithmetic
// gguf_linear_q8 uses for Q4_K, Q5_K and Q6_K.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace tandem_ops {

bool is_k_quant(int64_t qtype);

// x [M, in_features] (float32 or bfloat16, contiguous) times the blocks of w: float32 [M, out_features].
at::Tensor k_quant_linear_q8(const at::Tensor& x, const at::Tensor& w, int64_t qtype, int64_t in_features);

}  // namespace tandem_ops
