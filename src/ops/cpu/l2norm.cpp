// L2 normalisation on the CPU (ops/l2norm.h, the reference; entry points in ops/cpu/l2norm.h).
//   rstd = 1 / sqrt(sum_i x_i^2 + eps),  y_i = x_i rstd
//   dy/dx: d y_i / d x_j = rstd (delta_ij - y_i y_j), so dx = rstd (dy - y (y . dy)).
// Rows in parallel, each row's sums in index order.
#include "ops/cpu/l2norm.h"

#include <cmath>

#include "ops/op_checks.h"

namespace hlm::ops::cpu {

void l2norm_forward(const Tensor& x, double eps, Tensor& y, Tensor& rstd) {
  const int64_t rows = detail::leading_rows(x), d = x.size(-1);
  detail::dispatch_float(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* px = x.data<T>();
    T* py = y.data<T>();
    T* pr = rstd.data<T>();
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      T ss = 0;
      for (int64_t i = 0; i < d; ++i) ss += px[r * d + i] * px[r * d + i];
      const T rs = T(1) / std::sqrt(ss + T(eps));
      pr[r] = rs;
      for (int64_t i = 0; i < d; ++i) py[r * d + i] = px[r * d + i] * rs;
    }
  });
}

void l2norm_backward(const Tensor& dy, const Tensor& x, const Tensor& rstd, Tensor& dx) {
  const int64_t rows = detail::leading_rows(x), d = x.size(-1);
  detail::dispatch_float(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* px = x.data<T>();
    const T* pdy = dy.data<T>();
    const T* pr = rstd.data<T>();
    T* pdx = dx.data<T>();
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const T rs = pr[r];
      T ydy = 0;  // y . dy
      for (int64_t i = 0; i < d; ++i) ydy += px[r * d + i] * rs * pdy[r * d + i];
      for (int64_t i = 0; i < d; ++i)
        pdx[r * d + i] = rs * (pdy[r * d + i] - px[r * d + i] * rs * ydy);
    }
  });
}

}  // namespace hlm::ops::cpu
