// RMSNorm and gated RMSNorm on the CPU (ops/rmsnorm.h), in the style of llm.c: forward and
// backward side by side, math in comments.
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
#include "ops/rmsnorm.h"

#include <cmath>

#include "ops/activations.h"
#include "ops/layer_ops_cuda.h"
#include "ops/op_checks.h"

namespace hlm::ops {

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

void check_common(const char* op, const Tensor& x, const Tensor& w) {
  detail::require_float_dev(x, op, "x");
  HLM_CHECK(x.dim() >= 1, "{}: x must be [..., D], got {}", op, x.describe());
  detail::require_float_dev(w, op, "w");
  detail::require_same_device(w, x, op, "w", "x");
  detail::require_param_dtype(w, x, op, "w");
  detail::require_shape(w, {x.size(-1)}, op, "w");
}

void check_backward(const char* op, const Tensor& dy, const Tensor& x, const Tensor& w,
                    const Tensor& rstd, const Tensor& dw) {
  check_common(op, x, w);
  detail::require_float_dev(dy, op, "dy");
  detail::require_same_device(dy, x, op, "dy", "x");
  detail::require_same_dtype(dy, x, op, "dy", "x");
  detail::require_shape(dy, x.shape(), op, "dy");
  detail::require_float_dev(rstd, op, "rstd");
  detail::require_same_device(rstd, x, op, "rstd", "x");
  HLM_CHECK(rstd.dtype() == detail::compute_dtype(x.dtype()), "{}: rstd must be {}, got {}", op,
            dtype_name(detail::compute_dtype(x.dtype())), rstd.describe());
  detail::require_shape(rstd, detail::leading_shape(x), op, "rstd");
  detail::require_float_dev(dw, op, "dw");
  detail::require_same_device(dw, x, op, "dw", "x");
  detail::require_param_dtype(dw, x, op, "dw");
  detail::require_shape(dw, w.shape(), op, "dw");
  detail::require_contiguous(dw, op, "dw");
}

void check_gate(const char* op, const Tensor& gate, const Tensor& x) {
  detail::require_float_dev(gate, op, "gate");
  detail::require_same_device(gate, x, op, "gate", "x");
  detail::require_same_dtype(gate, x, op, "gate", "x");
  detail::require_shape(gate, x.shape(), op, "gate");
}

RmsNormResult forward_impl(const Tensor& x_, const Tensor* gate, const Tensor& w_, double eps) {
  if (x_.device() == Device::cuda) {
#ifdef HLM_HAVE_CUDA
    RmsNormResult out{cuda::alloc(x_.shape(), x_.dtype()),
                      cuda::alloc(detail::leading_shape(x_), detail::compute_dtype(x_.dtype()))};
    cuda::rmsnorm_forward(x_, gate, w_, eps, out.y, out.rstd);
    return out;
#else
    HLM_FAIL("rmsnorm: no CUDA support in this build");
#endif
  }
  const Tensor x = x_.contiguous(), w = w_.contiguous();
  const Tensor g = gate ? gate->contiguous() : Tensor();
  RmsNormResult out{Tensor::empty(x.shape(), x.dtype()),
                    Tensor::empty(detail::leading_shape(x), x.dtype())};
  const int64_t rows = detail::leading_rows(x), d = x.size(-1);
  detail::dispatch_float(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    rms_forward<T>(x.data<T>(), g.defined() ? g.data<T>() : nullptr, w.data<T>(), out.y.data<T>(),
                   out.rstd.data<T>(), rows, d, eps);
  });
  return out;
}

GatedRmsNormGrads backward_impl(const Tensor& dy_, const Tensor& x_, const Tensor* gate,
                                const Tensor& w_, const Tensor& rstd_, Tensor& dw) {
  if (x_.device() == Device::cuda) {
#ifdef HLM_HAVE_CUDA
    GatedRmsNormGrads out;
    out.dx = cuda::alloc(x_.shape(), x_.dtype());
    if (gate) out.dgate = cuda::alloc(x_.shape(), x_.dtype());
    cuda::rmsnorm_backward(dy_, x_, gate, w_, rstd_, out.dx, gate ? &out.dgate : nullptr, dw);
    return out;
#else
    HLM_FAIL("rmsnorm backward: no CUDA support in this build");
#endif
  }
  const Tensor dy = dy_.contiguous(), x = x_.contiguous(), w = w_.contiguous(),
               rstd = rstd_.contiguous();
  const Tensor g = gate ? gate->contiguous() : Tensor();
  GatedRmsNormGrads out;
  out.dx = Tensor::empty(x.shape(), x.dtype());
  if (gate) out.dgate = Tensor::empty(x.shape(), x.dtype());
  const int64_t rows = detail::leading_rows(x), d = x.size(-1);
  detail::dispatch_float(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    rms_backward<T>(dy.data<T>(), x.data<T>(), g.defined() ? g.data<T>() : nullptr, w.data<T>(),
                    rstd.data<T>(), out.dx.data<T>(), gate ? out.dgate.data<T>() : nullptr,
                    dw.data<T>(), rows, d);
  });
  return out;
}

}  // namespace

RmsNormResult rmsnorm_forward(const Tensor& x, const Tensor& w, double eps) {
  check_common("rmsnorm_forward", x, w);
  HLM_CHECK(eps >= 0, "rmsnorm_forward: eps must be >= 0, got {}", eps);
  return forward_impl(x, nullptr, w, eps);
}

Tensor rmsnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& rstd,
                        Tensor& dw) {
  check_backward("rmsnorm_backward", dy, x, w, rstd, dw);
  return backward_impl(dy, x, nullptr, w, rstd, dw).dx;
}

RmsNormResult gated_rmsnorm_forward(const Tensor& x, const Tensor& gate, const Tensor& w,
                                    double eps) {
  constexpr const char* op = "gated_rmsnorm_forward";
  check_common(op, x, w);
  check_gate(op, gate, x);
  HLM_CHECK(eps >= 0, "{}: eps must be >= 0, got {}", op, eps);
  return forward_impl(x, &gate, w, eps);
}

GatedRmsNormGrads gated_rmsnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& gate,
                                         const Tensor& w, const Tensor& rstd, Tensor& dw) {
  constexpr const char* op = "gated_rmsnorm_backward";
  check_backward(op, dy, x, w, rstd, dw);
  check_gate(op, gate, x);
  return backward_impl(dy, x, &gate, w, rstd, dw);
}

}  // namespace hlm::ops
