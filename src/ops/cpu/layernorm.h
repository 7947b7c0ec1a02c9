// The CPU reference of LayerNorm (ops/layernorm.h). The front door (ops/layernorm.cpp) checks the
// arguments and allocates the outputs; tensors are contiguous, f32 or f64, one dtype.
#pragma once

#include "core/tensor.h"
#include "ops/layernorm.h"

namespace hlm::ops::cpu {

// out.y, out.mean, out.rstd written.
void layernorm_forward(const Tensor& x, const Tensor& w, const Tensor& b, double eps,
                       LayerNormResult& out);
// dx written; dw, db accumulated.
void layernorm_backward(const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& mean,
                        const Tensor& rstd, Tensor& dx, Tensor& dw, Tensor& db);

}  // namespace hlm::ops::cpu
