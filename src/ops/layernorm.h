// LayerNorm with weight and bias over the last dimension:
//   mean = sum_i x_i / D,  var = sum_i (x_i - mean)^2 / D (biased),  rstd = 1 / sqrt(var + eps)
//   y = (x - mean) * rstd * w + b
// x [..., D], w [D], b [D]. CPU: f32 or f64, one dtype. CUDA (ops/cuda/norms.cu): also bf16 x
// with f32 (or bf16) w, b, dw, db; computed in f32 (f64 for f64); dtype rules in ops/op_checks.h.
// Forward saves mean and rstd [...] in the computation dtype. Backward writes dx and accumulates
// dw (+=) and db (+=), summing over rows in a fixed order (row order on the CPU).
#pragma once

#include "core/tensor.h"

namespace hlm::ops {

struct LayerNormResult {
  Tensor y;     // [..., D]
  Tensor mean;  // [...]
  Tensor rstd;  // [...]
};

LayerNormResult layernorm_forward(const Tensor& x, const Tensor& w, const Tensor& b,
                                  double eps = 1e-5);
// Returns dx; dw += sum_rows dy * xhat, db += sum_rows dy (xhat = (x - mean) * rstd).
Tensor layernorm_backward(const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& mean,
                          const Tensor& rstd, Tensor& dw, Tensor& db);

}  // namespace hlm::ops
