// LayerNorm on the CPU (ops/layernorm.h, the reference; entry points in ops/cpu/layernorm.h).
//   xhat_i = (x_i - mean) rstd,  y_i = xhat_i w_i + b_i
// Backward (per row), g_i = dy_i w_i:
//   db_i += dy_i,  dw_i += dy_i xhat_i
//   dx_i  = rstd (g_i - mean_j(g_j) - xhat_i mean_j(g_j xhat_j))
// Rows in parallel, each row's sums in index order; dw/db sum over rows in row order.
#include "ops/cpu/layernorm.h"

#include <cmath>

#include "ops/op_checks.h"

namespace hlm::ops::cpu {

void layernorm_forward(const Tensor& x, const Tensor& w, const Tensor& b, double eps,
                       LayerNormResult& out) {
  const int64_t rows = detail::leading_rows(x), d = x.size(-1);
  detail::dispatch_float(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T *px = x.data<T>(), *pw = w.data<T>(), *pb = b.data<T>();
    T *py = out.y.data<T>(), *pm = out.mean.data<T>(), *pr = out.rstd.data<T>();
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const T* xr = px + r * d;
      T s = 0;
      for (int64_t i = 0; i < d; ++i) s += xr[i];
      const T m = d > 0 ? s / T(d) : T(0);
      T v = 0;  // two-pass variance: sum (x - mean)^2 / D
      for (int64_t i = 0; i < d; ++i) v += (xr[i] - m) * (xr[i] - m);
      const T rs = T(1) / std::sqrt((d > 0 ? v / T(d) : T(0)) + T(eps));
      pm[r] = m;
      pr[r] = rs;
      for (int64_t i = 0; i < d; ++i) py[r * d + i] = (xr[i] - m) * rs * pw[i] + pb[i];
    }
  });
}

void layernorm_backward(const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& mean,
                        const Tensor& rstd, Tensor& dx, Tensor& dw, Tensor& db) {
  const int64_t rows = detail::leading_rows(x), d = x.size(-1);
  detail::dispatch_float(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T *pdy = dy.data<T>(), *px = x.data<T>(), *pw = w.data<T>();
    const T *pm = mean.data<T>(), *pr = rstd.data<T>();
    T *pdx = dx.data<T>(), *pdw = dw.data<T>(), *pdb = db.data<T>();
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const T m = pm[r], rs = pr[r];
      T sg = 0, sgx = 0;  // sum_j g_j, sum_j g_j xhat_j
      for (int64_t i = 0; i < d; ++i) {
        const T g = pdy[r * d + i] * pw[i];
        sg += g;
        sgx += g * (px[r * d + i] - m) * rs;
      }
      const T mg = sg / T(d), mgx = sgx / T(d);
      for (int64_t i = 0; i < d; ++i) {
        const T xhat = (px[r * d + i] - m) * rs;
        pdx[r * d + i] = rs * (pdy[r * d + i] * pw[i] - mg - xhat * mgx);
      }
    }
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t i = 0; i < d; ++i) {
        const T g = pdy[r * d + i];
        pdw[i] += g * (px[r * d + i] - pm[r]) * pr[r];
        pdb[i] += g;
      }
  });
}

}  // namespace hlm::ops::cpu
