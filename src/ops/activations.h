// Elementwise activations, forward and backward, f32 or f64 (computed in the tensor's dtype),
// any shape (inputs of any strides; outputs are new contiguous tensors).
//
//   sigmoid(x)  = 1 / (1 + e^-x), evaluated as e^x / (1 + e^x) for x < 0 so that no exp overflows
//   silu(x)     = x * sigmoid(x)
//   softplus(x) = log(1 + e^x) = max(x, 0) + log1p(e^-|x|)   (stable for any |x|)
//
// Backward takes the forward input x and dy and returns dx:
//   sigmoid' = s (1 - s),  silu' = s (1 + x (1 - s)),  softplus' = sigmoid(x).
// CUDA tensors run the CUDA implementation (also bf16; dtype rules in ops/op_checks.h).
#pragma once

#include <algorithm>
#include <cmath>

#include "core/tensor.h"

namespace hlm::ops {

// The activations by name (what the implementations switch on).
enum class ActKind { sigmoid, silu, softplus };

Tensor sigmoid_forward(const Tensor& x);
Tensor sigmoid_backward(const Tensor& x, const Tensor& dy);
Tensor silu_forward(const Tensor& x);
Tensor silu_backward(const Tensor& x, const Tensor& dy);
Tensor softplus_forward(const Tensor& x);
Tensor softplus_backward(const Tensor& x, const Tensor& dy);

// Scalar forms (used by other ops' CPU code so every op shares one definition).
template <class T>
inline T sigmoid_scalar(T x) {
  if (x >= T(0)) return T(1) / (T(1) + std::exp(-x));
  const T e = std::exp(x);  // x < 0: e in (0, 1), no overflow
  return e / (T(1) + e);
}
template <class T>
inline T softplus_scalar(T x) {
  return std::max(x, T(0)) + std::log1p(std::exp(-std::fabs(x)));
}

}  // namespace hlm::ops
