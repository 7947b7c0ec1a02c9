// L2 normalisation over the last dimension (q/k of KDA; docs/kda.md, "The layer"):
//   y = x * rstd,  rstd = 1 / sqrt(sum_d x_d^2 + eps)   (eps inside the sqrt, unlike F.normalize)
//   dx = rstd * (dy - y (y . dy))
// x [..., D], f32 or f64 (computed in that dtype). Forward saves rstd [...].
// CUDA tensors run the CUDA implementation (also bf16; dtype rules in ops/op_checks.h).
#pragma once

#include "core/tensor.h"

namespace hlm::ops {

struct L2NormResult {
  Tensor y;     // [..., D]
  Tensor rstd;  // [...]
};

L2NormResult l2norm_forward(const Tensor& x, double eps = 1e-6);
// Returns dx [..., D] (y is recomputed from x and rstd).
Tensor l2norm_backward(const Tensor& dy, const Tensor& x, const Tensor& rstd);

}  // namespace hlm::ops
