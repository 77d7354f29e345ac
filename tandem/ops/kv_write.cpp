// Writing a step's new K/V into the paged pool (vLLM's reshape_and_cache), for CPU.
//
// Row t of k and v ([T, KVH, D]) goes to flat slot slot_mapping[t] of k_cache and v_cache
// ([num_blocks, block_size, KVH, D]; an int8 cache's rows are quantized on the way, each with its own
// scale, into [..., D + 4] bytes). k and v are usually strided views of the fused qkv
// projection; they are read in place (one memcpy per token row) instead of being made contiguous
// first, which is what index_copy_ did, at two extra passes over them per layer. Every slot is
// checked before anything is written, so a bad slot raises and leaves the pool untouched.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace tandem_ops {
namespace {

using bf16 = c10::BFloat16;
constexpr int64_t kScaleBytes = 4;

void check_rows(const at::Tensor& x, const at::Tensor& cache, const char* name) {
  const bool int8_rows = cache.scalar_type() == at::kChar;
  TORCH_CHECK(x.dim() == 3 && x.size(1) == cache.size(2) && x.size(2) + (int8_rows ? kScaleBytes : 0) == cache.size(3),
              "write_kv: ", name, " must be [T, KVH, D] matching the cache (int8 rows: D + 4 bytes)");
  TORCH_CHECK(x.scalar_type() == cache.scalar_type() ||
                  (int8_rows && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16)),
              "write_kv: ", name, " and its cache must share a dtype (or the cache holds int8 rows)");
  TORCH_CHECK(x.stride(2) == 1 && x.stride(1) == x.size(2), "write_kv: ", name,
              "'s heads must be packed within a token row");
}

// One head's row as int8 with its scale s = max|x| / 127 in the last 4 bytes (tandem/kv/layout.py,
// whose quantize_rows rounds the same way: x * (1 / s) to nearest, ties to even).
template <typename T>
void quantize_row(const T* x, int64_t d, int8_t* out) {
  float amax = 0.0f;
  for (int64_t i = 0; i < d; ++i) amax = std::max(amax, std::fabs(static_cast<float>(x[i])));
  const float scale = amax / 127.0f;
  const float inv = scale > 0.0f ? 1.0f / scale : 0.0f;
  for (int64_t i = 0; i < d; ++i) out[i] = static_cast<int8_t>(std::nearbyint(static_cast<float>(x[i]) * inv));
  std::memcpy(out + d, &scale, sizeof(scale));
}

template <typename T>
void write_int8_rows(const at::Tensor& x, at::Tensor& cache, const int64_t* slots) {
  const int64_t T_ = x.size(0), kvh = x.size(1), d = x.size(2), row = d + kScaleBytes;
  const T* xs = static_cast<const T*>(x.data_ptr());
  int8_t* c = static_cast<int8_t*>(cache.data_ptr());
  at::parallel_for(0, T_, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t h = 0; h < kvh; ++h) quantize_row(xs + t * x.stride(0) + h * d, d, c + (slots[t] * kvh + h) * row);
  });
}

}  // namespace

void write_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
              const at::Tensor& slot_mapping) {
  TORCH_CHECK(k.device().is_cpu() && v.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu(),
              "write_kv: CPU tensors expected");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes() && k_cache.is_contiguous() &&
                  v_cache.is_contiguous(),
              "write_kv: k_cache/v_cache must both be contiguous [num_blocks, block_size, KVH, D]");
  check_rows(k, k_cache, "k");
  check_rows(v, v_cache, "v");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 && slot_mapping.size(0) == k.size(0) &&
                  v.size(0) == k.size(0),
              "write_kv: slot_mapping must be int64 [T] with one slot per row of k and v");
  const at::Tensor slots_t = slot_mapping.contiguous();
  const int64_t* slots = slots_t.data_ptr<int64_t>();
  const int64_t T = k.size(0), n_slots = k_cache.size(0) * k_cache.size(1);
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(slots[t] >= 0 && slots[t] < n_slots, "write_kv: slot ", slots[t], " out of range [0, ", n_slots, ")");

  if (k_cache.scalar_type() == at::kChar) {
    auto write = [&](const at::Tensor& x, at::Tensor& cache) {
      x.scalar_type() == at::kFloat ? write_int8_rows<float>(x, cache, slots) : write_int8_rows<bf16>(x, cache, slots);
    };
    write(k, k_cache);
    write(v, v_cache);
    return;
  }
  const int64_t row_bytes = k.size(1) * k.size(2) * static_cast<int64_t>(k.element_size());
  const char* ks = static_cast<const char*>(k.data_ptr());
  const char* vs = static_cast<const char*>(v.data_ptr());
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  const int64_t k_stride = k.stride(0) * k.element_size(), v_stride = v.stride(0) * v.element_size();
  // Rows per task: enough bytes that waking a second thread pays.
  const int64_t grain = std::max<int64_t>(1, (64 << 10) / std::max<int64_t>(1, row_bytes));
  at::parallel_for(0, T, grain, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      std::memcpy(kc + slots[t] * row_bytes, ks + t * k_stride, row_bytes);
      std::memcpy(vc + slots[t] * row_bytes, vs + t * v_stride, row_bytes);
    }
  });
}

}  // namespace tandem_ops

TORCH_LIBRARY_FRAGMENT(tandem, m) {
  m.def("write_kv(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(tandem, CPU, m) { m.impl("write_kv", &tandem_ops::write_kv); }
