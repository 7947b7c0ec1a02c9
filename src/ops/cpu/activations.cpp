// Elementwise activations on the CPU (ops/activations.h, the reference; entry points in
// ops/cpu/activations.h).
//
//   s = sigmoid(x) = 1 / (1 + e^-x)          ds/dx = s (1 - s)
//   silu(x)  = x s                           d/dx  = s + x s (1 - s) = s (1 + x (1 - s))
//   softplus(x) = max(x, 0) + log1p(e^-|x|)  d/dx  = s
#include "ops/cpu/activations.h"

#include "ops/op_checks.h"

namespace hlm::ops::cpu {

namespace {

template <class T>
T act_forward(ActKind a, T x) {
  switch (a) {
    case ActKind::sigmoid:
      return sigmoid_scalar(x);
    case ActKind::silu:
      return x * sigmoid_scalar(x);
    default:
      return softplus_scalar(x);
  }
}

template <class T>
T act_grad(ActKind a, T x) {
  const T s = sigmoid_scalar(x);
  switch (a) {
    case ActKind::sigmoid:
      return s * (T(1) - s);
    case ActKind::silu:
      return s * (T(1) + x * (T(1) - s));
    default:
      return s;
  }
}

}  // namespace

void activation_forward(ActKind a, const Tensor& x, Tensor& y) {
  const int64_t n = x.numel();
  detail::dispatch_float(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* px = x.data<T>();
    T* py = y.data<T>();
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) py[i] = act_forward(a, px[i]);
  });
}

void activation_backward(ActKind a, const Tensor& x, const Tensor& dy, Tensor& dx) {
  const int64_t n = x.numel();
  detail::dispatch_float(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* px = x.data<T>();
    const T* pdy = dy.data<T>();
    T* pdx = dx.data<T>();
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) pdx[i] = pdy[i] * act_grad(a, px[i]);
  });
}

}  // namespace hlm::ops::cpu
