// What Tandem's paged attention ops share, decode (paged_attention.cpp) and prefill (paged_prefill.cpp,
// paged_prefill_brgemm.cpp) alike: the checks of their inputs, the fields of their parameter structs,
// the packing of q, the sliding window's first key, Gemma-style soft-capping of scores, and the
// int8 KV row's scale size (tandem/kv/layout.py). The per-block decode steps are in decode_blocks.h.
#pragma once

#include <ATen/ATen.h>

#include "simd.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

namespace tandem_ops {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// int8 KV rows (tandem/kv/layout.py): d int8 values, then the row's float32 scale.
constexpr int64_t kScaleBytes = 4;

// q as the kernels read it: token rows may be any distance apart (a view of a fused qkv
// projection is used in place), but each row's heads must be packed; anything else is copied.
inline at::Tensor packed_rows(const at::Tensor& q) {
  return q.stride(2) == 1 && q.stride(1) == q.size(2) ? q : q.contiguous();
}

// The checks the decode and prefill ops share: q [T, H, D], the K/V pool, int32 block tables of
// one row per sequence, and the output buffer the kernels write rows of ([T, H, D] like q, contiguous).
inline void check_attention_inputs(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                   const at::Tensor& block_tables, int64_t n_seqs, const at::Tensor& out,
                                   const char* op, bool int8_rows_ok = false) {
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu(), op,
              ": CPU tensors expected");
  TORCH_CHECK(q.dim() == 3, op, ": q must be [tokens, H, D]");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), op,
              ": k_cache/v_cache must both be [num_blocks, block_size, KVH, D]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), op, ": k_cache/v_cache must be contiguous");
  const bool int8_rows = int8_rows_ok && k_cache.scalar_type() == at::kChar;
  TORCH_CHECK((int8_rows || q.scalar_type() == k_cache.scalar_type()) && v_cache.scalar_type() == k_cache.scalar_type(),
              op, ": k_cache and v_cache must share q's dtype", int8_rows_ok ? " (or be int8 rows)" : "");
  const int64_t H = q.size(1), D = q.size(2), KVH = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == (int8_rows ? D + kScaleBytes : D) && D % 16 == 0 && D > 0, op,
              ": head_dim must match and be a multiple of 16 (int8 rows: head_dim + 4 bytes)");
  TORCH_CHECK(KVH > 0 && H % KVH == 0, op, ": num heads must be a multiple of num kv heads");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 && block_tables.size(0) == n_seqs,
              op, ": block_tables must be int32 [num sequences, max_blocks]");
  TORCH_CHECK(out.sizes() == q.sizes() && out.scalar_type() == q.scalar_type() && out.is_contiguous() &&
                  out.device() == q.device(),
              op, ": out must be a contiguous tensor of q's shape and dtype");
}

// The first key a query at position len - 1 sees: its last `window` keys (0: all of them).
TANDEM_INLINE int64_t window_start(int64_t len, int64_t window) {
  return window > 0 ? std::max<int64_t>(0, len - window) : 0;
}

#if defined(__AVX512F__)
// soft_cap_scores for 16 scores: tanh(y) = sign(y) (1 - e) / (1 + e) with e = exp(-2 |y|), which
// never overflows.
TANDEM_INLINE __m512 soft_cap16(__m512 x, float cap) {
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512 y = _mm512_div_ps(x, _mm512_set1_ps(cap));
  const __m512 e = exp512(_mm512_mul_ps(_mm512_abs_ps(y), _mm512_set1_ps(-2.0f)));
  const __m512 t = _mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e));
  const __m512i sign = _mm512_and_si512(_mm512_castps_si512(y), _mm512_set1_epi32(static_cast<int>(0x80000000u)));
  return _mm512_mul_ps(_mm512_set1_ps(cap), _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(t), sign)));
}
#endif

#if defined(TANDEM_AVX2)
// soft_cap16's 8 lanes.
TANDEM_INLINE __m256 soft_cap8(__m256 x, float cap) {
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 sign_bit = _mm256_set1_ps(-0.0f);
  const __m256 y = _mm256_div_ps(x, _mm256_set1_ps(cap));
  const __m256 e = exp256(_mm256_mul_ps(_mm256_andnot_ps(sign_bit, y), _mm256_set1_ps(-2.0f)));
  const __m256 t = _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e));
  return _mm256_mul_ps(_mm256_set1_ps(cap), _mm256_or_ps(t, _mm256_and_ps(sign_bit, y)));
}
#endif

// Gemma-style logit soft-capping of already-scaled scores: cap * tanh(s / cap) (cap > 0).
TANDEM_INLINE void soft_cap_scores(float* s, int64_t n, float cap) {
  for (int64_t t = 0; t < n; ++t) s[t] = cap * std::tanh(s[t] / cap);
}

// Fills the fields that the decode and prefill kernels' parameter structs share (same names).
template <typename Params>
void fill_common_params(Params& P, const at::Tensor& q, const at::Tensor& out, const at::Tensor& k_cache,
                        const at::Tensor& v_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                        double scale, int64_t window, double softcap) {
  TORCH_CHECK(window >= 0, "attention: window must be >= 0 (0: none)");
  TORCH_CHECK(softcap >= 0.0, "attention: softcap must be >= 0 (0: none)");
  P.window = window;
  P.softcap = static_cast<float>(softcap);
  P.q = q.data_ptr();
  P.q_stride = q.stride(0);
  P.k = k_cache.data_ptr();
  P.v = v_cache.data_ptr();
  P.out = out.data_ptr();
  P.block_tables = block_tables.data_ptr<int32_t>();
  P.seq_lens = seq_lens.data_ptr<int32_t>();
  P.max_blocks = block_tables.size(1);
  P.bs = k_cache.size(1);
  P.kvh = k_cache.size(2);
  P.heads = q.size(1);
  P.group = q.size(1) / k_cache.size(2);
  P.d = q.size(2);
  P.scale = static_cast<float>(scale);
}

}  // namespace
}  // namespace tandem_ops
