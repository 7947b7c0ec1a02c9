// L2 normalisation on the CPU (ops/l2norm.h).
//   rstd = 1 / sqrt(sum_i x_i^2 + eps),  y_i = x_i rstd
//   dy/dx: d y_i / d x_j = rstd (delta_ij - y_i y_j), so dx = rstd (dy - y (y . dy)).
// Rows in parallel, each row's sums in index order.
#include "ops/l2norm.h"

#include <cmath>

#include "ops/layer_ops_cuda.h"
#include "ops/op_checks.h"

namespace hlm::ops {

L2NormResult l2norm_forward(const Tensor& x_, double eps) {
  constexpr const char* op = "l2norm_forward";
  detail::require_float_dev(x_, op, "x");
  HLM_CHECK(x_.dim() >= 1, "{}: x must be [..., D], got {}", op, x_.describe());
  HLM_CHECK(eps >= 0, "{}: eps must be >= 0, got {}", op, eps);
  if (x_.device() == Device::cuda) {
#ifdef HLM_HAVE_CUDA
    L2NormResult out{cuda::alloc(x_.shape(), x_.dtype()),
                     cuda::alloc(detail::leading_shape(x_), detail::compute_dtype(x_.dtype()))};
    cuda::l2norm_forward(x_, eps, out.y, out.rstd);
    return out;
#else
    HLM_FAIL("{}: no CUDA support in this build", op);
#endif
  }
  const Tensor x = x_.contiguous();
  L2NormResult out{Tensor::empty(x.shape(), x.dtype()),
                   Tensor::empty(detail::leading_shape(x), x.dtype())};
  const int64_t rows = detail::leading_rows(x), d = x.size(-1);
  detail::dispatch_float(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* px = x.data<T>();
    T* py = out.y.data<T>();
    T* pr = out.rstd.data<T>();
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      T ss = 0;
      for (int64_t i = 0; i < d; ++i) ss += px[r * d + i] * px[r * d + i];
      const T rs = T(1) / std::sqrt(ss + T(eps));
      pr[r] = rs;
      for (int64_t i = 0; i < d; ++i) py[r * d + i] = px[r * d + i] * rs;
    }
  });
  return out;
}

Tensor l2norm_backward(const Tensor& dy_, const Tensor& x_, const Tensor& rstd_) {
  constexpr const char* op = "l2norm_backward";
  detail::require_float_dev(x_, op, "x");
  HLM_CHECK(x_.dim() >= 1, "{}: x must be [..., D], got {}", op, x_.describe());
  detail::require_float_dev(dy_, op, "dy");
  detail::require_same_device(dy_, x_, op, "dy", "x");
  detail::require_same_dtype(dy_, x_, op, "dy", "x");
  detail::require_shape(dy_, x_.shape(), op, "dy");
  detail::require_float_dev(rstd_, op, "rstd");
  detail::require_same_device(rstd_, x_, op, "rstd", "x");
  HLM_CHECK(rstd_.dtype() == detail::compute_dtype(x_.dtype()), "{}: rstd must be {}, got {}", op,
            dtype_name(detail::compute_dtype(x_.dtype())), rstd_.describe());
  detail::require_shape(rstd_, detail::leading_shape(x_), op, "rstd");
  if (x_.device() == Device::cuda) {
#ifdef HLM_HAVE_CUDA
    Tensor dx = cuda::alloc(x_.shape(), x_.dtype());
    cuda::l2norm_backward(dy_, x_, rstd_, dx);
    return dx;
#else
    HLM_FAIL("{}: no CUDA support in this build", op);
#endif
  }
  const Tensor x = x_.contiguous(), dy = dy_.contiguous(), rstd = rstd_.contiguous();
  Tensor dx = Tensor::empty(x.shape(), x.dtype());
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
  return dx;
}

}  // namespace hlm::ops
