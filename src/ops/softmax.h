// Softmax over the last dimension, row-wise and max-subtracted:
//   y_i = exp(x_i - max_j x_j) / sum_j exp(x_j - max_j x_j)
//   dx_i = y_i (dy_i - sum_j y_j dy_j)
// x [..., D], f32 or f64 (computed in that dtype); rows in parallel, each row in index order.
// A row that is entirely -inf gives NaN (as PyTorch); masked attention rows need their own rule.
#pragma once

#include "core/tensor.h"

namespace hlm::ops {

Tensor softmax_forward(const Tensor& x);
// Takes the forward output y and dy; returns dx.
Tensor softmax_backward(const Tensor& y, const Tensor& dy);

}  // namespace hlm::ops
