// The CUDA side of RMSNorm, gated RMSNorm (ops/rmsnorm.h), the L2 norm (ops/l2norm.h) and
// LayerNorm (ops/layernorm.h): one family of row kernels (norms.cu). Host interface, includable
// from C++. The front doors (ops/rmsnorm.cpp, ops/l2norm.cpp, ops/layernorm.cpp) check the
// arguments (dtype rules in ops/op_checks.h) and allocate the outputs; dw (and db) accumulate.
// Kernels run on the default stream.
#pragma once

#include "core/tensor.h"
#include "ops/layernorm.h"

namespace hlm::ops::cuda {

// gate == nullptr: plain RMSNorm.
void rmsnorm_forward(const Tensor& x, const Tensor* gate, const Tensor& w, double eps, Tensor& y,
                     Tensor& rstd);
void rmsnorm_backward(const Tensor& dy, const Tensor& x, const Tensor* gate, const Tensor& w,
                      const Tensor& rstd, Tensor& dx, Tensor* dgate, Tensor& dw);
void l2norm_forward(const Tensor& x, double eps, Tensor& y, Tensor& rstd);
void l2norm_backward(const Tensor& dy, const Tensor& x, const Tensor& rstd, Tensor& dx);
// out.y, out.mean, out.rstd written; dx written, dw and db accumulated.
void layernorm_forward(const Tensor& x, const Tensor& w, const Tensor& b, double eps,
                       LayerNormResult& out);
void layernorm_backward(const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& mean,
                        const Tensor& rstd, Tensor& dx, Tensor& dw, Tensor& db);

}  // namespace hlm::ops::cuda
