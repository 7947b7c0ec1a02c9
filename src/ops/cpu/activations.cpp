// Elementwise activations on the CPU (ops/activations.h).
//
//   s = sigmoid(x) = 1 / (1 + e^-x)          ds/dx = s (1 - s)
//   silu(x)  = x s                           d/dx  = s + x s (1 - s) = s (1 + x (1 - s))
//   softplus(x) = max(x, 0) + log1p(e^-|x|)  d/dx  = s
#include "ops/activations.h"

#include "ops/layer_ops_cuda.h"
#include "ops/op_checks.h"

namespace hlm::ops {

namespace {

enum class Act { sigmoid, silu, softplus };

template <class T>
T act_forward(Act a, T x) {
  switch (a) {
    case Act::sigmoid:
      return sigmoid_scalar(x);
    case Act::silu:
      return x * sigmoid_scalar(x);
    default:
      return softplus_scalar(x);
  }
}

template <class T>
T act_grad(Act a, T x) {
  const T s = sigmoid_scalar(x);
  switch (a) {
    case Act::sigmoid:
      return s * (T(1) - s);
    case Act::silu:
      return s * (T(1) + x * (T(1) - s));
    default:
      return s;
  }
}

#ifdef HLM_HAVE_CUDA
cuda::Act cuda_act(Act a) {
  return a == Act::sigmoid ? cuda::Act::sigmoid
         : a == Act::silu  ? cuda::Act::silu
                           : cuda::Act::softplus;
}
#endif

Tensor forward(Act a, const char* op, const Tensor& x_) {
  detail::require_float_dev(x_, op, "x");
  if (x_.device() == Device::cuda) {
#ifdef HLM_HAVE_CUDA
    Tensor y = cuda::alloc(x_.shape(), x_.dtype());
    cuda::activation_forward(cuda_act(a), x_, y);
    return y;
#else
    HLM_FAIL("{}: no CUDA support in this build", op);
#endif
  }
  const Tensor x = x_.contiguous();
  Tensor y = Tensor::empty(x.shape(), x.dtype());
  const int64_t n = x.numel();
  detail::dispatch_float(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* px = x.data<T>();
    T* py = y.data<T>();
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) py[i] = act_forward(a, px[i]);
  });
  return y;
}

Tensor backward(Act a, const char* op, const Tensor& x_, const Tensor& dy_) {
  detail::require_float_dev(x_, op, "x");
  detail::require_float_dev(dy_, op, "dy");
  detail::require_same_device(dy_, x_, op, "dy", "x");
  detail::require_same_dtype(dy_, x_, op, "dy", "x");
  detail::require_shape(dy_, x_.shape(), op, "dy");
  if (x_.device() == Device::cuda) {
#ifdef HLM_HAVE_CUDA
    Tensor dx = cuda::alloc(x_.shape(), x_.dtype());
    cuda::activation_backward(cuda_act(a), x_, dy_, dx);
    return dx;
#else
    HLM_FAIL("{}: no CUDA support in this build", op);
#endif
  }
  const Tensor x = x_.contiguous(), dy = dy_.contiguous();
  Tensor dx = Tensor::empty(x.shape(), x.dtype());
  const int64_t n = x.numel();
  detail::dispatch_float(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* px = x.data<T>();
    const T* pdy = dy.data<T>();
    T* pdx = dx.data<T>();
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) pdx[i] = pdy[i] * act_grad(a, px[i]);
  });
  return dx;
}

}  // namespace

Tensor sigmoid_forward(const Tensor& x) {
  return forward(Act::sigmoid, "sigmoid_forward", x);
}
Tensor sigmoid_backward(const Tensor& x, const Tensor& dy) {
  return backward(Act::sigmoid, "sigmoid_backward", x, dy);
}
Tensor silu_forward(const Tensor& x) {
  return forward(Act::silu, "silu_forward", x);
}
Tensor silu_backward(const Tensor& x, const Tensor& dy) {
  return backward(Act::silu, "silu_backward", x, dy);
}
Tensor softplus_forward(const Tensor& x) {
  return forward(Act::softplus, "softplus_forward", x);
}
Tensor softplus_backward(const Tensor& x, const Tensor& dy) {
  return backward(Act::softplus, "softplus_backward", x, dy);
}

}  // namespace hlm::ops
