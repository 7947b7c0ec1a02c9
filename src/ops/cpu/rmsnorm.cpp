// RMSNorm and gated RMSNorm on the CPU (ops/rmsnorm.h, the reference; entry points in
// ops/cpu/rmsnorm.h), in the style of llm.c: forward and backward side by side, math in comments.
//
// Per row x [D], weight w [D], optional gate logits g [D], s = sigmoid(g):
//   rstd  = 1 / sqrt(sum_i x_i^2 / D + eps)
//   n_i   = x_i * rstd * w_i                  (rmsnorm output)
//   y_i   = n_i * s_i                         (gated output)
// Backward, with dn_i = dy_i (plain) or dy_i * s_i (gated):
//   dg_i  = dy_i * n_i * s_i * (1 - s_i)
//   dw_i += dn_i * x_i * rstd
//   dx_i  = rstd * w_i * dn_i - rstd^3 / D * x_i * sum_j (dn_j * w_j * x_j)
// Rows run in parallel (OpenMP), each row's sums in index order; dw sums over rows in row order.
#include "ops/cpu/rmsnorm.h"

#include <cmath>

#include "ops/activations.h"
#include "ops/op_checks.h"

namespace hlm::ops::cpu {

namespace {

template <class T>
void rms_forward(const T* x, const T* g, const T* w, T* y, T* rstd, int64_t rows, int64_t d,
                 double eps) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * d;
    T ss = 0;
    for (int64_t i = 0; i < d; ++i) ss += xr[i] * xr[i];
    const T rs = T(1) / std::sqrt(ss / T(d) + T(eps));
    rstd[r] = rs;
    T* yr = y + r * d;
    for (int64_t i = 0; i < d; ++i) {
      const T n = xr[i] * rs * w[i];
      yr[i] = g ? n * sigmoid_scalar(g[r * d + i]) : n;
    }
  }
}

// dx (and dgate when g != nullptr); dw += ...
template <class T>
void rms_backward(const T* dy, const T* x, const T* g, const T* w, const T* rstd, T* dx, T* dg,
                  T* dw, int64_t rows, int64_t d) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * d;
    const T* dyr = dy + r * d;
    const T rs = rstd[r];
    // dot = sum_j dn_j w_j x_j
    T dot = 0;
    for (int64_t i = 0; i < d; ++i) {
      T dn = dyr[i];
      if (g) {
        const T s = sigmoid_scalar(g[r * d + i]);
        dg[r * d + i] = dyr[i] * xr[i] * rs * w[i] * s * (T(1) - s);
        dn *= s;
      }
      dot += dn * w[i] * xr[i];
    }
    const T c = rs * rs * rs / T(d) * dot;
    for (int64_t i = 0; i < d; ++i) {
      const T dn = g ? dyr[i] * sigmoid_scalar(g[r * d + i]) : dyr[i];
      dx[r * d + i] = rs * w[i] * dn - c * xr[i];
    }
  }
  // dw_i += sum over rows (in row order) of dn_i x_i rstd.
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < d; ++i) {
      const T dn = g ? dy[r * d + i] * sigmoid_scalar(g[r * d + i]) : dy[r * d + i];
      dw[i] += dn * x[r * d + i] * rstd[r];
    }
}

}  // namespace

void rmsnorm_forward(const Tensor& x, const Tensor* gate, const Tensor& w, double eps, Tensor& y,
                     Tensor& rstd) {
  const int64_t rows = detail::leading_rows(x), d = x.size(-1);
  detail::dispatch_float(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    rms_forward<T>(x.data<T>(), gate ? gate->data<T>() : nullptr, w.data<T>(), y.data<T>(),
                   rstd.data<T>(), rows, d, eps);
  });
}

void rmsnorm_backward(const Tensor& dy, const Tensor& x, const Tensor* gate, const Tensor& w,
                      const Tensor& rstd, Tensor& dx, Tensor* dgate, Tensor& dw) {
  const int64_t rows = detail::leading_rows(x), d = x.size(-1);
  detail::dispatch_float(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    rms_backward<T>(dy.data<T>(), x.data<T>(), gate ? gate->data<T>() : nullptr, w.data<T>(),
                    rstd.data<T>(), dx.data<T>(), dgate ? dgate->data<T>() : nullptr, dw.data<T>(),
                    rows, d);
  });
}

}  // namespace hlm::ops::cpu
