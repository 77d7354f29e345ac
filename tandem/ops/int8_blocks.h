// Activations as the int8-activation kernels read them (quant_linear_q8.cpp per 32, ggml's Q8_0/Q8_1;
// quant_linear_k8.cpp per 256, ggml's Q8_K): each block's values over its largest magnitude / 127,
// rounded half to even. One definition, so the kernels and q8_roundtrip (the same values in float32,
// for a caller's GEMM or a test's reference) agree to the bit.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace tandem_ops {
namespace int8_blocks {

// x's n values into q; returns the block's scale.
template <typename T>
inline float quantize_block(const T* x, int64_t n, int8_t* q) {
  float amax = 0.0f;
  for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(static_cast<float>(x[i])));
  const float scale = amax / 127.0f;
  const float inv = scale > 0.0f ? 1.0f / scale : 0.0f;
  // nearbyint rounds half to even, as torch.round does in the PyTorch fallback.
  for (int64_t i = 0; i < n; ++i) q[i] = static_cast<int8_t>(std::nearbyint(static_cast<float>(x[i]) * inv));
  return scale;
}

// The same, and the sum of the block's int8 values (ggml's Q8_1 keeps d * sum beside d).
template <typename T>
inline float quantize_block(const T* x, int64_t n, int8_t* q, int32_t& sum) {
  const float scale = quantize_block(x, n, q);
  sum = 0;
  for (int64_t i = 0; i < n; ++i) sum += q[i];
  return scale;
}

// Calls f(row pointer, m) for each row of x (float32 or bfloat16), rows split across threads.
template <typename F>
inline void for_each_row(const at::Tensor& x, F&& f) {
  const int64_t M = x.size(0), K = x.size(1);
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      if (x.scalar_type() == at::kFloat) {
        f(x.data_ptr<float>() + m * K, m);
      } else {
        f(x.data_ptr<at::BFloat16>() + m * K, m);
      }
    }
  });
}

// x as its per-block int8 quantization stands for it, in float32 (block 32 or 256).
inline at::Tensor roundtrip(const at::Tensor& x_in, int64_t block) {
  TORCH_CHECK(x_in.device().is_cpu() && (x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16),
              "q8_roundtrip: x must be float32 or bfloat16 on the CPU");
  TORCH_CHECK(block == 32 || block == 256, "q8_roundtrip: block must be 32 or 256, got ", block);
  const int64_t K = x_in.size(-1);
  TORCH_CHECK(K % block == 0, "q8_roundtrip: the last dimension must be a multiple of ", block, ", got ", K);
  const at::Tensor x = x_in.reshape({-1, K}).contiguous();
  at::Tensor out = at::empty({x.size(0), K}, x.options().dtype(at::kFloat));
  float* op = out.data_ptr<float>();
  for_each_row(x, [&](const auto* row, int64_t m) {
    std::vector<int8_t> q(block);
    for (int64_t b = 0; b < K / block; ++b) {
      const float scale = quantize_block(row + b * block, block, q.data());
      for (int64_t k = 0; k < block; ++k) op[m * K + b * block + k] = scale * static_cast<float>(q[k]);
    }
  });
  return out.view(x_in.sizes());
}

}  // namespace int8_blocks
}  // namespace tandem_ops
