// The CUDA side of RMSNorm, gated RMSNorm (ops/rmsnorm.h) and the L2 norm (ops/l2norm.h): one
// family of row kernels (norms.cu). Host interface, includable from C++. The front doors
// (ops/rmsnorm.cpp, ops/l2norm.cpp) check the arguments (dtype rules in ops/op_checks.h) and
// allocate the outputs; dw accumulates. Kernels run on the default stream.
#pragma once

#include "core/tensor.h"

namespace hlm::ops::cuda {

// gate == nullptr: plain RMSNorm.
void rmsnorm_forward(const Tensor& x, const Tensor* gate, const Tensor& w, double eps, Tensor& y,
                     Tensor& rstd);
void rmsnorm_backward(const Tensor& dy, const Tensor& x, const Tensor* gate, const Tensor& w,
                      const Tensor& rstd, Tensor& dx, Tensor* dgate, Tensor& dw);
void l2norm_forward(const Tensor& x, double eps, Tensor& y, Tensor& rstd);
void l2norm_backward(const Tensor& dy, const Tensor& x, const Tensor& rstd, Tensor& dx);

}  // namespace hlm::ops::cuda
