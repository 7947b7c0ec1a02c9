// LayerNorm on the CPU (ops/layernorm.h).
//   xhat_i = (x_i - mean) rstd,  y_i = xhat_i w_i + b_i
// Backward (per row), g_i = dy_i w_i:
//   db_i += dy_i,  dw_i += dy_i xhat_i
//   dx_i  = rstd (g_i - mean_j(g_j) - xhat_i mean_j(g_j xhat_j))
// Rows in parallel, each row's sums in index order; dw/db sum over rows in row order.
#include "ops/layernorm.h"

#include <cmath>

#include "ops/op_checks.h"

namespace hlm::ops {

namespace {
void check_params(const char* op, const Tensor& x, const Tensor& w, const Tensor& b) {
  detail::require_float(x, op, "x");
  HLM_CHECK(x.dim() >= 1, "{}: x must be [..., D], got {}", op, x.describe());
  for (auto [t, name] : {std::pair<const Tensor*, const char*>{&w, "w"}, {&b, "b"}}) {
    detail::require_float(*t, op, name);
    detail::require_same_dtype(*t, x, op, name, "x");
    detail::require_shape(*t, {x.size(-1)}, op, name);
  }
}
}  // namespace

LayerNormResult layernorm_forward(const Tensor& x_, const Tensor& w_, const Tensor& b_,
                                  double eps) {
  constexpr const char* op = "layernorm_forward";
  check_params(op, x_, w_, b_);
  HLM_CHECK(eps >= 0, "{}: eps must be >= 0, got {}", op, eps);
  const Tensor x = x_.contiguous(), w = w_.contiguous(), b = b_.contiguous();
  const Shape lead = detail::leading_shape(x);
  LayerNormResult out{Tensor::empty(x.shape(), x.dtype()), Tensor::empty(lead, x.dtype()),
                      Tensor::empty(lead, x.dtype())};
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
  return out;
}

Tensor layernorm_backward(const Tensor& dy_, const Tensor& x_, const Tensor& w_,
                          const Tensor& mean_, const Tensor& rstd_, Tensor& dw, Tensor& db) {
  constexpr const char* op = "layernorm_backward";
  check_params(op, x_, w_, w_);
  detail::require_float(dy_, op, "dy");
  detail::require_same_dtype(dy_, x_, op, "dy", "x");
  detail::require_shape(dy_, x_.shape(), op, "dy");
  const Shape lead = detail::leading_shape(x_);
  for (auto [t, name] : {std::pair<const Tensor*, const char*>{&mean_, "mean"}, {&rstd_, "rstd"}}) {
    detail::require_float(*t, op, name);
    detail::require_same_dtype(*t, x_, op, name, "x");
    detail::require_shape(*t, lead, op, name);
  }
  for (auto [t, name] : {std::pair<const Tensor*, const char*>{&dw, "dw"}, {&db, "db"}}) {
    detail::require_float(*t, op, name);
    detail::require_same_dtype(*t, x_, op, name, "x");
    detail::require_shape(*t, w_.shape(), op, name);
    detail::require_contiguous(*t, op, name);
  }
  const Tensor dy = dy_.contiguous(), x = x_.contiguous(), w = w_.contiguous(),
               mean = mean_.contiguous(), rstd = rstd_.contiguous();
  Tensor dx = Tensor::empty(x.shape(), x.dtype());
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
  return dx;
}

}  // namespace hlm::ops
