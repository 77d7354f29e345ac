// A streaming read of a buffer with wide loads, every thread its own contiguous part: the machine's
// read bandwidth, the denominator of every decode roofline (benchmarks/quant_gemv.py). A sum over the
// bytes keeps the loads from being optimized away; its value means nothing.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <atomic>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace tandem_ops {
namespace {

constexpr int64_t kAhead = 32;  // 128-byte lines: 4 KB ahead

int64_t stream_read(const at::Tensor& buf) {
  TORCH_CHECK(buf.device().is_cpu() && buf.scalar_type() == at::kByte && buf.is_contiguous(),
              "stream_read: a contiguous uint8 tensor on the CPU");
  const uint8_t* p = buf.data_ptr<uint8_t>();
  const int64_t lines = buf.numel() / 128;
  std::atomic<int64_t> total{0};
  at::parallel_for(0, lines, 4096, [&](int64_t l0, int64_t l1) {
    int64_t sum = 0;
#if defined(__AVX2__)
    __m256i s0 = _mm256_setzero_si256(), s1 = s0, s2 = s0, s3 = s0;
    for (int64_t l = l0; l < l1; ++l) {
      // Ask for the lines a few KB ahead, as the kernels whose bytes this is the floor of do.
      _mm_prefetch(reinterpret_cast<const char*>(p + (l + kAhead) * 128), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(p + (l + kAhead) * 128 + 64), _MM_HINT_T0);
      const __m256i* q = reinterpret_cast<const __m256i*>(p + l * 128);
      s0 = _mm256_add_epi64(s0, _mm256_loadu_si256(q));
      s1 = _mm256_add_epi64(s1, _mm256_loadu_si256(q + 1));
      s2 = _mm256_add_epi64(s2, _mm256_loadu_si256(q + 2));
      s3 = _mm256_add_epi64(s3, _mm256_loadu_si256(q + 3));
    }
    const __m256i s = _mm256_add_epi64(_mm256_add_epi64(s0, s1), _mm256_add_epi64(s2, s3));
    alignas(32) int64_t lanes[4];
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), s);
    sum = lanes[0] + lanes[1] + lanes[2] + lanes[3];
#else
    for (int64_t i = l0 * 128; i < l1 * 128; i += 8) {
      int64_t v;
      std::memcpy(&v, p + i, 8);
      sum += v;
    }
#endif
    total += sum;
  });
  return total.load();
}

}  // namespace
}  // namespace tandem_ops

TORCH_LIBRARY_FRAGMENT(tandem, m) { m.def("stream_read(Tensor buf) -> int"); }

TORCH_LIBRARY_IMPL(tandem, CPU, m) { m.impl("stream_read", &tandem_ops::stream_read); }
