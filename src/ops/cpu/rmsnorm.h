// The CPU reference of RMSNorm and gated RMSNorm (ops/rmsnorm.h). Inputs are checked by the front
// door (ops/rmsnorm.cpp): f32 or f64, one dtype; outputs are allocated by it.
#pragma once

#include "core/tensor.h"

namespace hlm::ops::cpu {

// gate == nullptr: plain RMSNorm. y [..., D], rstd [...].
void rmsnorm_forward(const Tensor& x, const Tensor* gate, const Tensor& w, double eps, Tensor& y,
                     Tensor& rstd);
// dx (and dgate when gate != nullptr) written; dw accumulated.
void rmsnorm_backward(const Tensor& dy, const Tensor& x, const Tensor* gate, const Tensor& w,
                      const Tensor& rstd, Tensor& dx, Tensor* dgate, Tensor& dw);

}  // namespace hlm::ops::cpu
