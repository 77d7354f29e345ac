// bf16 linear layers for a few rows (decode at low concurrency): y = x W^T (+ b) as a weight stream.
//
// With up to a few dozen rows a linear layer's time is the time to read W: each weight meets only
// those rows. oneDNN's matmul (behind F.linear and the pre-packed PackedLinear) read SmolLM2-135M's
// 269 MB of linear and lm_head weights at 9-14 GB/s at 1-32 rows on the development machine,
// against 18-22 GB/s for a plain streaming sum; this op reads them at 11-16 GB/s, 1.14-1.33x
// faster (benchmarks/small_batch_linear.py), and a batch-1 decode step went from ~37 to ~25-31 ms.
//
//   * W is packed once, at load time, into panels of kPanel = 32 output columns, each panel
//     [K/2][32] bf16 pairs: one contiguous stream per panel, in the VNNI layout that both dpbf16
//     and oneDNN's brgemm (AMX tiles or dpbf16) read; threads split the panels, and each panel
//     meets every row while it is in L1, so W streams from memory once per call;
//   * a few rows (two on AMX, sixteen elsewhere: dot_rows): dpbf16, each 64-byte load of the panel
//     (16 columns x one pair along K) against up to eight rows, accumulators in registers;
//   * more: oneDNN's brgemm micro-kernel (AMX where the CPU has it, dpbf16 otherwise), 32 rows a
//     call, the panel as its B operand as it is. On AMX, our dpbf16 loop's cost per weight byte
//     grows with the rows (1.0x oneDNN at four), a tile product's does not;
//   * accumulation is in fp32, then + bias, rounded once to bf16, as oneDNN does.
// On AMX, past 32 rows the second brgemm shape per panel costs more than it saves (0.73x at 48): the
// caller switches to oneDNN's blocked matmul there. Without AMX the panels stay within 0.93-1.03x of
// oneDNN from 32 to 2,048 rows (a Zen 4), so they serve every row and oneDNN's copy is not kept.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <torch/library.h>

#include "batch_invariant.h"
#include "simd.h"

#include <cpuid.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <optional>
#include <utility>
#include <vector>

namespace tandem_ops {
namespace {

constexpr int64_t kPanel = 32;   // output columns per packed panel
constexpr int64_t kMaxRows = 8;  // rows whose accumulators are held in registers at once (16 of 32 zmm)
constexpr int64_t kBrgemmRows = 32;  // rows per brgemm call
// Batch-invariant (batch_invariant.h): every row count through the dpbf16 loop with two chains per
// row (S = 2), six rows at a time: 6 x 2 x 2 accumulators, the two weight vectors and the broadcast
// fit the 32 registers, and a row's sums come out the same in any block of any size.
constexpr int64_t kInvariantRows = 6;

int64_t num_panels(int64_t n) { return (n + kPanel - 1) / kPanel; }

// AMX tiles (CPUID leaf 7, EDX bit 24): there a brgemm shape change reconfigures the tiles, so the
// last, partial block of rows is padded to the one shape; without AMX a partial block costs in
// proportion to its rows (padding 8 rows to 32 made 8-row steps 1.5x slower than oneDNN on a Zen 4).
bool cpu_has_amx() {
  static const bool amx = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    return __get_cpuid_count(7, 0, &a, &b, &c, &d) && ((d >> 24) & 1u);
  }();
  return amx;
}

// Up to this many rows the dpbf16 loop, beyond oneDNN's brgemm. On AMX a tile product's cost per
// weight byte does not grow with the rows and our loop's does (1.0x oneDNN at four): two rows. With
// dpbf16 only, eight rows' accumulators fit in registers, so each panel pass reads the weight once
// per eight rows against brgemm's once per call (at 8 rows 1.5x faster than brgemm on a Zen 4).
int64_t dot_rows() { return cpu_has_amx() ? 2 : 2 * kMaxRows; }

#if defined(__AVX512BF16__)
// The fp32 accumulators of one output row's panel (32 columns as two vectors), plus the bias,
// rounded once to bf16 and stored (only the n valid columns).
struct PanelStore {
  __m512 b0, b1;
  __mmask32 cols;
  PanelStore(int64_t n, const float* bias) {
    const __mmask16 m0 = lane_mask(std::min<int64_t>(n, 16)), m1 = lane_mask(std::max<int64_t>(n - 16, 0));
    b0 = bias ? _mm512_maskz_loadu_ps(m0, bias) : _mm512_setzero_ps();
    b1 = bias ? _mm512_maskz_loadu_ps(m1, bias + 16) : _mm512_setzero_ps();
    cols = n == kPanel ? ~__mmask32{0} : static_cast<__mmask32>((uint64_t{1} << n) - 1);
  }
  TANDEM_INLINE void row(__m512 a0, __m512 a1, bf16* y) const {
    const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_add_ps(a1, b1), _mm512_add_ps(a0, b0));
    _mm512_mask_storeu_epi16(y, cols, reinterpret_cast<__m512i>(v));
  }
};

// Rows [0, MR) of x against one panel (n <= 32 valid columns), written to y. With few rows the
// dpbf16 chains of a row wait on each other's latency: pairs along K take turns between S sets of
// chains, summed at the end (1 row: 12.3 to 9.0 ms for the model). S fixes a row's order of sums.
template <int MR, int S = (MR <= 4 ? 2 : 1)>
void panel_rows(const bf16* x, int64_t ldx, const uint32_t* panel, int64_t KP, int64_t n, const float* bias, bf16* y,
                int64_t ldy) {
  __m512 acc[S][MR][2];
  for (int s = 0; s < S; ++s)
    for (int r = 0; r < MR; ++r) acc[s][r][0] = acc[s][r][1] = _mm512_setzero_ps();
  auto step = [&](int s, int64_t kp) {
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(panel + kp * kPanel);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(panel + kp * kPanel + 16);
    for (int r = 0; r < MR; ++r) {
      uint32_t pair;  // x[r][2kp], x[r][2kp + 1]
      std::memcpy(&pair, x + r * ldx + 2 * kp, sizeof(pair));
      const __m512bh xp = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
      acc[s][r][0] = _mm512_dpbf16_ps(acc[s][r][0], xp, w0);
      acc[s][r][1] = _mm512_dpbf16_ps(acc[s][r][1], xp, w1);
    }
  };
  int64_t kp = 0;
  for (; kp + S <= KP; kp += S)
    for (int s = 0; s < S; ++s) step(s, kp + s);
  for (; kp < KP; ++kp) step(0, kp);
  for (int s = 1; s < S; ++s)
    for (int r = 0; r < MR; ++r) {
      acc[0][r][0] = _mm512_add_ps(acc[0][r][0], acc[s][r][0]);
      acc[0][r][1] = _mm512_add_ps(acc[0][r][1], acc[s][r][1]);
    }
  const PanelStore out(n, bias);
  for (int r = 0; r < MR; ++r) out.row(acc[0][r][0], acc[0][r][1], y + r * ldy);
}

// Rows of x in blocks of kBrgemmRows against one panel (oneDNN's brgemm micro-kernel reads the
// panel's VNNI layout as it is), each call's fp32 results through the shared epilogue. With `tail`
// (on AMX) every call has the one shape kBrgemmRows x kPanel x K: the last, partial block of rows is
// read from it, a zero-padded copy of them (there a second shape per panel reconfigures the tiles,
// which cost more than the padding's products: 0.73x oneDNN at 48 rows before); without, the last
// call takes the rows there are.
void panel_rows_brgemm(const bf16* x, int64_t ldx, int64_t M, const bf16* tail, const bf16* panel, int64_t K,
                       int64_t n, const float* bias, bf16* y, int64_t ldy, float* C) {
  const PanelStore out(n, bias);
  for (int64_t m = 0; m < M; m += kBrgemmRows) {
    const int64_t rows = std::min(kBrgemmRows, M - m);
    const bool padded = rows < kBrgemmRows && tail != nullptr;
    at::native::cpublas::brgemm(padded ? kBrgemmRows : rows, kPanel, K, padded ? K : ldx, kPanel, kPanel, false,
                                padded ? tail : x + m * ldx, panel, C, true);
    for (int64_t r = 0; r < rows; ++r)
      out.row(_mm512_loadu_ps(C + r * kPanel), _mm512_loadu_ps(C + r * kPanel + 16), y + (m + r) * ldy);
  }
}

using RowsFn = void (*)(const bf16*, int64_t, const uint32_t*, int64_t, int64_t, const float*, bf16*, int64_t);

// panel_rows for 1..Block rows, S chains a row (0: panel_rows' own choice for each row count).
template <int S, size_t... I>
constexpr std::array<RowsFn, sizeof...(I)> row_kernels(std::index_sequence<I...>) {
  return {&panel_rows<static_cast<int>(I) + 1, S ? S : (I + 1 <= 4 ? 2 : 1)>...};
}

// Every panel (threads split them) against all M rows, Block rows at a time.
template <int Block, int S>
void panels_by_dot_rows(const bf16* X, int64_t lda, int64_t M, const uint32_t* W, int64_t KP, int64_t N,
                        const float* B, bf16* Y) {
  static constexpr auto kernels = row_kernels<S>(std::make_index_sequence<Block>{});
  at::parallel_for(0, num_panels(N), 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n = std::min(kPanel, N - p * kPanel);
      const uint32_t* panel = W + p * KP * kPanel;
      const float* b = B ? B + p * kPanel : nullptr;
      for (int64_t m = 0; m < M; m += Block)
        kernels[std::min<int64_t>(Block, M - m) - 1](X + m * lda, lda, panel, KP, n, b, Y + m * N + p * kPanel, N);
    }
  });
}
#endif

}  // namespace

// weight [N, K] bf16 -> [num_panels, K/2, kPanel, 2]; columns past N are zero.
at::Tensor pack_linear_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kBFloat16 && weight.dim() == 2,
              "pack_linear_weight: a 2-D bf16 CPU weight expected");
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(K % 2 == 0, "pack_linear_weight: in_features must be even, got ", K);
  const at::Tensor w = weight.contiguous();
  at::Tensor packed = at::zeros({num_panels(N), K / 2, kPanel, 2}, weight.options());
  const auto* src = reinterpret_cast<const uint32_t*>(w.data_ptr());  // bf16 pairs along K
  auto* dst = reinterpret_cast<uint32_t*>(packed.data_ptr());
  const int64_t KP = K / 2;
  at::parallel_for(0, num_panels(N), 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t j = 0; j < std::min(kPanel, N - p * kPanel); ++j)
        for (int64_t kp = 0; kp < KP; ++kp) dst[(p * KP + kp) * kPanel + j] = src[(p * kPanel + j) * KP + kp];
  });
  return packed;
}

at::Tensor small_batch_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                              int64_t out_features) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16,
              "small_batch_linear: bf16 CPU tensors expected");
  const int64_t N = out_features, K = x.size(-1);
  TORCH_CHECK(packed.dim() == 4 && packed.size(0) == num_panels(N) && packed.size(1) * 2 == K &&
                  packed.size(2) == kPanel && packed.size(3) == 2 && packed.is_contiguous(),
              "small_batch_linear: the packed weight does not match in_features ", K, " and out_features ", N);
  at::Tensor bias_f;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, "small_batch_linear: bias must be [out_features]");
    bias_f = bias->to(at::kFloat).contiguous();
  }
  const at::Tensor rows = x.reshape({-1, K});
  const at::Tensor xr = rows.stride(1) == 1 ? rows : rows.contiguous();
  const int64_t M = xr.size(0);
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = N;
  at::Tensor y = at::empty({M, N}, x.options());
#if defined(__AVX512BF16__)
  const bf16* X = static_cast<const bf16*>(xr.data_ptr());
  const auto* W = reinterpret_cast<const uint32_t*>(packed.data_ptr());
  const float* B = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  bf16* Y = static_cast<bf16*>(y.data_ptr());
  const int64_t lda = xr.stride(0), KP = K / 2;
  if (batch_invariant()) {
    panels_by_dot_rows<kInvariantRows, 2>(X, lda, M, W, KP, N, B, Y);
    return y.view(out_shape);
  }
  if (M > dot_rows()) {
    const int64_t tail_rows = cpu_has_amx() ? M % kBrgemmRows : 0;
    at::Tensor tail = at::zeros({tail_rows ? kBrgemmRows : 0, K}, x.options());
    if (tail_rows) tail.narrow(0, 0, tail_rows).copy_(xr.narrow(0, M - tail_rows, tail_rows));
    const bf16* T = tail_rows ? static_cast<const bf16*>(tail.data_ptr()) : nullptr;
    at::parallel_for(0, num_panels(N), 1, [&](int64_t p0, int64_t p1) {
      alignas(64) float C[kBrgemmRows * kPanel];
      for (int64_t p = p0; p < p1; ++p)
        panel_rows_brgemm(X, lda, M, T, reinterpret_cast<const bf16*>(W + p * KP * kPanel), K,
                          std::min(kPanel, N - p * kPanel), B ? B + p * kPanel : nullptr, Y + p * kPanel, N, C);
      at::native::cpublas::brgemm_release(true);
    });
    return y.view(out_shape);
  }
  panels_by_dot_rows<kMaxRows, 0>(X, lda, M, W, KP, N, B, Y);
#else
  TORCH_CHECK(false, "small_batch_linear: this build has no AVX512-BF16");
#endif
  return y.view(out_shape);
}

void set_batch_invariant(bool on) { batch_invariant_flag().store(on); }

bool get_batch_invariant() { return batch_invariant(); }

}  // namespace tandem_ops

TORCH_LIBRARY_FRAGMENT(tandem, m) {
  // No tensor arguments, so no dispatch key: catch-all kernels.
  m.def("set_batch_invariant(bool on) -> ()", &tandem_ops::set_batch_invariant);
  m.def("get_batch_invariant() -> bool", &tandem_ops::get_batch_invariant);
  m.def("pack_linear_weight(Tensor weight) -> Tensor");
  m.def("small_batch_linear(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(tandem, CPU, m) {
  m.impl("pack_linear_weight", &tandem_ops::pack_linear_weight);
  m.impl("small_batch_linear", &tandem_ops::small_batch_linear);
}
