// RMSNorm and the gated RMSNorm of KDA's output, row-wise over the last dimension.
//
//   rmsnorm:        y = x * rstd * w,               rstd = 1 / sqrt(mean(x^2) + eps)
//   gated rmsnorm:  y = x * rstd * w * sigmoid(g)   (normalise, weight, gate; docs/kda.md,
//                                                    "The layer")
//
// x [..., D] (rows = all leading dims, e.g. [T, D] or [T, H, V]); w [D] shared by all rows;
// eps is inside the sqrt. f32 or f64, all tensors of one dtype; computed in that dtype, each row
// reduced in a fixed order. Forward returns y and saves rstd [...] (x's shape without D).
// Backward writes dx (and dgate) and accumulates dw (+=), reducing over rows in row order.
// CUDA tensors run the CUDA implementation (also bf16; dtype rules in ops/op_checks.h).
#pragma once

#include "core/tensor.h"

namespace hlm::ops {

struct RmsNormResult {
  Tensor y;     // [..., D]
  Tensor rstd;  // [...]: 1 / sqrt(mean(x^2) + eps) per row, saved for backward
};

RmsNormResult rmsnorm_forward(const Tensor& x, const Tensor& w, double eps = 1e-6);
// Returns dx [..., D]; dw [D] += sum over rows of dy * x * rstd.
Tensor rmsnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& rstd,
                        Tensor& dw);

// Gated: gate [..., D] like x (the raw output-gate logits).
RmsNormResult gated_rmsnorm_forward(const Tensor& x, const Tensor& gate, const Tensor& w,
                                    double eps = 1e-5);
struct GatedRmsNormGrads {
  Tensor dx;     // [..., D]
  Tensor dgate;  // [..., D]
};
// dw [D] += sum over rows of dy * sigmoid(gate) * x * rstd.
GatedRmsNormGrads gated_rmsnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& gate,
                                         const Tensor& w, const Tensor& rstd, Tensor& dw);

}  // namespace hlm::ops
