// Fused elementwise ops of the model's hot path, for CPU.
//
// Each replaces a chain of PyTorch ops that makes one full pass over memory per op (and writes a
// full intermediate tensor each time) with a single pass. Every op repeats the rounding steps of
// its PyTorch fallback in tandem/ops/fused.py, so the two agree to the bit, except for the order
// of rms_norm's sum of squares and silu's exp, which agree to rounding.
//
//   rms_norm(x, w, eps)               w * bf16(x * rsqrt(mean(x^2) + eps)), statistics in float
//   add_rms_norm(x, residual, w, eps) residual = x + residual (rounded), then rms_norm of it
//   rotary_(q, k, cos, sin)           rotate-half RoPE in place on strided q/k views
//   silu_and_mul(x)                   silu(x[:, :I]) * x[:, I:]
//   argmax(x)                         row-wise first index of the maximum (NaN never wins)

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "simd.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>

namespace tandem_ops {
namespace {

// Rows per task for at::parallel_for: enough elements per task that waking a thread pays.
int64_t grain(int64_t row_elems) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, row_elems)); }

// Round a float to the storage type T and back (identity for float).
template <typename T>
inline float rnd(float x) {
  return static_cast<float>(static_cast<T>(x));
}

// One row of rms_norm: o = w * round(x * rsqrt(mean(x^2) + eps)).
template <typename T>
TANDEM_INLINE void norm_row(const T* xr, const T* w, T* o, int64_t n, float eps) {
#if defined(__AVX512F__)
  __m512 ss = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __m512 v = load16(xr + i, lane_mask(n - i));
    ss = _mm512_fmadd_ps(v, v, ss);
  }
  const __m512 inv = _mm512_set1_ps(1.0f / std::sqrt(_mm512_reduce_add_ps(ss) * (1.0f / n) + eps));
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = lane_mask(n - i);
    const __m512 xn = round_as(_mm512_mul_ps(load16(xr + i, m), inv), xr);
    store16(o + i, _mm512_mul_ps(load16(w + i, m), xn), m);
  }
#else
  float ss = 0.0f;
  for (int64_t i = 0; i < n; ++i) ss += static_cast<float>(xr[i]) * static_cast<float>(xr[i]);
  const float inv = 1.0f / std::sqrt(ss * (1.0f / n) + eps);
  for (int64_t i = 0; i < n; ++i) o[i] = static_cast<T>(static_cast<float>(w[i]) * rnd<T>(static_cast<float>(xr[i]) * inv));
#endif
}

// One row of the residual add: res = x + residual, rounded to T.
template <typename T>
TANDEM_INLINE void add_row(const T* xr, const T* rr, T* res, int64_t n) {
#if defined(__AVX512F__)
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = lane_mask(n - i);
    store16(res + i, _mm512_add_ps(load16(xr + i, m), load16(rr + i, m)), m);
  }
#else
  for (int64_t i = 0; i < n; ++i) res[i] = static_cast<T>(static_cast<float>(xr[i]) + static_cast<float>(rr[i]));
#endif
}

template <typename T>
void rms_norm_rows(const T* x, int64_t x_stride, const T* w, T* out, int64_t out_stride, int64_t rows,
                   int64_t n, float eps) {
  at::parallel_for(0, rows, grain(n), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) norm_row(x + r * x_stride, w, out + r * out_stride, n, eps);
  });
}

// res = x + residual (rounded to T), out = rms_norm(res): one pass, the row still in L1 for the norm.
template <typename T>
void add_rms_norm_rows(const T* x, int64_t x_stride, const T* residual, int64_t r_stride, const T* w, T* res,
                       T* out, int64_t rows, int64_t n, float eps) {
  at::parallel_for(0, rows, grain(2 * n), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      add_row(x + r * x_stride, residual + r * r_stride, res + r * n, n);
      norm_row(res + r * n, w, out + r * n, n, eps);
    }
  });
}

// Rotate-half RoPE on `heads` rows of D at x + t * t_stride + h * D, with cos/sin rows [T, D]:
//   out[i] = x[i] * cos[i] + rot[i] * sin[i],  rot = (-x[half:], x[:half]),
// each product and the sum rounded to T, as the three PyTorch ops of the fallback do.
template <typename T>
// Rotates the first d dimensions of each head (h_stride apart; d < h_stride: partial rotary).
void rotary_rows(T* x, int64_t t_stride, int64_t heads, int64_t h_stride, int64_t tokens, int64_t d, const T* cos,
                 const T* sin) {
  const int64_t half = d / 2;
  at::parallel_for(0, tokens, grain(heads * d), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const T* c = cos + t * d;
      const T* s = sin + t * d;
      for (int64_t h = 0; h < heads; ++h) {
        T* v = x + t * t_stride + h * h_stride;
#if defined(__AVX512F__)
        if (half % 16 == 0) {
          for (int64_t i = 0; i < half; i += 16) {
            const __m512 x1 = load16(v + i), x2 = load16(v + half + i);
            const __m512 c1 = load16(c + i), c2 = load16(c + half + i);
            const __m512 s1 = load16(s + i), s2 = load16(s + half + i);
            const __m512 neg_x2 = _mm512_sub_ps(_mm512_setzero_ps(), x2);
            const __m512 o1 = _mm512_add_ps(round_as(_mm512_mul_ps(x1, c1), v), round_as(_mm512_mul_ps(neg_x2, s1), v));
            const __m512 o2 = _mm512_add_ps(round_as(_mm512_mul_ps(x2, c2), v), round_as(_mm512_mul_ps(x1, s2), v));
            store16(v + i, o1);
            store16(v + half + i, o2);
          }
          continue;
        }
#endif
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = static_cast<float>(v[i]), x2 = static_cast<float>(v[half + i]);
          const float o1 = rnd<T>(x1 * static_cast<float>(c[i])) + rnd<T>(-x2 * static_cast<float>(s[i]));
          const float o2 = rnd<T>(x2 * static_cast<float>(c[half + i])) + rnd<T>(x1 * static_cast<float>(s[half + i]));
          v[i] = static_cast<T>(o1);
          v[half + i] = static_cast<T>(o2);
        }
      }
    }
  });
}

template <typename T>
void silu_and_mul_rows(const T* x, int64_t x_stride, T* out, int64_t rows, int64_t n) {
  at::parallel_for(0, rows, grain(2 * n), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* g = x + r * x_stride;
      const T* u = g + n;
      T* o = out + r * n;
#if defined(__AVX512F__)
      const __m512 one = _mm512_set1_ps(1.0f);
      for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 m = lane_mask(n - i);
        const __m512 gv = load16(g + i, m);
        // 1 / (1 + e^-g) as rcp14 plus one Newton step (~1 ulp): a division would issue at a
        // fraction of the rate and dominate the op. The denominator stays finite (e^-g overflows
        // below g = -88), so the Newton step never sees inf * 0 and the result tends to -0.
        const __m512 den = _mm512_min_ps(_mm512_add_ps(one, exp512(_mm512_sub_ps(_mm512_setzero_ps(), gv))),
                                         _mm512_set1_ps(std::numeric_limits<float>::max()));
        __m512 rcp = _mm512_rcp14_ps(den);
        rcp = _mm512_mul_ps(rcp, _mm512_fnmadd_ps(den, rcp, _mm512_set1_ps(2.0f)));
        const __m512 act = _mm512_mul_ps(gv, rcp);
        store16(o + i, _mm512_mul_ps(round_as(act, g), load16(u + i, m)), m);
      }
#else
      for (int64_t i = 0; i < n; ++i) {
        const float gv = static_cast<float>(g[i]);
        o[i] = static_cast<T>(rnd<T>(gv / (1.0f + std::exp(-gv))) * static_cast<float>(u[i]));
      }
#endif
    }
  });
}

template <typename T>
void argmax_rows(const T* x, int64_t x_stride, int64_t* out, int64_t rows, int64_t n) {
  at::parallel_for(0, rows, grain(n / 4), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * x_stride;
      float best = -std::numeric_limits<float>::infinity();
#if defined(__AVX512F__)
      __m512 vmax = _mm512_set1_ps(best);
      for (int64_t i = 0; i < n; i += 16) {  // lanes past n keep their running max
        const __mmask16 m = lane_mask(n - i);
        vmax = _mm512_mask_max_ps(vmax, m, vmax, load16(xr + i, m));
      }
      best = _mm512_reduce_max_ps(vmax);
      int64_t idx = 0;
      const __m512 bv = _mm512_set1_ps(best);
      for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 hit = _mm512_mask_cmp_ps_mask(lane_mask(n - i), load16(xr + i, lane_mask(n - i)), bv, _CMP_EQ_OQ);
        if (hit) {
          idx = i + __builtin_ctz(hit);
          break;
        }
      }
#else
      int64_t idx = 0;
      for (int64_t i = 0; i < n; ++i) {
        const float v = static_cast<float>(xr[i]);
        if (v > best) {
          best = v;
          idx = i;
        }
      }
#endif
      out[r] = idx;
    }
  });
}

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.device().is_cpu(), name, ": CPU tensor expected");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, name, ": expected a 2-D tensor with contiguous rows");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, name,
              ": dtype must be float32 or bfloat16");
}

template <typename F>
void dispatch(at::ScalarType t, F&& f) {
  if (t == at::kFloat)
    f(float{});
  else
    f(bf16{});
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_rows(x, "rms_norm");
  TORCH_CHECK(w.dim() == 1 && w.size(0) == x.size(1) && w.is_contiguous() && w.scalar_type() == x.scalar_type(),
              "rms_norm: weight must be a contiguous [hidden] tensor of x's dtype");
  at::Tensor out = at::empty(x.sizes(), x.options());
  dispatch(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    rms_norm_rows<T>(x.data_ptr<T>(), x.stride(0), w.data_ptr<T>(), out.data_ptr<T>(), out.stride(0), x.size(0),
                     x.size(1), static_cast<float>(eps));
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& w,
                                                double eps) {
  check_rows(x, "add_rms_norm");
  check_rows(residual, "add_rms_norm");
  TORCH_CHECK(x.sizes() == residual.sizes() && x.scalar_type() == residual.scalar_type(),
              "add_rms_norm: x and residual must match");
  TORCH_CHECK(w.dim() == 1 && w.size(0) == x.size(1) && w.is_contiguous() && w.scalar_type() == x.scalar_type(),
              "add_rms_norm: weight must be a contiguous [hidden] tensor of x's dtype");
  at::Tensor res = at::empty(x.sizes(), x.options());
  at::Tensor out = at::empty(x.sizes(), x.options());
  dispatch(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    add_rms_norm_rows<T>(x.data_ptr<T>(), x.stride(0), residual.data_ptr<T>(), residual.stride(0), w.data_ptr<T>(),
                         res.data_ptr<T>(), out.data_ptr<T>(), x.size(0), x.size(1), static_cast<float>(eps));
  });
  return {out, res};
}

void rotary_(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin) {
  for (const at::Tensor* x : {&q, &k}) {
    TORCH_CHECK(x->device().is_cpu() && x->dim() == 3 && x->stride(2) == 1 && x->stride(1) == x->size(2),
                "rotary_: q/k must be [T, heads, D] with contiguous heads");
    TORCH_CHECK(x->scalar_type() == cos.scalar_type(), "rotary_: q/k and cos/sin must share a dtype");
  }
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.sizes() == sin.sizes() && cos.dim() == 2 &&
                  cos.size(0) == q.size(0) && cos.size(1) <= q.size(2) && k.size(0) == q.size(0) &&
                  k.size(2) == q.size(2) && cos.size(1) % 2 == 0,
              "rotary_: cos/sin must be contiguous [T, R], with T matching q and k and an even R <= their D");
  TORCH_CHECK(cos.scalar_type() == at::kFloat || cos.scalar_type() == at::kBFloat16,
              "rotary_: dtype must be float32 or bfloat16");
  dispatch(q.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    for (const at::Tensor* x : {&q, &k})
      rotary_rows<T>(x->data_ptr<T>(), x->stride(0), x->size(1), x->size(2), x->size(0), cos.size(1),
                     cos.data_ptr<T>(), sin.data_ptr<T>());
  });
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  check_rows(x, "silu_and_mul");
  TORCH_CHECK(x.size(1) % 2 == 0, "silu_and_mul: the last dimension must be even");
  const int64_t n = x.size(1) / 2;
  at::Tensor out = at::empty({x.size(0), n}, x.options());
  dispatch(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    silu_and_mul_rows<T>(x.data_ptr<T>(), x.stride(0), out.data_ptr<T>(), x.size(0), n);
  });
  return out;
}

at::Tensor argmax(const at::Tensor& x) {
  check_rows(x, "argmax");
  TORCH_CHECK(x.size(1) > 0, "argmax: empty rows");
  at::Tensor out = at::empty({x.size(0)}, x.options().dtype(at::kLong));
  dispatch(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    argmax_rows<T>(x.data_ptr<T>(), x.stride(0), out.data_ptr<int64_t>(), x.size(0), x.size(1));
  });
  return out;
}

}  // namespace tandem_ops

TORCH_LIBRARY_FRAGMENT(tandem, m) {
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor w, float eps) -> (Tensor, Tensor)");
  m.def("rotary_(Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin) -> ()");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("argmax(Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(tandem, CPU, m) {
  m.impl("rms_norm", &tandem_ops::rms_norm);
  m.impl("add_rms_norm", &tandem_ops::add_rms_norm);
  m.impl("rotary_", &tandem_ops::rotary_);
  m.impl("silu_and_mul", &tandem_ops::silu_and_mul);
  m.impl("argmax", &tandem_ops::argmax);
}
