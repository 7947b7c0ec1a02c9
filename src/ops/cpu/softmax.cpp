// Softmax on the CPU (ops/softmax.h, the reference; entry points in ops/cpu/softmax.h).
//   m = max_j x_j,  y_i = e^{x_i - m} / sum_j e^{x_j - m}   (no overflow: every exponent <= 0)
//   Jacobian dy_i/dx_j = y_i (delta_ij - y_j)  =>  dx_i = y_i (dy_i - y . dy)
#include "ops/cpu/softmax.h"

#include <algorithm>
#include <cmath>

#include "ops/op_checks.h"

namespace hlm::ops::cpu {

void softmax_forward(const Tensor& x, Tensor& y) {
  const int64_t rows = detail::leading_rows(x), d = x.size(-1);
  detail::dispatch_float(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* px = x.data<T>();
    T* py = y.data<T>();
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const T* xr = px + r * d;
      T* yr = py + r * d;
      T m = -INFINITY;
      for (int64_t i = 0; i < d; ++i) m = std::max(m, xr[i]);
      T s = 0;
      for (int64_t i = 0; i < d; ++i) {
        yr[i] = std::exp(xr[i] - m);
        s += yr[i];
      }
      const T inv = T(1) / s;
      for (int64_t i = 0; i < d; ++i) yr[i] *= inv;
    }
  });
}

void softmax_backward(const Tensor& y, const Tensor& dy, Tensor& dx) {
  const int64_t rows = detail::leading_rows(y), d = y.size(-1);
  detail::dispatch_float(y.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T *py = y.data<T>(), *pdy = dy.data<T>();
    T* pdx = dx.data<T>();
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      T s = 0;  // y . dy
      for (int64_t i = 0; i < d; ++i) s += py[r * d + i] * pdy[r * d + i];
      for (int64_t i = 0; i < d; ++i) pdx[r * d + i] = py[r * d + i] * (pdy[r * d + i] - s);
    }
  });
}

}  // namespace hlm::ops::cpu
